"""The contract of a parameter-server update mode: one object per mode, the only place that knows it.

A mode (:mod:`~fleet.ps.modes.sync`, :mod:`~fleet.ps.modes.async_`, :mod:`~fleet.ps.modes.geo`)
declares, in one class:

- its **name** (the value of ``DistributedStrategy.update`` and of a table config's ``"update"``);
- its **options**: the ``DistributedStrategy`` fields it reads, checked by :meth:`UpdateMode.check`;
- its **worker-side behaviour**: :meth:`UpdateMode.worker` makes the :class:`WorkerPolicy` that runs
  one optimizer step on a worker, and the flags the wrapped optimizer asks (:attr:`steps_locally`, ...);
- its **row backend**: :meth:`UpdateMode.rows`, where a ``fleet.nn.SparseEmbedding``'s rows live;
- its **server policy**: how a table shard admits a gradient or a delta push
  (:meth:`UpdateMode.admit_gradient`, :meth:`UpdateMode.admit_delta`), whether it closes steps
  (:attr:`UpdateMode.closes_steps`) and drops late value writes (:meth:`UpdateMode.stale_write`).

Adding a mode is one file here plus a line in :mod:`fleet.ps.modes`' registry. Nothing outside
this package compares a mode's name or type.
"""

from __future__ import annotations

import enum
import math
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, ClassVar

from fleet.ps.modes.contracts import ServerCalls, WorkerHost
from fleet.ps.protocol.errors import ShardError
from fleet.sparse import nonfinite
from fleet.sparse.backends import TableBackend, TableModule
from fleet.sparse.optim import OptimizerSpec
from fleet.telemetry import timing


class WorkerPolicy:
    """What one parameter-server step does on a worker (one instance per wrapped optimizer)."""

    def __init__(self, host: WorkerHost):
        self.host = host
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

    def sync(self) -> None:
        """Push what this worker changed locally and take the servers' values (modes that step locally)."""
        raise TypeError("only an update mode that steps locally (update='geo') syncs on demand")

    def push_gradients(self, versioned: bool) -> list[Future]:
        """Push every dense table's gradient and every sparse table's row gradients (sync and async).

        A table whose gradient holds NaN or Inf is refused here under ``nonfinite="error"``; under
        "skip" the worker warns and sends that table's pushes with a NaN learning rate, which every
        shard of it, on every server, skips alike (sync: this worker counts as absent from the step).
        """
        host = self.host
        rule = nonfinite.policy()
        grads = [(entry, *entry.grads()) for entry in host.tables.entries]
        pushes = [
            rows.take_push(rows.version if versioned else self.steps, float(host.inner.param_groups[index]["lr"]))
            for _, index, rows in host.sparse
        ]
        bad_dense = {entry.table_id for entry, grad, _ in grads if not nonfinite.finite(grad, entry.lr)}
        bad_sparse = {push.table for push in pushes if not nonfinite.finite(push.grads, push.clicks, push.lr)}
        if bad_dense or bad_sparse:
            named = [f"dense table {t}" for t in sorted(bad_dense)] + [f"sparse table {t}" for t in sorted(bad_sparse)]
            nonfinite.refuse(" and ".join(named), self.steps, "a parameter-server push: the servers skip it", rule)
        futures = []
        for entry, grad, present in grads:
            step = entry.version if versioned else 0
            lr = math.nan if entry.table_id in bad_dense else entry.lr
            futures.append(host.client.push_dense_grad(entry.table_id, grad, step, lr, present))
        pushes = [replace(p, lr=math.nan) if p.table in bad_sparse else p for p in pushes]
        if pushes:  # every table's rows in one request per server (fleet.ps.client.many)
            futures.append(host.client.push_sparse_grads_many(pushes))
        if futures:  # the step's push: the parameter server's gradient reduction, in the timing report
            nbytes = sum(g.numel() * g.element_size() for _, g, _ in grads)
            timing.recorder().add_reduction(nbytes + sum(p.grads.numel() * p.grads.element_size() for p in pushes))
        return futures


class Admit(enum.Enum):
    """A server shard's verdict on a gradient push."""

    APPLY = "apply"  # apply it now (async)
    ACCUMULATE = "accumulate"  # add it to the step's accumulator; the step closes once complete (sync)
    STALE = "stale"  # for a step that closed already: dropped and counted (sync with backup workers)


class UpdateMode:
    """One update mode: its name, options, worker policy, row backend and server policy."""

    name: ClassVar[str] = ""
    options: ClassVar[tuple[str, ...]] = ()
    """The ``DistributedStrategy`` fields this mode reads (besides ``update``)."""
    steps_locally: ClassVar[bool] = False
    """The user's optimizer steps on the worker (dense values, their optimizer state and the rows are
    local between syncs); otherwise the servers step and hold the dense optimizer state."""
    watches_grads: ClassVar[bool] = False
    """Every worker's gradients must be complete at each step (gradients written after backward refused)."""
    rolls_back_on_restart: ClassVar[bool] = False
    """A restarted server brings the whole job back to the last checkpoint (rather than resynchronising)."""
    pushes_to_every_server: ClassVar[bool] = False
    """A sparse push reaches every server, with no ids for some, so that every shard counts the step."""
    closes_steps: ClassVar[bool] = False
    """A server shard applies the step's gradients together once enough workers pushed (:meth:`admit_gradient`)."""

    @classmethod
    def check(cls, config: Any) -> None:
        """Refuse options that do not apply to this mode (``config``: a ``DistributedStrategy``)."""
        if config.backup_workers and "backup_workers" not in cls.options:
            raise ValueError(
                f"backup_workers={config.backup_workers} applies to update='sync' only (got update={cls.name!r})"
            )

    def table_config(self, config: Any) -> dict[str, Any]:
        """The update-mode keys of a create-table config (the wire format the server reads with ``of_config``)."""
        keys = {"update": self.name, "backup_workers": int(config.backup_workers)}
        if getattr(config, "nonfinite", "skip") != "skip":  # only when not the default: older saves load alike
            keys["nonfinite"] = config.nonfinite
        return keys

    # ------------------------------------------------------------------ worker side
    def worker(self, host: WorkerHost, config: Any) -> WorkerPolicy:
        """The policy that runs one step of ``host`` (``config``: the job's ``DistributedStrategy``)."""
        raise NotImplementedError

    def rows(self, client: ServerCalls, table_id: int, module: TableModule, spec: OptimizerSpec) -> TableBackend:
        """The row backend of a ``fleet.nn.SparseEmbedding`` ``module`` whose table ``table_id`` the servers hold."""
        raise NotImplementedError

    # ------------------------------------------------------------------ server side
    def admit_gradient(self, table_id: int, version: int, worker: int, step: int, pushed: bool) -> Admit:
        """``worker``'s gradient push for ``step`` reaches a shard at ``version`` (``pushed``: it pushed this step)."""
        raise ShardError(f"table {table_id} is in {self.name} mode: push deltas, not gradients")

    def admit_delta(self, table_id: int) -> None:
        """A delta push reaches a shard; raise when this mode takes gradients instead."""
        raise ShardError(f"table {table_id} is in {self.name} mode: push gradients, not deltas")

    def stale_write(self, step: int, version: int) -> bool:
        """Whether values a worker wrote at ``step`` are stale at ``version`` (dropped: applying them would undo steps)."""
        return False

    def __repr__(self) -> str:
        return f"<update mode {self.name!r}>"
