"""A table shard's bookkeeping: when pushes reach a table, under its update mode's server policy.

A shard wraps one table (dense or sparse) held by one server and decides
*when* pushes reach it; the table decides *how* (its optimizer). Whether a push
is applied now, accumulated for a step or dropped as stale is the update mode's
verdict (:mod:`fleet.ps.modes`, e.g. :meth:`~fleet.ps.modes.base.UpdateMode.admit_gradient`);
the shard keeps the bookkeeping (version, accumulator, stale counts), so the server
loop stays a dispatcher and the tables stay ignorant of workers and steps.

Sync semantics (the Parameter Server contract): a shard's ``version`` counts
applied updates. A push for ``step == version`` is accumulated; when
``required`` pushes for that step have arrived (N - backup_workers, or fewer
once workers have stopped), their average is applied once with the pushes'
learning rate and the version advances. A push for an older step is stale:
dropped and counted per worker. A push for a future step is a protocol error
-- a worker must first pull with ``min_version=step``.

A sparse push may come in pieces (the client cuts batches over the request limits,
:mod:`fleet.ps.protocol.limits`): every piece but the last says ``more``. In sync mode the pieces wait
apart from the step's accumulator and join it with the last one, so a step that closes
meanwhile (backup workers) holds none of a late push; in async and geo mode each piece is
applied on arrival. Either way the version, the stale count and the table's clock move once
per push, not per piece.

Every change to a shard is all-or-nothing: when applying a step fails (out of memory), the
accumulated gradients stay, the version does not move, and the table is as it was.

**Non-finite pushes never reach a table** (:mod:`fleet.sparse.nonfinite`). A gradient or delta
push holding NaN or Inf -- in its values, its clicks or its learning rate (a worker that found
a non-finite gradient of a table sends that table's pushes with a NaN learning rate, so that
every shard of the table, on every server, sees it alike, empty pushes included) -- is refused
with an error under the table's ``"nonfinite": "error"``, and otherwise skipped and counted per
worker (``info()["nonfinite_skipped"]``, in the servers' stats). In sync mode a skipped push
counts as **absent**: the worker has taken part in the step (the step closes as before) but adds
nothing, and the step's update is the mean over the pushes that were finite,
``sum(g_w for finite w) / #finite`` -- what one process computes on the union of the other
workers' batches, as when a backup worker's late push is dropped. A step whose every push was
skipped closes without changing the table. In async and geo mode a skipped push is simply not
applied (the pieces of a split push apply on arrival there, so only a non-finite piece is
skipped; in sync mode one non-finite piece makes the whole push absent).
"""

from __future__ import annotations

import json
from typing import Any

from fleet.ps.modes import Admit, UpdateMode, of_config
from fleet.ps.protocol.errors import ShardError
from fleet.sparse.nonfinite import POLICIES, finite


