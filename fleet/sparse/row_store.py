"""A sparse table's rows in memory: the records, the id index over them, growth, compaction and reordering.

Each slot's id, row, optimizer state, step count (where the optimizer reads it) and life-cycle statistics
are one record of a growable row-major array (:mod:`fleet.sparse.records`; amortised doubling of reserved
address space), read through strided views of each field (``rows``, ``state``, ``steps``, ``stats``). The
:class:`~fleet.sparse.id_index.IdIndex` maps id -> slot and confirms a match by reading the id in the
record, next to the row. Slots ``0 .. len - 1`` are live; the table (:mod:`fleet.sparse.table`) says what
``len`` is (the index's size) and what a new row holds.

Why a part of its own: the table's requests, its life cycle (:mod:`fleet.sparse.table_lifecycle`) and its
saves all move rows; here is the one place that knows how they are laid out, and every change it makes
goes through the caller's :class:`~fleet.sparse.undo.UndoLog`, so the table's operations stay
all-or-nothing. A whole new store (a load) is swapped in by the table, under its transaction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fleet.sparse.growable import row_tensor
from fleet.sparse.id_index import IdIndex
from fleet.sparse.native import buf, kernels, with_lr
from fleet.sparse.pages import prefault
from fleet.sparse.records import RowRecords
from fleet.sparse.undo import Getter, UndoLog


class RowStore:
    """Records for ``capacity`` rows of width ``dim`` (more as they grow), their id index and changed-row flags."""

    def __init__(
        self, capacity: int, dim: int, state_width: int, state_names: tuple[str, ...], steps: bool, stats: bool
    ) -> None:
        self.dim = dim
        # Per-row storage over reserved address space: growing it is a longer view, not a copy.
        self._take(RowRecords(capacity, dim, state_width, state_names, steps=steps, stats=stats))
        self.index = IdIndex(capacity * 2, keys=self._key_column)  # a bound method: a deep copy rebinds it
        self.capacity = capacity
        self.prefaulted = 0  # rows whose pages were handed to fleet.sparse.pages.prefault (a hint)
        if self.rec.dirty is None:  # changed since the last save: in the records where they have room
            self.dirty = row_tensor(capacity, (), torch.bool).zero_()

    def _take(self, records: RowRecords) -> None:
        """Take ``records`` as the row storage, with a view of each field."""
        self.rec = records
        self.records = records.data
        self.rows, self.steps = records.rows, records.steps
        self.state, self.stats = dict(records.state), dict(records.stats)
        if records.dirty is not None:
            self.dirty = records.dirty
        # the fields a new row starts fresh (all saved ones but its values), named as saved_fields names them:
        # set per new batch of rows, so built once per storage rather than per call
        self._fresh = {name: t for name, t in self.saved_fields().items() if name != "rows"}

    def _key_column(self) -> torch.Tensor:
        """The id of each slot (the id index's key column): the records' id field."""
        return self.rec.ids

    # ------------------------------------------------------------------ fields
    def row_names(self) -> list[str]:
        """The per-row tensors compaction and reordering move (the records hold every saved field and the id)."""
        return ["records"] if self.rec.dirty is not None else ["records", "dirty"]

    def field(self, name: str) -> torch.Tensor:
        """The per-row tensor called ``name`` (``records``, ``rows``, ``steps``, ``dirty``, ``state.*``, ``stats.*``)."""
        kind, _, key = name.partition(".")
        if kind == "state":
            return self.state[key]
        if kind == "stats":
            return self.stats[key]
        return getattr(self, kind)

    def getter(self, name: str) -> Getter:
        """The tensor called ``name`` as this store holds it when the getter runs (storage may grow meanwhile)."""
        return lambda: self.field(name)

    def saved_fields(self) -> dict[str, torch.Tensor]:
        """The per-row fields a save holds that the store keeps (``steps`` only where the optimizer counts them)."""
        out = {"rows": self.rows}
        if self.steps is not None:
            out["steps"] = self.steps
        out.update({f"state.{k}": t for k, t in self.state.items()})
        out.update({f"stats.{k}": t for k, t in self.stats.items()})
        return out

    def fresh_fields(self) -> dict[str, torch.Tensor]:
        """The saved fields but ``rows`` (a new row's optimizer state, steps and statistics); do not change it."""
        return self._fresh

    def copy_fields(self, pick: slice | torch.Tensor, live: int) -> dict[str, torch.Tensor]:
        """Copies of the saved fields of the slots ``pick`` among the ``live`` rows (``steps`` 0 where not counted)."""
        out = {name: t[:live][pick].clone() for name, t in self.saved_fields().items()}
        if "steps" not in out:  # not counted by this optimizer: 0, as documented for saves
            out["steps"] = torch.zeros(out["rows"].shape[0], dtype=torch.int64)
        return out

    def given_fields(
        self, fields: dict[str, torch.Tensor], n: int, check_rows: Callable[..., torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """``fields`` given for ``n`` rows (``rows`` required; ``steps``, ``state.*``, ``stats.*`` optional), checked
        and converted to the stored dtypes (``steps`` dropped where not counted); ``check_rows`` checks 2-D ones."""
        names = self.saved_fields()
        known = set(names) | {"steps"}  # steps: stored where the optimizer counts them, else always 0
        unknown = sorted(set(fields) - known)
        if unknown or "rows" not in fields:
            raise ValueError(f"write_rows takes 'rows' and optionally {sorted(known - {'rows'})}, got {unknown}")
        given = {}
        for name, value in fields.items():
            if name == "rows" or name.startswith("state."):
                given[name] = check_rows(name, value, n, names[name].shape[1])
            elif tuple(value.shape) != (n,):
                raise ValueError(f"write_rows: '{name}' has shape {tuple(value.shape)}, expected ({n},)")
            elif name in names:
                given[name] = value.to(names[name].dtype)
        return given

    # ------------------------------------------------------------------ growth
    def grow_to(self, needed: int, used: int, grow_tensor: Callable[[torch.Tensor, int, int], torch.Tensor]) -> None:
        """Make room for ``needed`` rows (keeping the first ``used``), doubling so growth is amortised.

        ``grow_tensor``: :func:`fleet.sparse.growable.grow` as the table names it (tests inject failures there).
        Usually a longer view of reserved memory (:mod:`fleet.sparse.growable`); otherwise every new tensor
        is made before any is swapped in, so a failed allocation changes nothing.
        """
        if needed <= self.capacity:
            return
        cap = self.capacity
        while cap < needed:
            cap *= 2
        records = self.rec.over(grow_tensor(self.records, cap, used))
        dirty = (
            grow_tensor(self.dirty, cap, used) if records.dirty is None else records.dirty
        )  # past used: marked when made
        if records.data.data_ptr() != self.records.data_ptr():
            self.prefaulted = min(self.prefaulted, used)  # copied into fresh memory: not faulted in yet
        self._take(records)
        self.dirty, self.capacity = dirty, cap

    def slots_creating(self, ids: torch.Tensor, live: int, undo: UndoLog, grow_tensor: Callable) -> torch.Tensor:
        """``ids``' slots, appending a slot after the ``live`` rows for each id not held yet (undone with ``undo``);
        the caller writes the new slots' fields."""
        slots = self.index.lookup(ids)
        new = (slots < 0).nonzero().squeeze(1)
        if new.numel():
            self.grow_to(live + new.numel(), live, grow_tensor)
            slots.index_copy_(0, new, self.index.insert_new(ids.index_select(0, new), undo))
        return slots

    def prefault_ahead(self, end: int) -> None:
        """Have the pages of the rows after ``end`` made present off the loop, a few MiB ahead (fleet.sparse.pages)."""
        ahead = max(4096, (2 << 20) // self.rec.record_bytes)  # about one (huge) page of records
        if end + ahead // 2 < self.prefaulted:
            return
        lo = max(end, self.prefaulted)
        hi = min(self.capacity, lo + ahead)
        if hi > lo:
            for name in self.row_names():
                prefault(self.field(name)[lo:hi])
        self.prefaulted = hi

    # ------------------------------------------------------------------ reads
    def gather_rows(self, slots: torch.Tensor, live: int) -> torch.Tensor:
        """``rows[slots]`` as a new tensor: a native gather (prefetching, GIL released, bounds checked)."""
        out = torch.empty(slots.numel(), self.dim, dtype=torch.float32)
        if slots.numel():
            rows = buf(self.rows, "rows", torch.float32, 2, strided=True)
            kernels.gather_rows(rows, slots.contiguous().numpy(), live, out.numpy())
        return out

    # ------------------------------------------------------------------ the row optimizer's step
    def step_rows(
        self, hyper: tuple, slots: torch.Tensor, grads: torch.Tensor, lr: float, live: int, undo: UndoLog | None
    ) -> None:
        """The row optimizer's step (``hyper``: its :func:`~fleet.sparse.native.native_hyper`, any lr) on ``slots`` (of ``live`` rows) (duplicates' gradients summed first, in batch order), natively.

        The kernel finds repeated slots with a hash of the batch (no sort) and updates each row once
        with its total: the same sums as ``torch.unique`` + ``index_add_``. It checks every slot before
        it writes. With ``undo`` it hands back what each row held, which the undo writes back if a later
        step fails (repeated slots get the same old values, so the undo's writes agree whatever their
        order); ``undo`` None is for a caller whose operation ends with this step (nothing after it can
        fail), which spares copying every touched row of every state tensor; the kernel then also sets
        the rows' dirty flags (else the life cycle's ``touch`` did, with their undo record).
        """
        names = tuple(self.state)  # the rule's state tensors, in its (the kernel's) order
        store = self
        state = [buf(store.state[name], f"state.{name}", torch.float32, 2, strided=True) for name in names]
        steps = buf(store.steps, "steps", torch.int64, 1, strided=True) if store.steps is not None else None
        # else marked by touch; a strided view where the records hold the flags
        dirty = buf(store.dirty, "dirty", torch.bool, 1, strided=True) if undo is None else None
        old: list[Any] = [None] * 4
        if undo is not None:
            n = slots.numel()
            old_rows = torch.empty(n, self.dim)
            old_state = {name: torch.empty(n, store.state[name].shape[1]) for name in names}
            old_steps = torch.empty(n, dtype=torch.int64) if store.steps is not None else None
            old = [old_rows.numpy()] + [old_state[name].numpy() for name in names] + [None] * (2 - len(names))
            old.append(old_steps.numpy() if old_steps is not None else None)
        kernels.apply_rows(
            with_lr(hyper, lr),
            buf(store.rows, "rows", torch.float32, 2, strided=True),
            state[0] if names else None,
            state[1] if len(names) > 1 else None,
            steps,
            dirty,
            slots.contiguous().numpy(),
            buf(grads.contiguous(), "grads", torch.float32, 2),
            live,
            *old,
        )
        if undo is None:
            return
        # recorded after the kernel's one write (it either writes everything or raises before writing)
        undo.rows(self.getter("rows"), slots, old_rows)
        for name in names:
            undo.rows(self.getter(f"state.{name}"), slots, old_state[name])
        if old_steps is not None:
            undo.rows(self.getter("steps"), slots, old_steps)

    # ------------------------------------------------------------------ moving rows
    def compact(self, gone: torch.Tensor, undo: UndoLog) -> torch.Tensor:
        """Drop the live rows whose slot is set in ``gone``, compacting the rest in place (slot order kept);
        return the removed ids. The undo keeps only the removed rows: it spreads the kept ones back."""
        n = gone.numel()
        keep = (~gone).nonzero().squeeze(1)
        drop = gone.nonzero().squeeze(1)
        m = keep.numel()
        new_slot = torch.full((n,), -1, dtype=torch.int64)
        new_slot[keep] = torch.arange(m)
        removed_ids = self.index.renumber(new_slot, undo)  # first: it reads the removed ids at their slots
        for name in self.row_names():
            get = self.getter(name)
            t = get()
            compacted, removed = t[:n].index_select(0, keep), t[:n].index_select(0, drop)
            t[:m] = compacted
            # recorded after the write, not before like the others: spreading undoes a compaction only
            undo.add(lambda get=get, removed=removed: _spread(get(), keep, drop, removed))
        return removed_ids

    def reorder(self, order: torch.Tensor, undo: UndoLog) -> None:
        """Move the live rows so that slot ``i`` holds what slot ``order[i]`` held."""
        n = order.numel()
        new_slot = torch.empty(n, dtype=torch.int64)
        new_slot[order] = torch.arange(n)
        for name in self.row_names():
            get = self.getter(name)
            undo.span(get, 0, n)
            t = get()
            t[:n] = t[:n].index_select(0, order)
        self.index.renumber(new_slot, undo)


def _spread(t: torch.Tensor, keep: torch.Tensor, drop: torch.Tensor, removed: torch.Tensor) -> None:
    """Undo a compaction of ``t``: the kept rows (now first) back to slots ``keep``, ``removed`` to ``drop``."""
    kept = t[: keep.numel()].clone()
    t.index_copy_(0, keep, kept)
    t.index_copy_(0, drop, removed)
