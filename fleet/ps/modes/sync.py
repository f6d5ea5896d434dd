"""``update="sync"``: every step's gradients are averaged on the servers before anyone goes on.

Worker: push every table's gradient for step ``version`` with the group's current lr, then pull
``min_version=version + 1`` (dense now, sparse rows at the next forward). With backup workers a
late push is stale (the server already closed that step without it): it is dropped and counted,
and since the shard is then past ``version`` the pull returns at once with the current values,
which the worker adopts as its version.

Server: a push for ``step == version`` is accumulated; the step closes once N - backup_workers
pushes arrived (see :mod:`fleet.ps.server.aggregator`). Older pushes are stale; newer ones an error.
"""

from __future__ import annotations

from typing import Any

from fleet.ps.modes.base import Admit, UpdateMode, WorkerPolicy
from fleet.ps.modes.contracts import ServerCalls, WorkerHost
from fleet.ps.modes.rows import RemoteRows
from fleet.ps.protocol.errors import ShardError
from fleet.sparse.backends import TableModule
from fleet.sparse.optim import OptimizerSpec


class SyncStep(WorkerPolicy):
    def step(self) -> float:
        self.steps += 1
        tables = self.host.tables
        for future in self.push_gradients(versioned=True):
            future.result()
        tables.adopt(tables.pull(min_versions=[e.version + 1 for e in tables.entries]))
        for _, _, rows in self.host.sparse:
            rows.advance()
        return 0.0


class SyncMode(UpdateMode):
    name = "sync"
    options = ("backup_workers",)
    watches_grads = True
    rolls_back_on_restart = True
    pushes_to_every_server = True
    closes_steps = True

    def worker(self, host: WorkerHost, config: Any) -> WorkerPolicy:
        return SyncStep(host)

    def rows(self, client: ServerCalls, table_id: int, module: TableModule, spec: OptimizerSpec) -> RemoteRows:
        return RemoteRows(client, table_id, sync=True, module=module)

    def admit_gradient(self, table_id: int, version: int, worker: int, step: int, pushed: bool) -> Admit:
        if step < version:
            return Admit.STALE
        if step > version:
            raise ShardError(
                f"table {table_id}: push for step {step} but the shard is at version {version}; "
                f"pull with min_version={step} before pushing step {step}"
            )
        if pushed:
            raise ShardError(f"table {table_id}: worker {worker} already pushed step {step}")
        return Admit.ACCUMULATE

    def stale_write(self, step: int, version: int) -> bool:
        return step < version
