"""A frozen input embedding table kept in pinned host memory, read by the GPU in place
(``embedding_offloading: true``)."""

from offloadkit.embeddings.host_table import HostEmbeddings, offload_embeddings
from offloadkit.embeddings.options import EmbeddingOptions

__all__ = ["EmbeddingOptions", "HostEmbeddings", "offload_embeddings"]
