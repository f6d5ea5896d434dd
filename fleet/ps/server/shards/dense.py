"""A dense table's shard: a contiguous slice of a param group's flat values, and its sync step.

A dense table is one param group's parameters back to back, cut across the servers by size
(:func:`pieces_of`); the shard accumulates a sync step's gradients with each push's presence flags
(:data:`~fleet.ps.protocol.wire.HAS_GRAD`, ``NO_GRAD``, ``FROZEN``) and applies their average once,
under the rules of :mod:`fleet.ps.server.shards.base`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from fleet.ps.modes import Admit
from fleet.ps.protocol.errors import ShardError
from fleet.ps.protocol.wire import FROZEN, HAS_GRAD
from fleet.ps.server.shards.base import Shard

#: keys of a shard config that belong to the table itself (the rest is update-mode bookkeeping)
_DENSE_TABLE_KEYS = ("size", "optimizer")


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
        self._bytes_of: torch.Tensor | None = None  # the snapshot whose bytes _bytes holds
        self._bytes = b""

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

    def snapshot_bytes(self, limit: int) -> bytes | None:
        """A copy of :meth:`snapshot`'s bytes (flat float32), made once per snapshot; None when they exceed ``limit``.

        Why: a small table's quick pulls (fleet.ps.server.loop) send these bytes as they are, instead of copying
        the snapshot's on every pull.
        """
        if self.size * 4 > limit:
            return None
        snap = self.snapshot()
        if self._bytes_of is not snap:
            self._bytes = snap.numpy().tobytes()
            self._bytes_of = snap
        return self._bytes

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
