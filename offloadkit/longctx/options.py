"""The long-context parts' options (chunked loss, tiled MLP), read from the config keys of the
same names."""

from __future__ import annotations

from dataclasses import dataclass

from offloadkit.options import Options, option

__all__ = ["LongContextOptions"]


@dataclass
class LongContextOptions(Options):
    """The loss over token chunks and the MLP over sequence shards.

    Attributes:
        chunked_loss: ``chunked_cross_entropy``: compute the loss over token chunks, never
            holding the full-vocabulary logits (Hugging Face causal LMs).
        loss_chunks: ``chunked_cross_entropy_num_chunks``: chunks per loss; None: automatic (at
            most 1 GiB of fp32 logits a chunk).
        tiled_mlp: ``tiled_mlp``: run each decoder layer's MLP over sequence shards (Axolotl's
            name).
        mlp_shards: ``tiled_mlp_num_shards``: shards per MLP call; None or "auto": one shard's
            intermediate at most 2**28 elements (untiled when that is one shard).
        tiled_projections: ``tiled_projections``: with the tiled MLP, also run each layer's norms
            and attention projections (with their adapters) over shards, so they save only
            their bf16 inputs (no fp32 upcasts or adapter input copies); with automatic shards
            they run untiled below ``2**28 / hidden`` tokens.
        head_groups: ``attention_head_groups``: run each layer's attention (SDPA) one group of
            key/value heads at a time (>= 2), so its backward holds one group's kernel
            workspace (the largest transient at long context); None: whole
            (``offload_plan: auto`` sets it at long context).
    """

    chunked_loss: bool = option(False, "chunked_cross_entropy")
    loss_chunks: int | None = option(None, "chunked_cross_entropy_num_chunks")
    tiled_mlp: bool = option(False, "tiled_mlp")
    mlp_shards: int | None = option(None, "tiled_mlp_num_shards")
    tiled_projections: bool = option(False, "tiled_projections")
    head_groups: int | None = option(None, "attention_head_groups")

    def __post_init__(self) -> None:
        for name in ("chunked_loss", "tiled_mlp", "tiled_projections"):
            self._bool(name)
        self._int("loss_chunks", 1, "or omit it for automatic", optional=True)
        self._int("mlp_shards", 1, "or omit it for automatic", optional=True)
        self._int(
            "head_groups", 2, "key/value head groups per attention call; omit it to run attention whole", optional=True
        )
        if self.tiled_projections and not self.tiled_mlp:
            raise ValueError(
                f"{self.said('tiled_projections', True)} needs {self.said('tiled_mlp', True)} "
                "(it extends the MLP's tiling to the norms and attention projections)"
            )
