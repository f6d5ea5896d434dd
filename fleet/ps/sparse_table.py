"""One server's shard of a sparse embedding table: rows keyed by arbitrary int64 ids.

Why rows are created on first touch: CTR-style ids come from a huge, open
space (hashed feature values), so the table cannot be allocated up front. A row
is created the first time any request (pull or push) names its id, with the
value :func:`fleet.ps.optim.initial_rows` gives that id, so the result does not
depend on which worker touched it first or how ids are sharded over servers.

Storage: an :class:`~fleet.ps.id_index.IdIndex` maps id -> dense slot; rows
live in a growable ``[capacity, dim]`` float32 tensor indexed by slot, with the
optimizer's per-row state (momentum buffer, Adam moments, Adagrad sum) and a
per-row step count in tensors grown alongside (amortised doubling). Every
operation is a fixed number of whole-batch torch ops; nothing loops over ids.

Updates are row-wise ("lazy"): only the rows named in a push change, each with
its own state and step, so a row that gets a gradient every step follows
``torch.optim`` exactly. Not thread-safe: the server serialises calls per table.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from fleet.ps.id_index import IdIndex, as_ids, large_empty
from fleet.ps.optim import (
    InitializerSpec,
    OptimizerSpec,
    ServerOptimizer,
    check_table_config,
    initial_rows,
    optimizer_config_json,
)

_CONFIG_KEYS = ("dim", "optimizer", "initializer", "seed")
_REQUIRED_KEYS = ("dim", "optimizer")


class SparseTable:
    """Rows of width ``dim`` keyed by int64 id, updated by a row-wise server optimizer."""

    def __init__(
        self,
        dim: int,
        optimizer: OptimizerSpec,
        initializer: InitializerSpec | None = None,
        seed: int = 0,
    ) -> None:
        if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0:
            raise ValueError(f"dim must be an int > 0, got {dim!r}")
        if not isinstance(optimizer, OptimizerSpec):
            raise TypeError(f"optimizer must be an OptimizerSpec, got {type(optimizer).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.dim = dim
        self.optimizer = optimizer
        self.initializer = initializer if initializer is not None else InitializerSpec()
        self.seed = seed
        self._opt = ServerOptimizer(optimizer)
        # Per-row step counts cost two random accesses per row; keep them only where the math reads them.
        self._track_steps = self._opt.needs_step
        self._reset(capacity=1024)

    def _reset(self, capacity: int) -> None:
        self._index = IdIndex(capacity * 2)
        self._capacity = capacity
        self._rows = large_empty((capacity, self.dim), torch.float32)
        self._steps = large_empty((capacity,), torch.int64)
        self._state = {n: large_empty((capacity, self.dim), torch.float32) for n in self._opt.state_names}
        self._scratch = large_empty((capacity,), torch.int64)  # per-slot scratch for de-duplication

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> SparseTable:
        """Build from ``{"dim", "optimizer", "initializer" (optional), "seed" (optional)}``."""
        check_table_config("sparse", config, _CONFIG_KEYS, _REQUIRED_KEYS)
        dim, seed = config["dim"], config.get("seed", 0)
        if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0:
            raise ValueError(f"sparse table config: 'dim' must be an int > 0, got {dim!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"sparse table config: 'seed' must be an int, got {seed!r}")
        try:
            spec = OptimizerSpec.from_config(config["optimizer"])
        except ValueError as err:
            raise ValueError(f"sparse table config: 'optimizer': {err}") from None
        init = None
        if config.get("initializer") is not None:
            try:
                init = InitializerSpec.from_config(config["initializer"])
            except ValueError as err:
                raise ValueError(f"sparse table config: 'initializer': {err}") from None
        return cls(dim, spec, init, seed)

    def __len__(self) -> int:
        """Number of rows created so far."""
        return len(self._index)

    # ------------------------------------------------------------------ storage
    def _grow_to(self, needed: int, used: int) -> None:
        """Make room for ``needed`` rows (keeping the first ``used``), doubling so growth is amortised."""
        if needed <= self._capacity:
            return
        cap = self._capacity
        while cap < needed:
            cap *= 2
        n = used

        def grown(old: torch.Tensor) -> torch.Tensor:
            new = large_empty((cap, *old.shape[1:]), old.dtype)
            new[:n] = old[:n]
            return new

        self._rows = grown(self._rows)
        self._steps = grown(self._steps)
        self._state = {name: grown(t) for name, t in self._state.items()}
        self._scratch = large_empty((cap,), torch.int64)
        self._capacity = cap

    def _slots(self, ids: torch.Tensor) -> torch.Tensor:
        """Slots for ``ids`` (any order, duplicates allowed), creating missing rows."""
        first = len(self._index)
        slots, new_ids = self._index.get_or_insert(ids)
        m = new_ids.numel()
        if m:
            self._grow_to(first + m, used=first)
            end = first + m
            self._rows[first:end] = initial_rows(new_ids, self.dim, self.initializer, self.seed)
            self._steps[first:end] = 0
            self._opt.fill_new_state({name: t[first:end] for name, t in self._state.items()})
        return slots

    def _check_rows(self, name: str, values: torch.Tensor, n: int) -> torch.Tensor:
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(values).__name__}")
        if tuple(values.shape) != (n, self.dim):
            raise ValueError(f"{name} has shape {tuple(values.shape)}, expected ({n}, {self.dim}) for {n} ids")
        if not values.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point tensor, got {values.dtype}")
        return values.to(torch.float32)

    def _sum_duplicates(self, slots: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``values`` with every position of a repeated slot holding that slot's total.

        Why not compact to unique slots: a batch of 13k ids from a 1M space
        repeats only ~1 % of them, and compacting would copy every gradient
        row. Instead the update runs on all positions, and positions of one
        slot carry identical inputs, so they compute identical results and the
        duplicate writes of the scatter-back agree.

        Finding the repeats costs O(n) without a sort: each position scatters
        its index into a per-slot scratch array and reads back the survivor;
        only the few positions that lost (and their survivors) are then
        grouped exactly. Totals add each group in batch order, the same sum
        ``torch.unique`` + ``index_add_`` gives, whichever scatter write won.
        """
        n = slots.numel()
        pos = torch.arange(n)
        self._scratch.scatter_(0, slots, pos)
        survivor = self._scratch.index_select(0, slots)
        lost = (survivor != pos).nonzero().squeeze(1)
        if lost.numel() == 0:
            return values
        involved = torch.unique(torch.cat([lost, survivor.index_select(0, lost)]))  # sorted positions
        groups, group_of = torch.unique(slots.index_select(0, involved), return_inverse=True)
        first = torch.full((groups.numel(),), n, dtype=torch.int64)
        first.scatter_reduce_(0, group_of, involved, "amin")
        first_of = first.index_select(0, group_of)
        repeat = first_of != involved
        dup, dup_first = involved[repeat], first_of[repeat]  # dup is in batch order
        summed = values.clone()
        summed.index_add_(0, dup_first, values.index_select(0, dup))
        summed.index_copy_(0, dup, summed.index_select(0, dup_first))
        return summed

    # ------------------------------------------------------------------ requests
    def pull(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows for ``ids`` as a new float32 ``[len(ids), dim]`` tensor; missing rows are created."""
        slots = self._slots(as_ids(ids))
        return self._rows.index_select(0, slots)

    def apply_gradient(self, ids: torch.Tensor, grads: torch.Tensor, lr: float) -> None:
        """One row-wise optimizer step on the named rows; duplicate ids' gradients are summed first."""
        ids = as_ids(ids)
        grads = self._check_rows("grads", grads, ids.numel())
        if ids.numel() == 0:
            return
        slots = self._slots(ids)
        g = self._sum_duplicates(slots, grads)
        step: int | torch.Tensor = 1
        if self._track_steps:
            step = self._steps.index_select(0, slots) + 1
            self._steps.index_copy_(0, slots, step)
        rows = self._rows.index_select(0, slots)
        state = {name: t.index_select(0, slots) for name, t in self._state.items()}
        self._opt.update(rows, g, state, step, float(lr))
        # Repeated slots write identical values (see _sum_duplicates), so the write order is immaterial.
        self._rows.index_copy_(0, slots, rows)
        for name, t in self._state.items():
            t.index_copy_(0, slots, state[name])

    def add_delta(self, ids: torch.Tensor, deltas: torch.Tensor) -> None:
        """Geo mode: add per-row parameter changes (duplicates add up); optimizer state untouched."""
        ids = as_ids(ids)
        deltas = self._check_rows("deltas", deltas, ids.numel())
        if ids.numel():
            self._rows.index_add_(0, self._slots(ids), deltas)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, torch.Tensor | int | float | str]:
        """Copies of ids, rows, per-row steps and optimizer state (row ``i`` belongs to ``ids[i]``).

        ``steps`` counts each row's updates for optimizers whose math reads it
        (momentum SGD, Adam/AdamW, Adagrad with ``lr_decay``); it stays 0 otherwise.
        """
        n = len(self._index)
        out: dict[str, torch.Tensor | int | float | str] = {
            "dim": self.dim,
            "seed": self.seed,
            "optimizer": optimizer_config_json(self.optimizer),
            "initializer": json.dumps(self.initializer.to_config(), sort_keys=True),
            "ids": self._index.ids_by_slot(),
            "rows": self._rows[:n].clone(),
            "steps": self._steps[:n].clone(),
        }
        for name, t in self._state.items():
            out[f"state.{name}"] = t[:n].clone()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace all rows with a :meth:`state_dict`'s; dim and optimizer kind must match."""
        for key in ("ids", "rows", "steps"):
            if key not in state:
                raise ValueError(f"sparse table state_dict: missing key '{key}'")
        if "dim" in state and int(state["dim"]) != self.dim:
            raise ValueError(f"sparse table state_dict has dim {state['dim']}, this table has dim {self.dim}")
        if "optimizer" in state:
            kind = json.loads(state["optimizer"]).get("kind")
            if kind != self.optimizer.kind:
                raise ValueError(
                    f"sparse table state_dict is for optimizer '{kind}', this table uses '{self.optimizer.kind}'"
                )
        ids = as_ids(state["ids"])
        n = ids.numel()
        if torch.unique(ids).numel() != n:
            raise ValueError("sparse table state_dict: 'ids' contains duplicates")
        rows = self._check_rows("rows", state["rows"], n)
        steps = state["steps"]
        if tuple(steps.shape) != (n,):
            raise ValueError(f"sparse table state_dict: 'steps' has shape {tuple(steps.shape)}, expected ({n},)")
        tensors = {}
        for name in self._opt.state_names:
            if f"state.{name}" not in state:
                raise ValueError(f"sparse table state_dict: missing optimizer state 'state.{name}'")
            tensors[name] = self._check_rows(f"state.{name}", state[f"state.{name}"], n)
        cap = 1024
        while cap < n:
            cap *= 2
        self._reset(cap)
        self._index.insert_new(ids)
        self._rows[:n] = rows
        self._steps[:n] = steps.to(torch.int64)
        for name, t in tensors.items():
            self._state[name][:n] = t
