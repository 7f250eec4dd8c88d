"""What checkpointing costs in one step beyond one layer's recompute, beside its code: a
replayed run's recomputed block inputs (``recompute_block_inputs``: ``runtime/recompute.py``
holds them until backward passes them), the attention outputs kept in host RAM for the
last layers' recompute (``keep_attention_outputs``: ``attention.py``), and, with selective
checkpointing (``selective.py``), the chosen ops' outputs every layer holds on the GPU from
its forward to its backward, whose recompute then skips them."""

from __future__ import annotations

from offloadkit.checkpointing.options import CheckpointOptions
from offloadkit.component import Footprint, FootprintOptions
from offloadkit.component import FootprintWorkload as Workload
from offloadkit.storage.footprint import block_placement, offloads_inputs, region_length

__all__ = [
    "attention_kept_bytes",
    "checkpointing_footprint",
    "keeps_attention",
    "selective_recompute_skips",
    "selective_saved_bytes",
]


def attention_kept_bytes(w: Workload) -> int:
    """One layer's attention output (bf16, as wide as q) and fp32 log-sum-exp per head."""
    s = w.shape
    return w.tokens * (w.dtype_bytes * s.heads * s.head_dim + 4 * s.heads)


def keeps_attention(w: Workload, f: FootprintOptions) -> int:
    """Layers whose attention outputs are kept (``keep_attention``: True for every layer; it
    needs block inputs offloaded, by checkpointing)."""
    if not offloads_inputs(f) or f.of(CheckpointOptions).selective:
        return 0  # selective checkpointing's recompute takes the saved outputs instead
    keep = f.of(CheckpointOptions).keep_attention
    return w.shape.layers if keep is True else int(keep)


def selective_saved_bytes(w: Workload, f: FootprintOptions) -> int:
    """What selective checkpointing saves in one decoder layer: the outputs of its matmuls
    ("mm": every linear's output; PEFT's adapters add their rank-r and full-width outputs in
    the adapters' dtype) and of its attention kernel ("attention": the output and its fp32
    log-sum-exp). ``tests/cpu/test_selective_footprint.py`` holds it to the bytes those ops
    return in a layer's forward."""
    c = f.of(CheckpointOptions)
    if not c.enabled or not c.selective:
        return 0
    s, t, b = w.shape, w.tokens, w.dtype_bytes
    total = 0
    if "mm" in c.selective:
        widths = sum(out for _, out in s.linears)
        per_token = b * widths
        if w.lora_rank:
            # PEFT's adapters (the fused path's in-place sum is refused with "mm": config.py).
            per_token += w.adapter_bytes * (len(s.linears) * w.lora_rank + widths)
        total += t * per_token
    if "attention" in c.selective:
        total += attention_kept_bytes(w)
    return total


def selective_recompute_skips(w: Workload, f: FootprintOptions) -> tuple[bool, bool]:
    """Whether a layer's recompute skips its matmuls, and its attention forward (their outputs
    saved by selective checkpointing)."""
    c = f.of(CheckpointOptions)
    chosen = c.selective if c.enabled and c.selective else ()
    return "mm" in chosen, "attention" in chosen


def checkpointing_footprint(w: Workload, f: FootprintOptions) -> Footprint:
    """The replayed run's recomputed inputs, held while its last block runs backward, the
    kept attention outputs in host RAM, and every layer's selectively saved outputs."""
    layer = {}
    if f.of(CheckpointOptions).enabled:
        replayed = region_length(block_placement(w.shape.layers, f))
        if replayed > 1:
            layer["replayed block inputs"] = (replayed - 1) * w.block_input_bytes
    kept = keeps_attention(w, f)
    host = {"kept attention outputs": kept * attention_kept_bytes(w)} if kept else {}
    saved = selective_saved_bytes(w, f)
    per_layer = {"selective saves": saved} if saved else {}
    return Footprint(layer=layer, host=host, per_layer=per_layer)
