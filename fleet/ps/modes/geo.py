"""``update="geo"``: workers train locally and push deltas every ``k_steps`` (Paddle's GEO-SGD).

Worker: the user's optimizer steps locally (dense values and, through its step hook, the
SparseEmbedding rows cached in :class:`~fleet.ps.modes.rows.GeoRows`); every ``k_steps`` the
changes since the last sync are pushed and the values rebased on the servers'.

Server: a delta is added on arrival; gradients are refused.

Non-finite gradients (:mod:`fleet.sparse.nonfinite`): the local step is where they would enter
(the user's optimizer state and the cached rows keep a NaN for good), so a step whose dense
gradients hold NaN or Inf is skipped whole, rows included, as ``GradScaler`` skips it; rows whose
gradients alone hold NaN or Inf skip their table's local step (:meth:`GeoRows.step`). The servers
check every delta too.
"""

from __future__ import annotations

import time
from typing import Any

from fleet.ps.modes.base import UpdateMode, WorkerPolicy
from fleet.ps.modes.contracts import ServerCalls, WorkerHost
from fleet.ps.modes.rows import GeoRows
from fleet.sparse import nonfinite
from fleet.sparse.backends import TableModule
from fleet.sparse.optim import OptimizerSpec
from fleet.telemetry import timing


class GeoStep(WorkerPolicy):
    def __init__(self, host: WorkerHost, k_steps: int):
        super().__init__(host)
        self.k_steps = k_steps

    def step(self) -> float:
        host = self.host
        started = time.perf_counter()
        bad = [e for e in host.tables.entries if not nonfinite.finite(*(p.grad for p in e.params))]
        if bad:
            tables = " and ".join(f"dense table {e.table_id}" for e in bad)
            nonfinite.refuse(tables, self.steps + 1, "geo's local step, skipped whole with its rows")
            for module, _, _ in host.sparse:
                module.take_gradients()  # the skipped step's row gradients go with it
            return time.perf_counter() - started
        host.inner.step()  # the rows too: GeoRows.step, run by the step hook of the optimizer holding them
        for entry in host.tables.entries:
            entry.mark_clean()  # geo's own local step: its change reaches the servers as the next delta
        self.steps += 1
        local_s = time.perf_counter() - started
        if self.steps % self.k_steps == 0:
            self.sync()
        return local_s

    def sync(self) -> None:
        host = self.host
        tables = host.tables
        deltas = [e.values() - e.base for e in tables.entries]
        futures = [host.client.push_dense_delta(e.table_id, d) for e, d in zip(tables.entries, deltas, strict=True)]
        for future in futures:
            future.result()
        timing.recorder().add_reduction(sum(d.numel() * d.element_size() for d in deltas))  # the k steps' push
        for _, _, rows in host.sparse:
            rows.sync(self.steps)
        tables.adopt(tables.pull(), version=False, base=True)

    def drop_in_flight(self) -> None:
        for _, _, rows in self.host.sparse:
            rows.forget()


class GeoMode(UpdateMode):
    name = "geo"
    options = ("k_steps",)
    steps_locally = True

    def worker(self, host: WorkerHost, config: Any) -> WorkerPolicy:
        return GeoStep(host, max(1, int(getattr(config, "k_steps", 1) or 1)))

    def rows(self, client: ServerCalls, table_id: int, module: TableModule, spec: OptimizerSpec) -> GeoRows:
        return GeoRows(client, table_id, module, module.optimizer_override or spec)

    def admit_delta(self, table_id: int) -> None:
        """Deltas are what geo workers push."""
