"""Activation offloading as :func:`~offloadkit.prepare` builds it: the whole-model manager on the
run's step timeline, host budget and prefetch scheduler, and the last block's inputs kept by
the checkpointing built before it."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
from torch import nn

from offloadkit.api import get_act_offloading_ctx_manager
from offloadkit.checkpointing.options import CheckpointOptions
from offloadkit.component import Component
from offloadkit.engine.footprint import activations_footprint
from offloadkit.engine.offload import OffloadActivations
from offloadkit.engine.options import ActivationOptions
from offloadkit.storage.disk import DiskOptions

if TYPE_CHECKING:
    from offloadkit.compose import OffloadRuntime

__all__ = ["ACTIVATIONS"]


def build_activations(model: nn.Module, options: ActivationOptions, run: OffloadRuntime) -> OffloadActivations | None:
    manager = None
    mode = options.mode
    cuda = torch.cuda.is_available()
    if mode and mode in (True, "legacy") and not cuda:
        run.note(
            f"activation_offloading: {mode} has no effect without a CUDA GPU "
            "(use activation_offloading: disk to move CPU activations to disk)"
        )
    elif mode:
        disk = run.config.options(DiskOptions) if mode == "disk" else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the CPU-only message is replaced by ours
            manager = get_act_offloading_ctx_manager(
                model,
                use_pin_memory=options.use_pin_memory,
                use_streams=mode != "legacy",
                min_offload_size=options.min_offload_size,
                max_fwd_stash_size=options.max_fwd_stash_size,
                prefetch=options.loading_horizon,
                prefetch_bytes=options.prefetch_bytes,
                budget=run.handles["host_budget"],
                storage=options.storage,
                disk=disk,
                offload_cpu_tensors=not cuda,
                scheduler=run.scheduler,
                timeline=run.step_timeline(),
            )
    # Wiring to the checkpointing built before: the last block's inputs are needed first in backward.
    if run.checkpointing is not None and manager is not None:
        run.checkpointing.keep_last_input_from(manager)
    elif run.config.options(CheckpointOptions).gpu_block_inputs:
        run.note(
            "gpu_block_inputs has no effect: it keeps block inputs of offloadkit's checkpointing on the GPU, "
            "and this run has no such checkpointing with activation offloading"
        )
    return manager


def report_activations(manager: OffloadActivations) -> dict:
    return {"activations": manager.collect_stats().as_dict(), "storage": manager.storage_stats()}


def close_activations(manager: OffloadActivations) -> None:
    manager.close()


ACTIVATIONS = Component(
    name="activations",
    options=ActivationOptions,
    why_here="after checkpointing (it sees only the checkpoints' inputs as saves), on the timeline made after it",
    build=build_activations,
    report=report_activations,
    remove=close_activations,
    footprint=activations_footprint,
)
