"""Long-context training: memory that grows with sequence length, bounded per layer."""

from offloadkit.longctx.loss import chunked_cross_entropy
from offloadkit.longctx.tiled_mlp import TiledMLPHandle, apply_tiled_mlp, tiled_forward

__all__ = ["TiledMLPHandle", "apply_tiled_mlp", "chunked_cross_entropy", "tiled_forward"]
