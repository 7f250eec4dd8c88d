"""The option of the frozen input embedding table kept in host memory."""

from __future__ import annotations

from dataclasses import dataclass

from offloadkit.options import Options, option

__all__ = ["EmbeddingOptions"]


@dataclass
class EmbeddingOptions(Options):
    """Where a frozen input embedding table lives.

    Attributes:
        offload: ``embedding_offloading``: keep a frozen (LoRA, QLoRA) input embedding table in
            pinned host memory, which the GPU reads in place for the rows a batch looks up
            (zero-copy), instead of on the GPU: its bytes (1 GiB for Llama-3-8B's 128K x 4096
            in bf16) go to the step. Lookups are exact; each step reads its tokens' rows over
            the bus (8 KiB a token at 4096 wide). A table that trains, or that the output head
            shares (tied embeddings), stays on the GPU, with a note.
    """

    offload: bool = option(False, "embedding_offloading")

    def __post_init__(self) -> None:
        self._bool("offload")
