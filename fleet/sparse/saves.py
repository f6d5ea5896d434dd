"""A sparse table's saves: what full and delta state_dicts hold, and how a load checks them.

:class:`TableSaves` is composed by :class:`~fleet.sparse.table.SparseTable` (whose
``state_dict`` / ``load_state_dict`` / ``apply_delta`` call it) and works through the
table's public storage methods only: it decides the format and checks every field; the
table changes its rows, under its own transactions, so a load that fails half-way leaves
the table as it was.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import torch

from fleet.sparse.id_index import as_ids
from fleet.sparse.optim import InitializerSpec, OptimizerSpec, check_saved_optimizer, optimizer_config_json

# Evicted ids are remembered for the next delta save; past this many (and 4x the table) a delta is refused.
MAX_REMEMBERED_DELETIONS = 1 << 22


class StoredTable(Protocol):
    """What saves use of a :class:`~fleet.sparse.table.SparseTable`: its settings and storage methods."""

    dim: int
    seed: int
    optimizer: OptimizerSpec
    initializer: InitializerSpec
    lifecycle: Any
    clock: int

    @property
    def state_names(self) -> tuple[str, ...]: ...

    @property
    def state_width(self) -> int: ...

    def stat_dtypes(self) -> dict[str, torch.dtype]: ...

    def check_rows(self, name: str, values: torch.Tensor, n: int, width: int | None = None) -> torch.Tensor: ...

    def slot_ids(self) -> torch.Tensor: ...

    def copy_rows(self, pick: slice | torch.Tensor) -> dict[str, torch.Tensor]: ...

    def changed_slots(self) -> torch.Tensor: ...

    def evicted_since_save(self) -> torch.Tensor | None: ...

    def header(self) -> dict[str, Any]: ...

    def replace_rows(self, ids: torch.Tensor, fields: dict[str, torch.Tensor], header: dict[str, Any]) -> None: ...

    def merge_rows(
        self, deleted: torch.Tensor, ids: torch.Tensor, fields: dict[str, torch.Tensor], header: dict[str, Any]
    ) -> None: ...


class TableSaves:
    """The checkpoint format of one :class:`~fleet.sparse.table.SparseTable`."""

    def __init__(self, table: StoredTable):
        self.table = table

    def state_dict(self, delta: bool = False) -> dict[str, Any]:
        """Copies of ids, rows, per-row steps, optimizer state and statistics (row ``i`` belongs to ``ids[i]``).

        ``steps`` counts each row's updates for optimizers whose math reads it
        (momentum SGD, Adam/AdamW, Adagrad with ``lr_decay``); it stays 0 otherwise.
        ``delta=True``: only the rows created or changed since ``mark_saved``, and the ids
        evicted since (``deleted``); :meth:`apply_delta` replays it onto the previous save.
        """
        table = self.table
        ids = table.slot_ids()
        pick: slice | torch.Tensor = slice(None)
        header = table.header()
        out: dict[str, Any] = {
            "dim": table.dim,
            "seed": table.seed,
            "optimizer": optimizer_config_json(table.optimizer),
            "initializer": json.dumps(table.initializer.to_config(), sort_keys=True),
            "lifecycle": json.dumps(table.lifecycle.to_config(), sort_keys=True),
            "clock": header["clock"],
            "next_expiry": header["next_expiry"],
            "counts": json.dumps(header["counts"], sort_keys=True),
            "admission": header["admission"],
        }
        if delta:
            deleted = table.evicted_since_save()
            if deleted is None:
                raise ValueError(
                    f"a delta save needs the ids evicted since the last save, and more than "
                    f"{MAX_REMEMBERED_DELETIONS:,} were evicted: save a base (mode='base') instead"
                )
            pick = table.changed_slots()
            out["delta"] = True
            out["deleted"] = deleted
        out["ids"] = ids[pick].clone()
        out.update(table.copy_rows(pick))
        return out

    def _checked_rows(self, state: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(ids, {field: per-row tensor}) of a state_dict, every shape checked."""
        table = self.table
        for key in ("ids", "rows", "steps"):
            if key not in state:
                raise ValueError(f"sparse table state_dict: missing key '{key}'")
        if "dim" in state and int(state["dim"]) != table.dim:
            raise ValueError(f"sparse table state_dict has dim {state['dim']}, this table has dim {table.dim}")
        check_saved_optimizer("sparse", state, table.optimizer)
        ids = as_ids(state["ids"])
        n = ids.numel()
        if torch.unique(ids).numel() != n:
            raise ValueError("sparse table state_dict: 'ids' contains duplicates")
        fields = {"rows": table.check_rows("rows", state["rows"], n)}
        steps = state["steps"]
        if tuple(steps.shape) != (n,):
            raise ValueError(f"sparse table state_dict: 'steps' has shape {tuple(steps.shape)}, expected ({n},)")
        fields["steps"] = steps.to(torch.int64)
        for name in table.state_names:
            if f"state.{name}" not in state:
                raise ValueError(f"sparse table state_dict: missing optimizer state 'state.{name}'")
            value = state[f"state.{name}"]
            fields[f"state.{name}"] = table.check_rows(f"state.{name}", value, n, table.state_width)
        for name, dtype in table.stat_dtypes().items():
            value = state.get(f"stats.{name}")
            if value is None:  # saved without a life cycle: rows count as seen now, never shown
                value = torch.full((n,), table.clock if name == "last_seen" else 0, dtype=dtype)
            if tuple(value.shape) != (n,):
                raise ValueError(f"sparse table state_dict: 'stats.{name}' has shape {tuple(value.shape)}")
            fields[f"stats.{name}"] = value.to(dtype)
        return ids, fields

    @staticmethod
    def _header(state: dict[str, Any]) -> dict[str, Any]:
        return {
            "clock": int(state.get("clock", 0)),
            "next_expiry": int(state.get("next_expiry", 0)),
            "counts": json.loads(state["counts"]) if "counts" in state else {},
            "admission": state.get("admission") or {},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace all rows with a (full) :meth:`state_dict`'s; dim and optimizer kind must match."""
        if state.get("delta"):
            raise ValueError("this sparse table state is a delta: load its base first, then apply_delta")
        ids, fields = self._checked_rows(state)
        self.table.replace_rows(ids, fields, self._header(state))

    def apply_delta(self, state: dict[str, Any]) -> None:
        """Replay a delta :meth:`state_dict` (evictions, then changed rows) onto the save it follows."""
        if not state.get("delta"):
            raise ValueError("apply_delta needs a delta state_dict (saved with delta=True)")
        ids, fields = self._checked_rows(state)
        self.table.merge_rows(as_ids(state["deleted"]), ids, fields, self._header(state))