def canonical(config: dict[str, Any]) -> str:
    """The config as canonical JSON, so that 'identical create' means identical text."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


class Shard:
    """Update-mode bookkeeping common to dense and sparse shards."""

    kind = ""

    def __init__(self, table_id: int, config: dict[str, Any], num_workers: int, table: Any):
        try:
            mode = of_config(config)
        except KeyError as exc:
            raise ShardError(f"table {table_id}: {exc.args[0]}") from None
        backup = int(config.get("backup_workers", 0))
        if not 0 <= backup < num_workers:
            raise ShardError(
                f"table {table_id}: backup_workers={backup} with {num_workers} workers; "
                f"it must be in [0, {num_workers - 1}] so that at least one gradient makes a step"
            )
        nonfinite = config.get("nonfinite", "skip")
        if nonfinite not in POLICIES:
            raise ShardError(f"table {table_id}: nonfinite={nonfinite!r}; expected one of {', '.join(POLICIES)}")
        self.table_id = table_id
        self.config = config
        self.key = canonical(config)
        self.nonfinite: str = nonfinite
        self.nonfinite_skipped: dict[int, int] = {}  # per worker: pushes skipped for holding NaN or Inf
        self._absent: set[int] = set()  # sync: workers in _pushed whose push of the step was skipped
        self.mode: UpdateMode = mode
        self.backup_workers = backup
        self.num_workers = num_workers
        self.table = table
        self.version = 0
        self.stale_dropped: dict[int, int] = {}
        self._pushed: set[int] = set()  # workers whose gradient for step == version is in the accumulator
        self._lr = 0.0
        self.step_error: str | None = None  # why the last attempt to apply a complete sync step failed

    def required(self, active_workers: int) -> int:
        """How many gradients close a sync step: N - b, fewer once workers have stopped for good."""
        return max(1, min(self.num_workers - self.backup_workers, active_workers))

    def needs(self, active: set[int]) -> int:
        """How many gradients close the current step, given the ``active`` workers (and those that pushed it)."""
        return self.required(len(active | self._pushed))

    def waiting_for(self, active: set[int]) -> list[int]:
        """Workers whose push for the current step is missing (for timeout messages)."""
        return sorted(active - self._pushed)

    def _admit_grad_push(self, worker: int, step: int, last: bool = True) -> Admit:
        """The mode's verdict on a gradient push (or a piece of one); a stale one is counted once, with its
        ``last`` piece."""
        verdict = self.mode.admit_gradient(self.table_id, self.version, worker, step, worker in self._pushed)
        if verdict is Admit.STALE and last:
            self.stale_dropped[worker] = self.stale_dropped.get(worker, 0) + 1
        return verdict

    def _skips_nonfinite(self, worker: int, step: int, what: str, *values: Any, count: bool = True) -> bool:
        """True when ``values`` (tensors, the lr) hold NaN or Inf and the push is to be skipped (``count``: once,
        with its last piece); under ``nonfinite="error"`` it is refused instead."""
        if finite(*values):
            return False
        if self.nonfinite == "error":
            raise ShardError(
                f"{self.kind} table {self.table_id}: worker {worker}'s {what} for step {step} holds NaN or Inf; "
                "refused (nonfinite='error')",
                {"code": "nonfinite", "table": self.table_id, "worker": worker, "step": step},
            )
        if count:
            self.nonfinite_skipped[worker] = self.nonfinite_skipped.get(worker, 0) + 1
        return True

    def _contributing(self) -> int:
        """Sync: the pushes of the current step that add to its update (those not skipped as non-finite)."""
        return len(self._pushed) - len(self._absent)

    def _mark_absent(self, worker: int) -> None:
        """Sync: ``worker`` took part in the current step, but its push was skipped (see the module's docstring)."""
        self._pushed.add(worker)
        self._absent.add(worker)

    def fail_step(self, reason: str) -> None:
        """The complete sync step could not be applied: the workers waiting for it, and later pushes
        for it, hear ``reason`` (cleared by the next step that applies)."""
        self.step_error = reason

    def stale_write(self, step: int) -> bool:
        """Whether values a worker wrote at ``step`` would undo steps closed since (dropped then)."""
        return self.mode.stale_write(step, self.version)

    def maybe_step(self, active: set[int], at_barrier: set[int]) -> bool:
        """Apply the accumulated sync step if complete; True when the version advanced.

        Complete: N - b gradients (fewer once workers stopped for good), or every active
        worker that is still training has pushed. Workers waiting at a barrier are done
        with their steps (uneven batch counts, or fast workers with backup workers), so a
        step does not wait for them; but a barrier is no reason to close a step early:
        a gradient already on its way from a training worker must still count.

        A worker that pushed this step and stopped since still counts among the step's workers:
        otherwise its stop (right after its last step, while another worker's push of that step
        is still on the way) would lower the number required to the pushes already here and
        close the step without the other worker's gradient, dropping it as stale.
        """
        if not self.mode.closes_steps or not self._pushed:
            return False
        if len(self._pushed) < self.needs(active) and not (active - at_barrier) <= self._pushed:
            return False
        # all-or-nothing: on failure nothing moved
        self._apply_accumulated(self._contributing(), self._lr)
        self._pushed.clear()
        self._absent.clear()
        self.version += 1
        self.step_error = None
        return True

    def _apply_accumulated(self, count: int, lr: float) -> None:
        """Apply the step's accumulated gradients and empty the accumulator -- or raise and change nothing."""
        raise NotImplementedError

    def carry_counts(self, before: Shard) -> None:
        """Take over the counters of the shard this one replaces (a LOAD swaps shards; its stats go on)."""
        for worker, n in before.stale_dropped.items():
            self.stale_dropped[worker] = self.stale_dropped.get(worker, 0) + n

    def info(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "update": self.mode.name,
            "version": self.version,
            "stale_dropped": {str(w): n for w, n in sorted(self.stale_dropped.items())},
            "nonfinite_skipped": {str(w): n for w, n in sorted(self.nonfinite_skipped.items())},
        }
