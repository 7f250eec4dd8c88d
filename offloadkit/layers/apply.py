"""Attaching layer streaming to a model: find its blocks, refuse what cannot be streamed,
build the :class:`~offloadkit.layers.streaming.LayerStreamer`."""

from __future__ import annotations

import torch
from torch import nn

from offloadkit.defaults import STREAM_DEPTH
from offloadkit.layers.streaming import LayerStreamer
from offloadkit.models.blocks import find_blocks
from offloadkit.parallel.compat import fsdp2_sharded, streaming_refusal
from offloadkit.storage.budget import HostMemoryBudget
from offloadkit.transfer.prefetch import PrefetchScheduler
from offloadkit.transfer.timeline import StepTimeline

__all__ = ["apply_layer_streaming"]


def _refuse_fsdp2(model: nn.Module) -> None:
    """FSDP2 owns the storage of the parameters it shards (it swaps them in and out itself):
    two owners of one storage cannot coexist."""
    where = fsdp2_sharded(model)
    if where is not None:
        raise ValueError(streaming_refusal(where))


def apply_layer_streaming(
    model: nn.Module,
    *,
    block_types=None,
    predicate=None,
    depth: int = STREAM_DEPTH,
    use_pin_memory: bool = True,
    host_budget_bytes: int | None = None,
    budget: HostMemoryBudget | None = None,
    head: nn.Module | None = None,
    device: torch.device | str | None = None,
    trainable: bool = False,
    scheduler: PrefetchScheduler | None = None,
    disk_dir: str | None = None,
    timeline: StepTimeline | None = None,
) -> LayerStreamer:
    """Stream the weights of ``model``'s blocks (decoder layers) from pinned host memory.

    Args:
        model: a model whose blocks hold frozen weights (LoRA/QLoRA base models), or
            trainable ones with ``trainable=True``.
        block_types / predicate: name the blocks explicitly (see :func:`find_blocks`).
        depth: layers of frozen weights resident at once (2 = double buffering).
        use_pin_memory: page-lock the host copies (needed for asynchronous copies).
        host_budget_bytes / budget: host-memory budget for the copies.
        head: the output head (auto-detected) whose backward starts the reverse prefetch.
        device: where the weights are streamed to; the current CUDA device by default.
            ``"cpu"`` keeps the whole bookkeeping (loads, evictions, prefetch order) with CPU
            memory standing in for the device and no copy overlap: it saves nothing, and is
            there to check a setup on a machine without a GPU.
        trainable: stream the blocks' trainable weights too (a full fine-tune). Pair it with
            an optimizer that updates in backward (:class:`~offloadkit.optim.BackwardAdamW`):
            the update then runs while the block is resident and is written back to the host
            as the block leaves. Shared (tied) weights stay on the GPU.
        scheduler: the :class:`~offloadkit.transfer.PrefetchScheduler` the look-ahead runs in,
            shared with activation offloading (None: one of its own).
        disk_dir: blocks whose pinned copy the host budget refuses keep it in a file in a
            private directory made here, read back through pinned staging buffers on I/O
            threads (trainable ones need updates in backward; see
            :mod:`offloadkit.layers.weight_files`); None: a refusal is an error.
        timeline: the :class:`~offloadkit.transfer.StepTimeline` whose points (forward start,
            the blocks, the head, the end of backward) drive the streaming, shared with
            activation offloading (None: one of its own on ``model`` and ``head``).

    Returns:
        The :class:`LayerStreamer`; ``streamer.remove()`` restores the model.

    Example:
        >>> streamer = apply_layer_streaming(peft_model)
        >>> loss = peft_model(**batch).loss; loss.backward()
    """
    _refuse_fsdp2(model)
    blocks = find_blocks(model, tuple(block_types) if block_types is not None else None, predicate)
    if budget is None:
        budget = HostMemoryBudget(host_budget_bytes)
    return LayerStreamer(
        model,
        blocks,
        depth=depth,
        use_pin_memory=use_pin_memory,
        budget=budget,
        head=head,
        device=device,
        trainable=trainable,
        scheduler=scheduler,
        disk_dir=disk_dir,
        timeline=timeline,
    )
