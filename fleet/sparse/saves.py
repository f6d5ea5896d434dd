"""A sparse table's saves: full and delta state_dicts, their loads, and the export for serving.

Split from :mod:`fleet.sparse.table` (whose :class:`~fleet.sparse.table.SparseTable`
inherits this): what goes to disk and comes back, checked field by field, under the table's
own transactions, so a load that fails half-way leaves the table as it was.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from fleet.sparse.id_index import as_ids
from fleet.sparse.optim import check_saved_optimizer, optimizer_config_json

# Evicted ids are remembered for the next delta save; past this many (and 4x the table) a delta is refused.
MAX_REMEMBERED_DELETIONS = 1 << 22


class SparseTableSaves:
    """The checkpoint half of :class:`~fleet.sparse.table.SparseTable` (its attributes are the table's)."""

    def state_dict(self, delta: bool = False) -> dict[str, Any]:
        """Copies of ids, rows, per-row steps, optimizer state and statistics (row ``i`` belongs to ``ids[i]``).

        ``steps`` counts each row's updates for optimizers whose math reads it
        (momentum SGD, Adam/AdamW, Adagrad with ``lr_decay``); it stays 0 otherwise.
        ``delta=True``: only the rows created or changed since :meth:`mark_saved`, and the ids
        evicted since (``deleted``); :meth:`apply_delta` replays it onto the previous save.
        """
        n = len(self._index)
        ids = self._index.ids_by_slot()
        pick = slice(None)
        out: dict[str, Any] = {
            "dim": self.dim,
            "seed": self.seed,
            "optimizer": optimizer_config_json(self.optimizer),
            "initializer": json.dumps(self.initializer.to_config(), sort_keys=True),
            "lifecycle": json.dumps(self.lifecycle.to_config(), sort_keys=True),
            "clock": self.clock,
            "next_expiry": self._next_expiry,
            "counts": json.dumps(self.counts, sort_keys=True),
            "admission": self._admission.state_dict(),
        }
        if delta:
            if self._deleted is None:
                raise ValueError(
                    f"a delta save needs the ids evicted since the last save, and more than "
                    f"{MAX_REMEMBERED_DELETIONS:,} were evicted: save a base (mode='base') instead"
                )
            pick = self._dirty[:n].nonzero().squeeze(1)
            out["delta"] = True
            out["deleted"] = torch.cat(self._deleted) if self._deleted else torch.empty(0, dtype=torch.int64)
        out["ids"] = ids[pick].clone()
        out["rows"] = self._rows[:n][pick].clone()
        out["steps"] = self._steps[:n][pick].clone()
        for name, t in self._state.items():
            out[f"state.{name}"] = t[:n][pick].clone()
        for name, t in self._stats.items():
            out[f"stats.{name}"] = t[:n][pick].clone()
        return out

    def export(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, rows) of every row the table holds, for serving (no optimizer state, no statistics)."""
        n = len(self)
        return self._index.ids_by_slot(), self._rows[:n].clone()

    def mark_saved(self) -> None:
        """The last :meth:`state_dict` is on disk: the next delta starts from here."""
        with self.transaction() as undo:
            undo.span(self._getter("dirty"), 0, len(self))
            self._dirty.zero_()
            self._deleted, self._deleted_count = [], 0
            self.saved = True

    def _checked_rows(self, state: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(ids, {field: per-row tensor}) of a state_dict, every shape checked."""
        for key in ("ids", "rows", "steps"):
            if key not in state:
                raise ValueError(f"sparse table state_dict: missing key '{key}'")
        if "dim" in state and int(state["dim"]) != self.dim:
            raise ValueError(f"sparse table state_dict has dim {state['dim']}, this table has dim {self.dim}")
        check_saved_optimizer("sparse", state, self.optimizer)
        ids = as_ids(state["ids"])
        n = ids.numel()
        if torch.unique(ids).numel() != n:
            raise ValueError("sparse table state_dict: 'ids' contains duplicates")
        fields = {"rows": self._check_rows("rows", state["rows"], n)}
        steps = state["steps"]
        if tuple(steps.shape) != (n,):
            raise ValueError(f"sparse table state_dict: 'steps' has shape {tuple(steps.shape)}, expected ({n},)")
        fields["steps"] = steps.to(torch.int64)
        for name in self._opt.state_names:
            if f"state.{name}" not in state:
                raise ValueError(f"sparse table state_dict: missing optimizer state 'state.{name}'")
            fields[f"state.{name}"] = self._check_rows(f"state.{name}", state[f"state.{name}"], n)
        for name, t in self._stats.items():
            value = state.get(f"stats.{name}")
            if value is None:  # saved without a life cycle: rows count as seen now, never shown
                value = torch.full((n,), self.clock if name == "last_seen" else 0, dtype=t.dtype)
            if tuple(value.shape) != (n,):
                raise ValueError(f"sparse table state_dict: 'stats.{name}' has shape {tuple(value.shape)}")
            fields[f"stats.{name}"] = value.to(t.dtype)
        return ids, fields

    def _fields(self) -> dict[str, torch.Tensor]:
        out = {"rows": self._rows, "steps": self._steps}
        out.update({f"state.{k}": t for k, t in self._state.items()})
        out.update({f"stats.{k}": t for k, t in self._stats.items()})
        return out

    def _load_header(self, state: dict[str, Any]) -> None:
        self.clock = int(state.get("clock", 0))
        self._next_expiry = int(state.get("next_expiry", 0))
        if "counts" in state:
            self.counts.update(json.loads(state["counts"]))
        if self._admission.sketch is not None:
            self._log().attrs(self._admission.sketch, "counters", "added")
        self._admission.load_state_dict(state.get("admission") or {})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace all rows with a (full) :meth:`state_dict`'s; dim and optimizer kind must match."""
        if state.get("delta"):
            raise ValueError("this sparse table state is a delta: load its base first, then apply_delta")
        ids, fields = self._checked_rows(state)
        n = ids.numel()
        cap = 1024
        while cap < n:
            cap *= 2
        with self.transaction() as undo:
            # everything is replaced by new tensors: the undo keeps the old ones
            undo.attrs(self, "_index", "_capacity", "_rows", "_steps", "_state", "_scratch", "_dirty", "_stats")
            self._reset(cap)
            self._index.insert_new(ids)
            for name, t in self._fields().items():
                t[:n] = fields[name]
            self._load_header(state)
            self.mark_saved()

    def apply_delta(self, state: dict[str, Any]) -> None:
        """Replay a delta :meth:`state_dict` (evictions, then changed rows) onto the save it follows."""
        if not state.get("delta"):
            raise ValueError("apply_delta needs a delta state_dict (saved with delta=True)")
        ids, fields = self._checked_rows(state)
        deleted = as_ids(state["deleted"])
        with self.transaction() as undo:
            if deleted.numel():
                slots = self._index.lookup(deleted)
                gone = torch.zeros(len(self), dtype=torch.bool)
                gone[slots[slots >= 0]] = True
                self._remove(gone)
            first = len(self)
            slots = self._index.lookup(ids)
            new = (slots < 0).nonzero().squeeze(1)
            if new.numel():
                self._grow_to(first + new.numel(), used=first)
                slots.index_copy_(0, new, self._index.insert_new(ids.index_select(0, new), undo))
            for name, t in self._fields().items():
                undo.rows(self._getter(name), slots)
                t.index_copy_(0, slots, fields[name])
            self._load_header(state)
            self.mark_saved()
