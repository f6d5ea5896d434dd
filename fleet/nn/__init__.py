"""fleet.nn: modules that work in every fleet mode."""

from fleet.nn.sparse_embedding import SparseEmbedding

__all__ = ["SparseEmbedding"]
