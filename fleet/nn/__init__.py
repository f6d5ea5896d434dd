"""fleet.nn: modules that work in every fleet mode, and the row-wise Adagrad their tables may train with."""

from fleet.nn.feature_collection import FeatureTable, JaggedFeatures, SparseFeatureCollection
from fleet.nn.sparse_embedding import SparseEmbedding
from fleet.nn.sparse_embedding_bag import SparseEmbeddingBag
from fleet.sparse.row_optimizers.rowwise_adagrad import RowWiseAdagrad

__all__ = [
    "FeatureTable",
    "JaggedFeatures",
    "RowWiseAdagrad",
    "SparseEmbedding",
    "SparseEmbeddingBag",
    "SparseFeatureCollection",
]
