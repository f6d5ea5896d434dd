"""``update="async"``: each push is applied on arrival; the worker never waits for the others.

Worker: pushes and the dense pull run in the background (bounded in flight), so the next
forward starts at once with the values of the last finished pull; sparse rows may be
prefetched, since they may be a step old anyway.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from typing import Any

from fleet.ps.modes.base import Admit, UpdateMode, WorkerPolicy
from fleet.ps.modes.contracts import ServerCalls, WorkerHost
from fleet.ps.modes.rows import RemoteRows
from fleet.sparse.backends import TableModule
from fleet.sparse.optim import OptimizerSpec

MAX_IN_FLIGHT = 4  # pushes waiting for an answer before step() blocks on the oldest


class AsyncStep(WorkerPolicy):
    def __init__(self, host: WorkerHost):
        super().__init__(host)
        self._pushes: deque[Future] = deque()
        self._pull: list[Future] | None = None

    def step(self) -> float:
        self.steps += 1
        tables = self.host.tables
        self._pushes.extend(self.push_gradients(versioned=False))
        while self._pushes and (len(self._pushes) > MAX_IN_FLIGHT or self._pushes[0].done()):
            self._pushes.popleft().result()
        if self._pull is not None and all(f.done() for f in self._pull):
            tables.adopt(self._pull, version=False)
            self._pull = None
        if self._pull is None and tables.entries:
            self._pull = tables.pull()
        return 0.0

    def flush(self) -> None:
        while self._pushes:
            self._pushes.popleft().result()
        if self._pull is not None:
            pull, self._pull = self._pull, None
            self.host.tables.adopt(pull, version=False)

    def discard_pull(self) -> None:
        pull, self._pull = self._pull, None
        for future in pull or []:
            future.result()

    def drop_in_flight(self) -> None:
        for future in [*self._pushes, *(self._pull or [])]:
            try:
                future.result()
            except Exception:  # noqa: BLE001 - lost with the server; the values are pulled again
                pass
        self._pushes.clear()
        self._pull = None


class AsyncMode(UpdateMode):
    name = "async"

    def worker(self, host: WorkerHost, config: Any) -> WorkerPolicy:
        return AsyncStep(host)

    def rows(self, client: ServerCalls, table_id: int, module: TableModule, spec: OptimizerSpec) -> RemoteRows:
        return RemoteRows(client, table_id, sync=False, module=module)

    def admit_gradient(self, table_id: int, version: int, worker: int, step: int, pushed: bool) -> Admit:
        return Admit.APPLY
