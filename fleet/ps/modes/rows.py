"""Where a ``fleet.nn.SparseEmbedding``'s rows live in a parameter-server job (its table backends).

The update mode (:mod:`fleet.ps.modes`) picks one. :class:`RemoteRows` (sync and async): each
forward pulls the batch's unique ids from the servers; the servers apply the row gradients,
which the mode's step sends with :meth:`RemoteRows.push`. :class:`GeoRows` (geo): rows are
cached here, trained when the optimizer holding them steps (:meth:`GeoRows.step`, like a local
table) and synced every ``k_steps``. Both take a ``guard`` from the optimizer, which waits out
a server restart.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from fleet.errors import FleetError
from fleet.ps.modes.contracts import ServerCalls
from fleet.ps.protocol.wire import SparsePush
from fleet.sparse import nonfinite
from fleet.sparse.backends import TableModule, per_row_fields
from fleet.sparse.id_index import IdIndex
from fleet.sparse.optim import OptimizerSpec
from fleet.sparse.table import SparseTable

Guard = Callable[[Callable[[], Any]], Any]


def _unguarded(fn: Callable[[], Any]) -> Any:
    return fn()


class _ServerTable:
    """What both backends ask of the servers' table as a whole (``client``, ``table_id`` and ``guard`` set)."""

    client: ServerCalls
    table_id: int
    guard: Guard
    module: TableModule | None

    def num_rows(self) -> int:
        return self.guard(lambda: self.client.sparse_rows(self.table_id).result())

    def shrink(self, threshold: float | None) -> int:
        return self.guard(lambda: self.client.shrink(self.table_id, threshold).result())

    def export(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.guard(lambda: self.client.export_sparse(self.table_id).result())

    def rows_state(self) -> dict[str, Any]:
        """Every row of the servers' table with its per-row fields, read in bounded pages (``state_dict``)."""

        def read() -> dict[str, Any]:
            ids, fields, optimizer = [], [], None
            for server in range(self.client.num_servers):
                start, total = 0, 1
                while start < total:
                    page_ids, page, total, optimizer = self.client.read_sparse_page(
                        self.table_id, server, start
                    ).result()
                    if not page_ids.numel():
                        break  # rows evicted meanwhile: the page past the end is empty
                    ids.append(page_ids)
                    fields.append(page)
                    start += page_ids.numel()
            dim = self.module.embedding_dim if self.module is not None else 0
            if not ids:
                return {"ids": torch.empty(0, dtype=torch.int64), "rows": torch.empty(0, dim)}
            out = {"ids": torch.cat(ids), **{k: torch.cat([f[k] for f in fields]) for k in fields[0]}}
            out["optimizer"] = json.dumps(optimizer, sort_keys=True)  # as a table's save says it
            return out

        return self.guard(read)

    def load_rows_state(self, state: dict[str, Any], replace: bool) -> None:
        """Write ``state``'s rows (and the per-row fields it has) to the servers, in bounded requests."""
        fields = per_row_fields(state)
        self.guard(lambda: self.client.write_sparse_rows(self.table_id, state["ids"], fields, replace).result())

    def guard_with(self, guard: Guard) -> None:
        """Run every request to the servers through ``guard`` (a worker riding out server restarts)."""
        self.guard = guard


class RemoteRows(_ServerTable):
    def __init__(self, client: ServerCalls, table_id: int, sync: bool = True, module: TableModule | None = None):
        self.client = client
        self.table_id = table_id
        self.sync = sync
        self.module = module
        self.version = 0
        self.guard: Guard = _unguarded

    def pull(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.guard(lambda: self._waited(lambda: self.client.pull_sparse(self.table_id, ids, self.version)))
        self.adopt_version(rows)
        return rows

    def _waited(self, call: Callable[[], Future]) -> Any:
        """The result of a pull this thread waits for at once: on the servers' host it may go from this thread."""
        direct = getattr(self.client, "direct", contextlib.nullcontext)  # stand-in clients have no direct path
        with direct():
            return call().result()

    def advance(self, version: int | None = None) -> None:
        """Sync: the servers' tables moved one step on (or to ``version``, after a load or a restart)."""
        self.version = self.version + 1 if version is None else version

    def take_push(self, step: int, lr: float) -> Any:
        """The module's row gradients since the last push, as the client's ``SparsePush`` (``step`` as for
        ``push_sparse_grad``: the sync step, or this worker's step count in async mode); the servers apply them."""
        ids, grads, clicks = self.module.take_gradients()
        return SparsePush(self.table_id, ids, grads, step, lr, clicks)

    def batch_key(self) -> Any:
        """Backends with the same key pull together (:func:`pull_together`): those of one client."""
        return self.client

    @staticmethod
    def pull_together(backends: list[RemoteRows], ids: list[torch.Tensor]) -> list[torch.Tensor]:
        """Rows of each backend's unique ``ids``, in one request per server for all their tables."""
        first = backends[0]
        requests = [(b.table_id, x, b.version if b.sync else 0) for b, x in zip(backends, ids, strict=True)]
        rows = first.guard(lambda: first._waited(lambda: first.client.pull_sparse_many(requests)))
        for backend, got in zip(backends, rows, strict=True):
            backend.adopt_version(got)
        return rows

    @staticmethod
    def prefetch_together(backends: list[RemoteRows], ids: list[torch.Tensor]) -> Future | None:
        """Async mode: pull every backend's ``ids`` in the background, one request per server (else None)."""
        if any(b.sync for b in backends):
            return None
        return backends[0].client.pull_sparse_many([(b.table_id, x, 0) for b, x in zip(backends, ids, strict=True)])

    def adopt_version(self, rows: torch.Tensor) -> None:
        if self.sync and self.version:
            # backup workers: a late worker finds the shards ahead and pushes for their version. (Only
            # with min_version > 0 is every server asked, so that ps_version is the oldest shard's.)
            self.version = max(self.version, int(getattr(rows, "ps_version", 0)))

    def step(self, optimizer_class: type, group: dict[str, Any]) -> None:
        """Refused: the servers apply these rows' gradients, sent by the optimizer fleet wrapped."""
        raise FleetError(
            f"sparse table {self.table_id} lives on the parameter servers, which update its rows: step the optimizer "
            "returned by fleet.distributed_optimizer, not the torch optimizer it wraps"
        )

    def prefetch(self, ids: torch.Tensor) -> Future | None:
        """Async mode: pull ``ids`` in the background (rows may be a step old there anyway)."""
        return None if self.sync else self.client.pull_sparse(self.table_id, ids)

    def collect(self, future: Future) -> torch.Tensor | None:
        """A prefetch's rows, or None when it failed (the forward then pulls again, under the guard)."""
        try:
            return future.result()
        except Exception:  # noqa: BLE001 - e.g. a server restarted meanwhile: pulled again through the guard
            return None


class GeoRows(_ServerTable):
    """Rows cached here; :meth:`num_rows`, :meth:`shrink` and :meth:`export` concern the servers' table."""

    def __init__(self, client: ServerCalls, table_id: int, module: TableModule, spec: OptimizerSpec):
        self.client = client
        self.table_id = table_id
        self.module = module
        self.local = SparseTable(module.embedding_dim, spec, module.initializer, module.seed)
        self.base = SparseTable(module.embedding_dim, spec, module.initializer, module.seed)
        self.known = IdIndex()  # ids whose rows came from the servers: O(batch) per check, not O(seen)
        self.touched: list[torch.Tensor] = []
        self.clicks: list[tuple[torch.Tensor, torch.Tensor]] = []  # (ids, clicks) recorded since the last sync
        self.guard: Guard = _unguarded

    def load_rows_state(self, state: dict[str, Any], replace: bool) -> None:
        """Write rows to the servers; the rows cached here are fetched again."""
        super().load_rows_state(state, replace)
        self.forget()

    def forget(self) -> None:
        """After a server restart: every row is fetched from the servers again; unsynced changes are dropped."""
        self.known = IdIndex()
        self.touched = []
        self.clicks = []

    def _fetch(self, ids: torch.Tensor) -> None:
        missing = ids[self.known.lookup(ids) < 0]
        if missing.numel():
            new = torch.unique(missing)
            self._rebase(new, self.client.pull_sparse(self.table_id, new).result())
            self.known.insert_new(new)  # only once the rows arrived

    def _rebase(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        self.local.add_delta(ids, rows - self.local.pull(ids))
        self.base.add_delta(ids, rows - self.base.pull(ids))

    def pull(self, ids: torch.Tensor) -> torch.Tensor:
        self.guard(lambda: self._fetch(ids))
        return self.local.pull(ids)

    def step(self, optimizer_class: type, group: dict[str, Any]) -> None:
        """The optimizer holding the module stepped (geo steps the user's optimizer locally): apply the rows'
        gradients to the cached rows; the clicks go to the servers with the next sync's deltas."""
        ids, grads, clicks = self.module.take_gradients()
        if not nonfinite.finite(grads, clicks, float(group["lr"])):  # the cached rows would keep it for good
            nonfinite.refuse(f"sparse table {self.table_id}", None, "geo's local step of its cached rows")
            return
        self.apply(ids, grads, float(group["lr"]))
        if clicks is not None and ids.numel():
            self.clicks.append((ids, clicks))

    def apply(self, ids: torch.Tensor, grads: torch.Tensor, lr: float) -> None:
        if ids.numel():
            self.local.apply_gradient(ids, grads, lr)
            self.touched.append(ids)

    def sync(self, step: int = 0) -> None:
        """Push the changes since the last sync (``step``: this worker's step count, the servers' clock)."""
        if not self.touched:
            return
        ids = torch.unique(torch.cat(self.touched))
        self.touched = []
        clicks = None
        if self.clicks:  # every id's clicks since the last sync, summed (each recorded id was touched)
            clicked = torch.cat([i for i, _ in self.clicks])
            clicks = torch.zeros(ids.numel()).index_add_(
                0, torch.searchsorted(ids, clicked), torch.cat([c for _, c in self.clicks])
            )
            self.clicks = []
        delta = self.local.pull(ids) - self.base.pull(ids)
        self.client.push_sparse_delta(self.table_id, ids, delta, step, clicks).result()
        self._rebase(ids, self.client.pull_sparse(self.table_id, ids).result())
