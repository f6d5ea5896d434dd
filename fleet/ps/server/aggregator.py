"""Server-side table shards: when pushes reach a table, under its update mode's server policy.

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
import math
from collections.abc import Callable
from typing import Any

import torch

from fleet.ps.modes import Admit, UpdateMode, of_config
from fleet.ps.protocol.errors import ShardError  # raised here, caught by the server loop as agg.ShardError
from fleet.ps.protocol.wire import FROZEN, HAS_GRAD
from fleet.sparse.nonfinite import POLICIES, finite

#: keys of a shard config that belong to the table itself (the rest is update-mode bookkeeping)
_DENSE_TABLE_KEYS = ("size", "optimizer")


def canonical(config: dict[str, Any]) -> str:
    """The config as canonical JSON, so that 'identical create' means identical text."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


def _make_dense(config: dict[str, Any]) -> Any:
    from fleet.ps.server.dense_table import DenseTable

    table_config = {k: config[k] for k in _DENSE_TABLE_KEYS if k in config}
    return DenseTable.from_config({**table_config, "pieces": [list(p[1:]) for p in pieces_of(config)]})


def pieces_of(config: dict[str, Any]) -> list[tuple[int, int, int]]:
    """``(parameter index, lo, hi)``: which slices of this shard hold which of the table's parameters.

    A dense table is its param group's parameters back to back (``shapes``), cut across the
    servers by size (``offset``, ``size``); a parameter may straddle two shards.
    """
    size = int(config["size"])
    shapes = config.get("shapes")
    if not shapes:
        return [(0, 0, size)] if size else []
    offset = int(config.get("offset", 0))
    pieces, start = [], 0
    for index, shape in enumerate(shapes):
        end = start + math.prod(int(d) for d in shape)
        lo, hi = max(start, offset) - offset, min(end, offset + size) - offset
        if lo < hi:
            pieces.append((index, lo, hi))
        start = end
    if sum(hi - lo for _, lo, hi in pieces) != size:
        raise ShardError(f"dense table: shapes {shapes} do not add up to a shard of {size} values at offset {offset}")
    return pieces


def _make_sparse(config: dict[str, Any]) -> Any:
    from fleet.sparse.table import SparseTable

    return SparseTable.from_config({k: config[k] for k in SparseTable.CONFIG_KEYS if k in config})


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


