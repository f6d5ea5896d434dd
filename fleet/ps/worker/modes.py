"""What one parameter-server step does on a worker, one small policy per update mode.

- :class:`SyncMode`: push every table's gradient for step ``version`` with the group's
  current lr, then pull ``min_version=version + 1`` (dense now, sparse rows at the next
  forward). With backup workers a late push is stale (the server already closed that step
  without it): it is dropped and counted, and since the shard is then past ``version`` the
  pull returns at once with the current values, which the worker adopts as its version.
- :class:`AsyncMode`: pushes and the dense pull run in the background (bounded in flight),
  so the next forward starts at once with the values of the last finished pull.
- :class:`GeoMode`: the user's optimizer steps locally (rows in a local cache); every
  ``k_steps`` the deltas since the last sync are pushed and the values rebased.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fleet.ps.worker.optimizer import PSOptimizer

MAX_IN_FLIGHT = 4  # async: pushes waiting for an answer before step() blocks on the oldest


class UpdateMode:
    def __init__(self, opt: PSOptimizer):
        self.opt = opt
        self.steps = 0  # this worker's steps: the sparse tables' clock in async and geo mode (TTL)

    def step(self) -> float:
        """One optimizer step; returns the seconds of it spent computing locally (not communicating)."""
        raise NotImplementedError

    def flush(self) -> None:
        """Wait for whatever is in flight, so that the servers hold this worker's updates."""

    def drop_in_flight(self) -> None:
        """After a server was lost: forget what was in flight (it is pulled again)."""

    def discard_pull(self) -> None:
        """The user wrote the parameters: values pulled before that must not overwrite them."""

    def _push_grads(self, versioned: bool) -> list[Future]:
        opt = self.opt
        futures = []
        for entry in opt.tables.entries:
            grad, present = entry.grads()
            step = entry.version if versioned else 0
            futures.append(opt.client.push_dense_grad(entry.table_id, grad, step, entry.lr, present))
        for module, index, rows in opt.sparse:
            ids, grads, clicks = module.take_gradients()
            lr = float(opt.inner.param_groups[index]["lr"])
            step = rows.version if versioned else self.steps
            futures.append(opt.client.push_sparse_grad(rows.table_id, ids, grads, step, lr, clicks))
        return futures


class SyncMode(UpdateMode):
    def step(self) -> float:
        self.steps += 1
        tables = self.opt.tables
        for future in self._push_grads(versioned=True):
            future.result()
        tables.adopt(tables.pull(min_versions=[e.version + 1 for e in tables.entries]))
        for _, _, rows in self.opt.sparse:
            rows.version += 1
        return 0.0


class AsyncMode(UpdateMode):
    def __init__(self, opt: PSOptimizer):
        super().__init__(opt)
        self._pushes: deque[Future] = deque()
        self._pull: list[Future] | None = None

    def step(self) -> float:
        self.steps += 1
        tables = self.opt.tables
        self._pushes.extend(self._push_grads(versioned=False))
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
            self.opt.tables.adopt(pull, version=False)

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


class GeoMode(UpdateMode):
    def __init__(self, opt: PSOptimizer, k_steps: int):
        super().__init__(opt)
        self.k_steps = k_steps

    def step(self) -> float:
        opt = self.opt
        started = time.perf_counter()
        opt.inner.step()
        for entry in opt.tables.entries:
            entry.mark_clean()  # geo's own local step: its change reaches the servers as the next delta
        self.steps += 1
        for module, index, rows in opt.sparse:
            ids, grads, _ = module.take_gradients()  # clicks stay here: geo pushes deltas, not gradients
            rows.apply(ids, grads, float(opt.inner.param_groups[index]["lr"]))
        local_s = time.perf_counter() - started
        if self.steps % self.k_steps == 0:
            self.sync()
        return local_s

    def sync(self) -> None:
        """Push the changes since the last sync, then take the servers' values."""
        opt = self.opt
        tables = opt.tables
        futures = [opt.client.push_dense_delta(e.table_id, e.values() - e.base) for e in tables.entries]
        for future in futures:
            future.result()
        for _, _, rows in opt.sparse:
            rows.sync(self.steps)
        tables.adopt(tables.pull(), version=False, base=True)

    def drop_in_flight(self) -> None:
        for _, _, rows in self.opt.sparse:
            rows.forget()


def for_config(opt: PSOptimizer, update: str, k_steps: int) -> UpdateMode:
    if update == "sync":
        return SyncMode(opt)
    if update == "async":
        return AsyncMode(opt)
    return GeoMode(opt, k_steps)
