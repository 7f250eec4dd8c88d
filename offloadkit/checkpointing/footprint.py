"""What checkpointing costs in one step beyond one layer's recompute, beside its code: a
replayed run's recomputed block inputs (``recompute_block_inputs``: ``runtime/recompute.py``
holds them until backward passes them) and the attention outputs kept in host RAM for the
last layers' recompute (``keep_attention_outputs``: ``attention.py``)."""

from __future__ import annotations

from offloadkit.checkpointing.options import CheckpointOptions
from offloadkit.component import Footprint, FootprintOptions
from offloadkit.component import FootprintWorkload as Workload
from offloadkit.storage.footprint import block_placement, offloads_inputs, region_length

__all__ = ["attention_kept_bytes", "checkpointing_footprint", "keeps_attention"]


def attention_kept_bytes(w: Workload) -> int:
    """One layer's attention output (bf16, as wide as q) and fp32 log-sum-exp per head."""
    s = w.shape
    return w.tokens * (w.dtype_bytes * s.heads * s.head_dim + 4 * s.heads)


def keeps_attention(w: Workload, f: FootprintOptions) -> int:
    """Layers whose attention outputs are kept (``keep_attention``: True for every layer; it
    needs block inputs offloaded, by checkpointing)."""
    if not offloads_inputs(f):
        return 0
    keep = f.of(CheckpointOptions).keep_attention
    return w.shape.layers if keep is True else int(keep)


def checkpointing_footprint(w: Workload, f: FootprintOptions) -> Footprint:
    """The replayed run's recomputed inputs, held while its last block runs backward, and the
    kept attention outputs in host RAM."""
    layer = {}
    if f.of(CheckpointOptions).enabled:
        replayed = region_length(block_placement(w.shape.layers, f))
        if replayed > 1:
            layer["replayed block inputs"] = (replayed - 1) * w.block_input_bytes
    kept = keeps_attention(w, f)
    host = {"kept attention outputs": kept * attention_kept_bytes(w)} if kept else {}
    return Footprint(layer=layer, host=host)
