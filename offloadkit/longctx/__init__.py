"""Long-context training: memory that grows with sequence length, bounded per layer."""

from offloadkit.longctx.loss import chunked_cross_entropy

__all__ = ["chunked_cross_entropy"]