class DenseShard(Shard):
    """A contiguous slice of a flat float32 parameter vector."""

    kind = "dense"

    def __init__(self, table_id: int, config: dict[str, Any], num_workers: int, make: Callable | None = None):
        if int(config.get("size", -1)) < 0:
            raise ShardError(f"dense table {table_id}: config needs a non-negative 'size'")
        super().__init__(table_id, config, num_workers, (make or _make_dense)(config))
        self.size = int(config["size"])
        self.parameters = len(config.get("shapes") or [None])
        self._piece_params = [index for index, _, _ in pieces_of(config)]
        self._acc: torch.Tensor | None = None
        self._present: torch.Tensor | None = None  # sync: per parameter, how many pushes of this step had it
        self._trainable: tuple[int, list[bool]] | None = None  # sync: the first push's frozen/trainable flags
        self.broken: tuple[str, dict[str, Any]] | None = None  # set when workers disagreed: the table is unusable
        self._snapshot: torch.Tensor | None = None
        self._snapshot_version = -1

    def check_values(self, what: str, t: torch.Tensor) -> None:
        if t.dtype != torch.float32:
            raise ShardError(f"dense table {self.table_id}: {what} has dtype {t.dtype}, expected torch.float32")
        if t.dim() != 1 or t.numel() != self.size:
            raise ShardError(f"dense table {self.table_id}: {what} has shape {list(t.shape)}, expected [{self.size}]")

    def set(self, values: torch.Tensor) -> None:
        self.check_values("initial values", values)
        self.table.set(values)
        self._snapshot_version = -1

    def snapshot(self) -> torch.Tensor:
        """The values at the current version, as a tensor no later update touches.

        Pull replies are sent without copying, so the reply must not alias the
        live table that the next push updates in place; in sync mode every
        worker's pull at one version shares a single copy.
        """
        if self._snapshot_version != self.version or self._snapshot is None:
            self._snapshot = self.table.pull().detach().clone()
            self._snapshot_version = self.version
        return self._snapshot

    def check_present(self, present: torch.Tensor | None) -> None:
        if present is None:
            return
        if present.dtype != torch.uint8 or list(present.shape) != [self.parameters]:
            raise ShardError(
                f"dense table {self.table_id}: presence flags have {present.dtype} {list(present.shape)}, "
                f"expected torch.uint8 [{self.parameters}] (one per parameter of the table)"
            )
        if int(present.max()) > HAS_GRAD:
            raise ShardError(f"dense table {self.table_id}: presence flags must be 0, 1 or 2")

    def _piece_flags(self, counts: torch.Tensor | None) -> list[bool] | None:
        """Per piece of the table, whether its parameter has a gradient (``counts`` > 0); None: all have."""
        if counts is None:
            return None
        flags = counts.tolist()
        return [flags[index] > 0 for index in self._piece_params]

    def push_grad(
        self, worker: int, step: int, grad: torch.Tensor, lr: float, present: torch.Tensor | None = None
    ) -> bool:
        """Returns False when the push was stale and dropped.

        ``present``: uint8 per parameter of the table: :data:`HAS_GRAD`, :data:`NO_GRAD` (it trains
        but this worker has no gradient for it) or :data:`FROZEN` (None: every one has a gradient).
        A parameter no push of a step has a gradient for is left untouched. In sync mode the
        workers must agree on which parameters are frozen: otherwise the table refuses the step
        (every waiting worker gets the error), rather than mixing the two.
        """
        self.check_values("gradient", grad)
        self.check_present(present)
        if self.broken is not None:
            raise ShardError(*self.broken)
        verdict = self._admit_grad_push(worker, step)
        if verdict is Admit.STALE:
            return False
        if self._skips_nonfinite(worker, step, "gradient", grad, lr):
            if verdict is Admit.ACCUMULATE:
                self._mark_absent(worker)
            return True
        has_grad = present == HAS_GRAD if present is not None else None
        if verdict is Admit.APPLY:
            self.table.apply_gradient(grad, lr, self._piece_flags(has_grad))
            self.version += 1
            return True
        trainable = self._trainable
        try:
            self._check_trainable(worker, present)
            counts = self._present
            if has_grad is not None or counts is not None:
                one = torch.ones(self.parameters, dtype=torch.int32)
                flags = has_grad.to(torch.int32) if has_grad is not None else one
                if counts is None:  # the earlier (finite) pushes of this step had every parameter
                    counts = torch.full((self.parameters,), self._contributing(), dtype=torch.int32)
                counts = counts + flags
            # sync: the received buffer is ours (a ZeroMQ frame), so it can be the accumulator itself;
            # adding to it is the push's only change in place, so a failure before it changes nothing
            if self._acc is None:
                self._acc = grad if grad.is_contiguous() else grad.contiguous()
            else:
                self._acc.add_(grad)
        except Exception:
            if self.broken is None:  # a disagreement breaks the table for good; anything else undoes
                self._trainable = trainable
            raise
        self._present = counts
        self._pushed.add(worker)
        self._lr = lr
        return True

    def _check_trainable(self, worker: int, present: torch.Tensor | None) -> None:
        trainable = (present != FROZEN).tolist() if present is not None else [True] * self.parameters
        if self._trainable is None:
            self._trainable = (worker, trainable)
            return
        first, reference = self._trainable
        if trainable == reference:
            return
        index = next(i for i, (a, b) in enumerate(zip(reference, trainable, strict=True)) if a != b)
        trains, frozen = (first, worker) if reference[index] else (worker, first)
        details = {
            "code": "trainable_mismatch",
            "table": self.table_id,
            "parameter": index,
            "trains_on": trains,
            "frozen_on": frozen,
        }
        self.broken = (
            f"dense table {self.table_id}: parameter {index} trains on worker {trains} but is frozen on worker "
            f"{frozen} in the same step; workers must freeze and unfreeze parameters alike",
            details,
        )
        raise ShardError(*self.broken)

    def push_delta(self, delta: torch.Tensor, worker: int = -1, step: int = 0) -> None:
        self.mode.admit_delta(self.table_id)
        self.check_values("delta", delta)
        if self._skips_nonfinite(worker, step, "delta", delta):
            return
        self.table.add_delta(delta)
        self.version += 1

    def _apply_accumulated(self, count: int, lr: float) -> None:
        if self._acc is not None:
            # Absent gradients count as zero in the average (DDP's semantics); a parameter that no
            # worker had a gradient for is not stepped at all. Not divided in place: a failed
            # update must leave the accumulator as it was.
            self.table.apply_gradient(self._acc / count, lr, self._piece_flags(self._present))
        self._acc, self._present, self._trainable = None, None, None

    def state(self, delta: bool = False) -> dict[str, Any]:
        return {"version": self.version, "table": self.table.state_dict()}

    def saved(self) -> None:
        """Dense shards are saved whole every time."""

    def load(self, states: list[dict[str, Any]]) -> None:
        """The last of a chain of saves (each holds the whole dense shard)."""
        state = states[-1]
        self.table.load_state_dict(state["table"])
        self.version = int(state["version"])
        self._acc, self._present, self._trainable, self._snapshot_version = None, None, None, -1
        self._pushed.clear()
        self._absent.clear()

    def optimizer_state(self) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], int]:
        """Values, each parameter's step count (-1: not on this shard), optimizer state and table step."""
        state = self.table.state_dict()
        param_steps = torch.full((self.parameters,), -1, dtype=torch.int64)
        for piece, param in enumerate(self._piece_params):
            param_steps[param] = int(state["piece_steps"][piece])
        named = {key.removeprefix("state."): t for key, t in state.items() if key.startswith("state.")}
        return state["values"], param_steps, named, int(state["step"])

    def set_optimizer_state(self, param_steps: torch.Tensor, named: dict[str, torch.Tensor], step: int) -> None:
        """Replace the optimizer state (values and version untouched); checked whole before anything changes."""
        current = self.table.state_dict()
        wanted = sorted(key.removeprefix("state.") for key in current if key.startswith("state."))
        if sorted(named) != wanted:
            raise ShardError(
                f"dense table {self.table_id}: optimizer state {sorted(named)} does not match this table's {wanted}"
            )
        if param_steps.dtype != torch.int64 or list(param_steps.shape) != [self.parameters]:
            raise ShardError(
                f"dense table {self.table_id}: parameter steps have shape {list(param_steps.shape)} and dtype "
                f"{param_steps.dtype}, expected [{self.parameters}] int64"
            )
        for name, t in named.items():
            self.check_values(f"optimizer state {name!r}", t)
        state = {**current, "step": int(step), **{f"state.{name}": t for name, t in named.items()}}
        state["piece_steps"] = torch.tensor(
            [max(0, int(param_steps[p])) for p in self._piece_params], dtype=torch.int64
        )
        self.table.load_state_dict(state)

    def info(self) -> dict[str, Any]:
        return {**super().info(), "size": self.size}


