"""fleet.nn: modules that work in every fleet mode."""

from fleet.nn.sparse_embedding import SparseEmbedding
from fleet.nn.sparse_embedding_bag import SparseEmbeddingBag

__all__ = ["SparseEmbedding", "SparseEmbeddingBag"]
