"""Long-context training: memory that grows with sequence length, bounded per layer."""

from offloadkit.longctx.causal_lm import ChunkedLossHandle, apply_chunked_loss
from offloadkit.longctx.loss import chunked_cross_entropy
from offloadkit.longctx.tiled_mlp import TiledMLPHandle, apply_tiled_mlp, tiled_forward

__all__ = ["ChunkedLossHandle", "TiledMLPHandle", "apply_chunked_loss", "apply_tiled_mlp",
           "chunked_cross_entropy", "tiled_forward"]