class SparseShard(Shard):
    """The rows of a sparse table whose ids map to this server."""

    kind = "sparse"

    def __init__(self, table_id: int, config: dict[str, Any], num_workers: int, make: Callable | None = None):
        if int(config.get("dim", 0)) <= 0:
            raise ShardError(f"sparse table {table_id}: config needs a positive 'dim'")
        super().__init__(table_id, config, num_workers, (make or _make_sparse)(config))
        self.dim = int(config["dim"])
        # sync: each worker's complete push of the step, (ids, grads, clicks) lists (clicks None: none
        # carried). Summed in worker order when the step closes, so the result never depends on the order
        # in which the pushes arrived (index_add_ of several terms per id is not associative).
        self._complete: dict[int, tuple[list, list, list]] = {}
        # sync: a push arriving in pieces, per worker: (step, ids, grads, clicks) until its last piece
        self._partial: dict[int, tuple[int, list, list, list]] = {}
        self._poisoned: dict[int, int] = {}  # sync: worker -> step of a push one of whose pieces was non-finite

    def check_ids(self, ids: torch.Tensor) -> None:
        if ids.dtype != torch.int64:
            raise ShardError(f"sparse table {self.table_id}: ids have dtype {ids.dtype}, expected torch.int64")
        if ids.dim() != 1:
            raise ShardError(f"sparse table {self.table_id}: ids have shape {list(ids.shape)}, expected [n]")

    def check_rows(self, what: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
        self.check_ids(ids)
        if rows.dtype != torch.float32:
            raise ShardError(f"sparse table {self.table_id}: {what} have dtype {rows.dtype}, expected torch.float32")
        if list(rows.shape) != [ids.numel(), self.dim]:
            raise ShardError(
                f"sparse table {self.table_id}: {what} have shape {list(rows.shape)}, "
                f"expected [{ids.numel()}, {self.dim}] for {ids.numel()} ids"
            )

    def pull(self, ids: torch.Tensor) -> torch.Tensor:
        self.check_ids(ids)
        if ids.numel() == 0:
            return torch.empty(0, self.dim)
        return self.table.pull(ids)

    def check_clicks(self, ids: torch.Tensor, clicks: torch.Tensor | None) -> None:
        if clicks is not None and (clicks.dtype != torch.float32 or list(clicks.shape) != [ids.numel()]):
            raise ShardError(
                f"sparse table {self.table_id}: clicks have shape {list(clicks.shape)} ({clicks.dtype}), "
                f"expected [{ids.numel()}] float32, one per id"
            )

    def push_grad(
        self,
        worker: int,
        step: int,
        ids: torch.Tensor,
        grads: torch.Tensor,
        lr: float,
        clicks: torch.Tensor | None = None,
        more: bool = False,
    ) -> bool:
        """``step``: the sync step this gradient is for; in async mode the worker's own step (the table's clock).

        ``more``: this is a piece of a push and more pieces follow (see the module's docstring).
        """
        self.check_rows("gradients", ids, grads)
        self.check_clicks(ids, clicks)
        verdict = self._admit_grad_push(worker, step, last=not more)
        if verdict is Admit.STALE:
            self._partial.pop(worker, None)
            self._poisoned.pop(worker, None)
            return False
        if verdict is Admit.APPLY:
            if self._skips_nonfinite(worker, step, "gradient", grads, clicks, lr):
                return True
            self.table.apply_gradient(ids, grads, lr, clicks, step=step)
            if not more:
                self.version += 1
            return True
        bad = self._skips_nonfinite(worker, step, "gradient", grads, clicks, lr, count=False)
        if bad or self._poisoned.get(worker) == step:  # one bad piece makes the whole push absent
            self._partial.pop(worker, None)
            if more:
                self._poisoned[worker] = step
                return True
            self._poisoned.pop(worker, None)
            self.nonfinite_skipped[worker] = self.nonfinite_skipped.get(worker, 0) + 1
            self._mark_absent(worker)
            return True
        step_, ids_list, grads_list, clicks_list = self._partial.pop(worker, None) or (step, [], [], [])
        if step_ != step:  # pieces of an earlier push whose last piece never came
            ids_list, grads_list, clicks_list = [], [], []
        if ids.numel():
            ids_list.append(ids)
            grads_list.append(grads)
            clicks_list.append(clicks)
        if more:
            self._partial[worker] = (step, ids_list, grads_list, clicks_list)
            return True
        self._complete[worker] = (ids_list, grads_list, clicks_list)
        self._pushed.add(worker)
        self._lr = lr
        return True

    def push_delta(
        self,
        ids: torch.Tensor,
        deltas: torch.Tensor,
        step: int = 0,
        more: bool = False,
        clicks: torch.Tensor | None = None,
        worker: int = -1,
    ) -> None:
        """Geo mode; ``step`` is the worker's own step (the table's clock); ``more`` as for :meth:`push_grad`;
        ``clicks``: the worker's clicks of these rows since its last sync; ``worker``: who sent it."""
        self.mode.admit_delta(self.table_id)
        self.check_rows("deltas", ids, deltas)
        if self._skips_nonfinite(worker, step, "delta", deltas, clicks):
            return
        self.table.add_delta(ids, deltas, step=step, clicks=clicks)
        if not more:
            self.version += 1

    def maybe_step(self, active: set[int], at_barrier: set[int]) -> bool:
        stepped = super().maybe_step(active, at_barrier)
        if stepped:
            self._partial.clear()  # pieces of the closed step: their last piece will be stale
            self._poisoned.clear()
        return stepped

    def _apply_accumulated(self, count: int, lr: float) -> None:
        ids_list, grads_list, clicks_list = [], [], []
        for worker in sorted(self._complete):
            ids_list += self._complete[worker][0]
            grads_list += self._complete[worker][1]
            clicks_list += self._complete[worker][2]
        step = self.version + 1  # the clock counts sync steps, as one process counts optimizer steps
        if not ids_list:
            self.table.tick(step)
            self._complete = {}
            return
        ids = torch.cat(ids_list) if len(ids_list) > 1 else ids_list[0]
        grads = torch.cat(grads_list) if len(grads_list) > 1 else grads_list[0]
        uniq, inverse = torch.unique(ids, return_inverse=True)
        merged = torch.zeros(uniq.numel(), self.dim, dtype=grads.dtype).index_add_(0, inverse, grads)
        merged_clicks = None  # most steps of most tables carry no clicks: nothing to merge then
        if any(c is not None for c in clicks_list):
            parts = zip(clicks_list, ids_list, strict=True)
            clicks = torch.cat([c if c is not None else torch.zeros(i.numel()) for c, i in parts])
            merged_clicks = torch.zeros(uniq.numel()).index_add_(0, inverse, clicks)
        self.table.apply_gradient(uniq, merged.div_(count), lr, merged_clicks, step=step)  # all-or-nothing
        self._complete = {}

    def state(self, delta: bool = False) -> dict[str, Any]:
        return {"version": self.version, "table": self.table.state_dict(delta=delta)}

    def saved(self) -> None:
        self.table.mark_saved()

    def load(self, states: list[dict[str, Any]]) -> None:
        """A base, then the deltas saved after it, in order (all of them, or on failure none)."""
        with self.table.transaction():
            self.table.load_state_dict(states[0]["table"])
            for state in states[1:]:
                self.table.apply_delta(state["table"])
        self.version = int(states[-1]["version"])
        self._complete = {}
        self._partial.clear()
        self._poisoned.clear()
        self._pushed.clear()
        self._absent.clear()

    def info(self) -> dict[str, Any]:
        return {**super().info(), "dim": self.dim, **self.table.info()}
