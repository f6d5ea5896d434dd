"""Server-side table shards: when pushes reach a table, under its update mode's server policy.

A shard wraps one table (dense or sparse) held by one server and decides *when* pushes reach it;
the table decides *how* (its optimizer). The rules (sync steps, pushes in pieces, all-or-nothing
changes, non-finite pushes) are in :mod:`fleet.ps.server.shards.base`; the two kinds are
:class:`~fleet.ps.server.shards.dense.DenseShard` and :class:`~fleet.ps.server.shards.sparse.SparseShard`.
This module is the one name the server's other modules (the loop, the table requests, loads) use
for them, and :class:`ShardError` is what they raise (caught by the loop, answered as an error).
"""

from __future__ import annotations

from fleet.ps.protocol.errors import ShardError
from fleet.ps.server.shards.base import Shard, canonical
from fleet.ps.server.shards.dense import DenseShard, pieces_of
from fleet.ps.server.shards.sparse import SparseShard

__all__ = ["DenseShard", "Shard", "ShardError", "SparseShard", "canonical", "pieces_of"]
