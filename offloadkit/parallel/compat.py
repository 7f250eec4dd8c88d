"""What does not combine with FSDP2, refused before the first step with one line naming both
things and what to do instead.

Every feature was run under DDP and under FSDP2 (``fully_shard`` per decoder layer, then the
root) on two CPU ranks over gloo against the same wrapper without it
(``tests/cpu/test_distributed_matrix.py``, ``docs/multi-gpu.md``). Under DDP all of them run,
layer streaming of a frozen base included (DDP reduces only the trainable gradients; each rank
streams its own copy of the frozen weights). Under FSDP2 two things cannot run:

* layer streaming: FSDP2 owns the storage of the weights it shards; streaming them would make
  two owners of one storage (and a streamer attached before ``fully_shard`` would stream the
  weights FSDP2 has just replaced, saving nothing). FSDP2's own ``CPUOffloadPolicy`` keeps
  the shards in host memory instead.
* block inputs recomputed in backward (``recompute_block_inputs``, a ``"recompute"`` place of
  ``block_input_placement``) where decoder layers are sharded on their own: the replay runs
  the blocks before in backward without their module hooks, which is where FSDP2 gathers a
  layer's weights. (Sharded only at the root, the weights stay gathered from forward to
  backward, and the replay runs.)

:func:`check_parallel` is what :func:`~offloadkit.prepare` runs on the config it applies (the
plan's, under ``offload_plan: auto``) once the model is sharded; the messages are shared with
the checks the features make themselves when the model is sharded after they were attached.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from offloadkit.config import OffloadConfig

__all__ = ["check_parallel", "fsdp2_sharded", "fsdp2_sharded_block", "recompute_refusal", "streaming_refusal"]


def fsdp2_sharded(model: nn.Module) -> str | None:
    """The name of the first module inside ``model`` that FSDP2 shards (``"the model"`` where
    only ``model`` itself is), None when FSDP2 shards none (or this build of torch has no FSDP2)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a build without distributed
        return None
    sharded = [name for name, module in model.named_modules() if isinstance(module, FSDPModule)]
    if not sharded:
        return None
    return next((name for name in sharded if name), "the model")


def fsdp2_sharded_block(model: nn.Module) -> str | None:
    """The name of the first decoder layer of ``model`` that FSDP2 shards on its own
    (``fully_shard(layer)``, or a module inside it), None when none is (only the root, say:
    its weights stay gathered from its forward to its backward)."""
    from offloadkit.models.blocks import find_blocks

    try:
        blocks = find_blocks(model)
    except ValueError:  # no decoder layers: nothing is checkpointed either
        return None
    return next((name for name, block in blocks if fsdp2_sharded(block) is not None), None)


def streaming_refusal(where: str, how: str = "") -> str:
    """Layer streaming of weights FSDP2 shards, ``where`` naming a sharded module; ``how``
    (e.g. " (chosen by offload_plan: auto)") follows the feature's name."""
    return (
        f"layer_offloading{how} cannot stream weights that FSDP2 shards ({where} is fully_shard-ed); keep the "
        "shards in host memory with FSDP2's own offloading instead: fully_shard(module, "
        "offload_policy=CPUOffloadPolicy()), or stream layers without FSDP2 (one GPU, or DDP)"
    )


def recompute_refusal(where: str, how: str = "") -> str:
    """Block inputs recomputed in backward from blocks FSDP2 shards, ``where`` naming one;
    ``how`` follows the feature's name."""
    return (
        f"recompute_block_inputs{how} cannot replay blocks that FSDP2 shards ({where} is fully_shard-ed: a "
        "replay runs the blocks before in backward without the hooks through which FSDP2 gathers their "
        "weights); keep every block input somewhere instead: in RAM or on disk (activation_offloading, "
        "block_input_placement without recompute), or recompute them under DDP or with FSDP2 at the root only"
    )


def _dropped_inputs(config: OffloadConfig) -> tuple[int, ...]:
    from offloadkit.checkpointing.options import CheckpointOptions

    ckpt = config.options(CheckpointOptions)
    if not ckpt.enabled:
        return ()
    places = ckpt.block_input_placement
    return tuple(i for i, place in enumerate(places) if place == "recompute") or ckpt.recompute_block_inputs


def check_parallel(
    model: nn.Module, config: OffloadConfig, *, planned: bool = False, hf_checkpointing: bool = False
) -> None:
    """Refuse what ``config`` asks of ``model`` that cannot run where FSDP2 shards it.

    Args:
        planned: the config is a plan's (``offload_plan: auto``): the message says it chose it.
        hf_checkpointing: Hugging Face's checkpointing is on (the caller asks checkpointing:
            this module stays below it).

    Raises:
        ConfigError: one line naming the feature, FSDP2 and the alternative.
    """
    from offloadkit.errors import ConfigError

    where = fsdp2_sharded(model)
    if where is None:
        return
    if config.layer_offloading:
        raise ConfigError(streaming_refusal(where, " (chosen by offload_plan: auto)" if planned else ""))
    dropped = _dropped_inputs(config)
    # Under Hugging Face's checkpointing it has no effect (said by checkpointing's build).
    where = fsdp2_sharded_block(model) if dropped and not hf_checkpointing else None
    if where is not None:
        chosen = (
            f" (offload_plan: auto chose layers {list(dropped)}; give block_input_placement yourself with "
            "offload_plan: none)"
            if planned
            else ""
        )
        raise ConfigError(recompute_refusal(where, chosen))
