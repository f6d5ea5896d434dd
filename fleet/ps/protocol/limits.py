"""How much one parameter-server request may carry, and how the client splits what is bigger.

Why: a server is one loop answering every worker in turn, so one request's cost is every
other worker's wait. Measured before these limits, one sparse pull of 4 M fresh ids held the
loop for 37.6 s (and 2.1 GB) while the other workers made 3 steps in 70 s. Now a sparse pull
or push carries at most :attr:`RequestLimits.max_ids` ids and :attr:`RequestLimits.max_bytes`
bytes (ids, rows and clicks; a pull's reply rows count too), :class:`~fleet.ps.client.client.PSClient`
cuts bigger batches into requests under both -- transparently, the result is the same -- and
a server refuses a request over its limits with an error that names them. The loop then
turns between any two pieces of a huge batch, and the other workers' requests go in
between (ZeroMQ queues the peers fairly).

What is not cut: a dense table's push and pull carry exactly the table's shard (its size is
fixed when the table is created); more servers make smaller shards.

The limits are strategy settings (``DistributedStrategy.max_request_ids`` and
``max_request_mb``) rather than constants because the right size depends on the rows' width
and on how long a job can let one request hold a server; servers and workers must run with
the same values, which they do when they share the strategy.

This module imports nothing heavy: ``fleet.strategy`` reads its defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: ids one sparse request carries by default: 15-30 ms of server work for fresh rows of dim 8 on one
#: core (creating rows dominates), about 1.5 ms for existing rows; W2's batches (13,312 ids) stay whole.
#: Smaller pieces let other workers in sooner (their requests wait for the piece being served) at
#: about 0.2 ms of overhead per piece.
DEFAULT_MAX_REQUEST_IDS = 16384
#: A call over the limit is a huge batch: it goes in pieces of this fraction of the limit (1,024 ids by
#: default, ~2-3 ms of server work even for fresh rows), so another worker's request, which waits for the
#: piece being served, waits a few ms rather than ~20. Measured on 2 cores beside a 4 M-id pull of fresh
#: rows, a worker computing 20 ms per step kept 37 % of its pace with 16,384-id pieces, 60 % with 2,048
#: and 69 % with 1,024 (76 % with 512, the pull taking 6.3, 8.5, 10.2 and 13 s); 80-82 % with 1,024 once
#: the id index's growth work per request became proportional to the request (fleet.sparse.id_index).
#: Calls under the limit (every normal batch) stay whole.
HUGE_BATCH_PIECE_FRACTION = 16
#: bytes one sparse request (or its reply) carries by default, in MiB: one 4 MiB frame per tensor
DEFAULT_MAX_REQUEST_MB = 4.0
#: per id, what a sparse request carries besides the row: the id (int64) and its click (float32)
ID_BYTES = 12
#: room for a request's blob (table configs, paths, JSON) on top of its tensors
BLOB_SLACK = 1 << 16


class RequestLimitError(ValueError):
    """A request over the limits (sent back to the worker as an error naming them)."""


@dataclass(frozen=True, slots=True)
class Limit:
    """A payload budget in bytes and the sentence that explains it (the limit and its setting)."""

    bytes: int
    explain: str


@dataclass(frozen=True)
class RequestLimits:
    """What one sparse request may carry; the client splits, the server enforces."""

    max_ids: int = DEFAULT_MAX_REQUEST_IDS
    max_bytes: int = int(DEFAULT_MAX_REQUEST_MB * (1 << 20))

    def __post_init__(self) -> None:
        if self.max_ids < 1:
            raise ValueError(f"max_ids={self.max_ids}; a request must carry at least one id")
        if self.max_bytes < 1024:
            raise ValueError(f"max_bytes={self.max_bytes}; a request must carry at least 1 KiB")

    @classmethod
    def from_strategy(cls, config: Any) -> RequestLimits:
        """The limits a :class:`~fleet.strategy.DistributedStrategy` sets (defaults without one)."""
        if config is None:
            return cls()
        return cls(int(config.max_request_ids), int(float(config.max_request_mb) * (1 << 20)))

    def setting(self) -> str:
        mb = self.max_bytes / (1 << 20)
        return f"DistributedStrategy.max_request_ids = {self.max_ids}, max_request_mb = {mb:g}"

    def ids_per_request(self, dim: int) -> int:
        """How many ids of rows of width ``dim`` one request carries (at least one)."""
        return max(1, min(self.max_ids, self.max_bytes // (ID_BYTES + 4 * int(dim))))

    def rows_per_request(self, width: int) -> int:
        """How many whole rows of ``width`` float32 values (all of a row's fields) one request or reply carries."""
        return self.ids_per_request(width)

    def piece_ids(self, dim: int) -> int:
        """How many ids each piece of a call over :meth:`ids_per_request` carries."""
        return max(1, self.ids_per_request(dim) // HUGE_BATCH_PIECE_FRACTION)

    def check_ids(self, what: str, table: int, count: int, dim: int) -> None:
        """Refuse a sparse request of ``count`` ids that the client should have split."""
        most = self.ids_per_request(dim)
        if count > most:
            raise RequestLimitError(
                f"{what} of table {table} carries {count:,} ids (rows of dim {dim}); one request carries at "
                f"most {most:,} here ({self.setting()} on this server). PSClient splits bigger batches by "
                "the same settings: run servers and workers with the same strategy"
            )

    def budget(self) -> Limit:
        """The bytes any request other than a dense table's values may carry."""
        return Limit(
            self.max_bytes + BLOB_SLACK,
            f"a request carries at most {self.max_bytes + BLOB_SLACK:,} ({self.setting()}, plus "
            f"{BLOB_SLACK:,} for its blob); PSClient splits sparse batches under it",
        )
