from sparse_contract import IndexerContract, SparseAttentionContract


class TestReferenceSparseAttention(SparseAttentionContract):
  backend = "reference"


class TestReferenceIndexer(IndexerContract):
  backend = "reference"
