"""A sparse table's shard: the rows whose ids map to this server, and its sync step.

A sync step's pushes are kept per worker and summed in worker order when the step closes (so the
result never depends on the order in which they arrived); a push may come in pieces, under the
rules of :mod:`fleet.ps.server.shards.base`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fleet.ps.modes import Admit
from fleet.ps.protocol.errors import ShardError
from fleet.ps.server.shards.base import Shard


def _make_sparse(config: dict[str, Any]) -> Any:
    from fleet.sparse.table import SparseTable

    return SparseTable.from_config({k: config[k] for k in SparseTable.CONFIG_KEYS if k in config})


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

    def pull(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The rows of ``ids`` (created as the table creates them), in ``out`` (float32 ``[n, dim]``) when given."""
        self.check_ids(ids)
        if ids.numel() == 0:
            return torch.empty(0, self.dim) if out is None else out
        return self.table.pull(ids, out=out)

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
        finite: bool = False,
    ) -> bool:
        """``step``: the sync step this gradient is for; in async mode the worker's own step (the table's clock).

        ``more``: this is a piece of a push and more pieces follow (see the module's docstring). ``finite``: the
        caller found ``grads``, ``clicks`` and ``lr`` finite already (a composite push checks all its tables' values
        in one pass), so they are not checked again.
        """
        self.check_rows("gradients", ids, grads)
        self.check_clicks(ids, clicks)
        verdict = self._admit_grad_push(worker, step, last=not more)
        if verdict is Admit.STALE:
            self._partial.pop(worker, None)
            self._poisoned.pop(worker, None)
            return False
        if verdict is Admit.APPLY:
            if not finite and self._skips_nonfinite(worker, step, "gradient", grads, clicks, lr):
                return True
            self.table.apply_gradient(ids, grads, lr, clicks, step=step)
            if not more:
                self.version += 1
            return True
        bad = not finite and self._skips_nonfinite(worker, step, "gradient", grads, clicks, lr, count=False)
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
