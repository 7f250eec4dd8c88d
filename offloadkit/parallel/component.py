"""Context parallelism as :func:`~offloadkit.prepare` builds it: the model's attention switched
to ring attention over every rank of the process group. The training loop then runs each step
inside ``cp.step`` (the Trainer mixins do, every rank's batch in turn: ``parallel/turns.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import nn

from offloadkit.component import Component
from offloadkit.parallel.context import ContextParallel, apply_context_parallel
from offloadkit.parallel.footprint import context_parallel_footprint
from offloadkit.parallel.options import ParallelOptions

if TYPE_CHECKING:
    from offloadkit.compose import OffloadRuntime

__all__ = ["CONTEXT_PARALLEL"]


def build_context_parallel(model: nn.Module, options: ParallelOptions, run: OffloadRuntime) -> ContextParallel | None:
    if not options.enabled:
        return None
    ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if ranks == 1:
        run.note("context_parallel has no effect with one process: launch with torchrun or accelerate launch")
        return None
    return apply_context_parallel(model, rotation=options.rotation)  # auto unplanned: allgather


def report_context_parallel(cp: ContextParallel) -> dict:
    return {"context_parallel": {"ranks": cp.world}}


CONTEXT_PARALLEL = Component(
    name="context_parallel",
    options=ParallelOptions,
    why_here="first: it switches the attention function that head groups, kept outputs and checkpointing run",
    build=build_context_parallel,
    report=report_context_parallel,
    footprint=context_parallel_footprint,
)
