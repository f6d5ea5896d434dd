"""One server's shard of a sparse embedding table: rows keyed by arbitrary int64 ids.

Why rows are created on first touch: CTR-style ids come from a huge, open
space (hashed feature values), so the table cannot be allocated up front. A row
is created the first time any request (pull or push) names its id, with the
value :func:`fleet.sparse.optim.initial_rows` gives that id, so the result does not
depend on which worker touched it first or how ids are sharded over servers.

Storage: an :class:`~fleet.sparse.id_index.IdIndex` maps id -> dense slot; each slot's
id, row, optimizer state (momentum buffer, Adam moments, Adagrad sum), step count (where
the optimizer reads it) and life-cycle statistics are one record of a growable row-major
array (:mod:`fleet.sparse.records`; amortised doubling of reserved address space), which the
table reads through strided views of each field (``_rows``, ``_state``, ``_steps``, ``_stats``).
The index confirms a match by reading the id in the record, next to the row. Every
operation is a fixed number of whole-batch torch ops or one native pass; nothing loops over ids in Python.

Updates are row-wise ("lazy"): only the rows named in a push change, each with
its own state and step, so a row that gets a gradient every step follows
``torch.optim`` exactly. Not thread-safe: the server serialises calls per table.

With a life cycle (:mod:`fleet.sparse.lifecycle`: admission, TTL, ``max_rows``) rows are
created by updates only, once admitted; a pull of an id without a row returns its
initial value (zeros while an entry has not admitted it) and stores nothing. Every
table remembers which rows changed since the last save and which ids it evicted, so a
save can be a delta (:meth:`state_dict` with ``delta=True``, :meth:`apply_delta`). What a save
holds and how it is checked is :mod:`fleet.sparse.saves` (a :class:`~fleet.sparse.saves.TableSaves`
the table composes), working through the table's storage methods (:meth:`slot_ids`,
:meth:`copy_rows`, :meth:`header`, :meth:`replace_rows`, :meth:`merge_rows`, ...).

Every operation is all-or-nothing (:meth:`transaction`, :mod:`fleet.sparse.undo`): if any step
fails -- an allocation when memory runs out, above all -- the table is rolled back to what
it was and stays usable. New rows are written into the free slots past the live length
before the id index learns their ids, so the index never names a slot without a row.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from fleet.sparse.growable import grow, row_tensor
from fleet.sparse.id_index import IdIndex, as_ids
from fleet.sparse.lifecycle import Admission, LifeCycle
from fleet.sparse.native import buf, kernels, native_hyper
from fleet.sparse.optim import (
    InitializerSpec,
    OptimizerSpec,
    ServerOptimizer,
    check_table_config,
    initial_rows,
)
from fleet.sparse.pages import prefault
from fleet.sparse.recent_slots import RecentSlots
from fleet.sparse.records import RowRecords
from fleet.sparse.saves import TableSaves
from fleet.sparse.table_lifecycle import TableLifeCycle
from fleet.sparse.undo import Getter, UndoLog

_REQUIRED_KEYS = ("dim", "optimizer")


class SparseTable(TableLifeCycle):
    """Rows of width ``dim`` keyed by int64 id, updated by a row-wise server optimizer."""

    #: what a table config may hold (a shard's config has more: the update mode, backup workers)
    CONFIG_KEYS = ("dim", "optimizer", "initializer", "seed", "servers", *LifeCycle.CONFIG_KEYS)

    def __init__(
        self,
        dim: int,
        optimizer: OptimizerSpec,
        initializer: InitializerSpec | None = None,
        seed: int = 0,
        lifecycle: LifeCycle | None = None,
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
        self.lifecycle = lifecycle if lifecycle is not None else LifeCycle()
        self._admission = Admission(self.lifecycle.entry, self.lifecycle.sketch_width, seed)
        self.clock = 0
        self.counts = {"dropped_gradients": 0, "evicted": 0, "refused_rows": 0}
        self._next_expiry = 0
        self._deleted: list[torch.Tensor] | None = []  # None: too many to remember, the next save must be a base
        self._deleted_count = 0
        self.saved = False  # whether a save (or load) set the start of the next delta
        self._undo: UndoLog | None = None  # the open transaction's log
        self._recent = RecentSlots()  # slots of recent pulls, for the pushes of the same ids
        self._reset(capacity=1024)
        self._saves = TableSaves(self)

    def _reset(self, capacity: int) -> None:
        self._recent.forget()
        # Per-row storage over reserved address space: growing it is a longer view, not a copy.
        # Steps are kept only where the math reads them (a save holds zeros otherwise, as it always did).
        self._set_records(
            RowRecords(
                capacity,
                self.dim,
                self.state_width,
                self._opt.state_names,
                steps=self._track_steps,
                stats=self.lifecycle.active,
            )
        )
        self._index = IdIndex(capacity * 2, keys=self._key_column)
        self._capacity = capacity
        self._prefaulted = 0  # rows whose pages were handed to fleet.sparse.pages.prefault (a hint)
        if self._rec.dirty is None:  # changed since the last save: in the records where they have room
            self._dirty = row_tensor(capacity, (), torch.bool).zero_()

    def _set_records(self, records: RowRecords) -> None:
        """Take ``records`` as the row storage, with a view of each field."""
        self._rec = records
        self._records = records.data
        self._rows, self._steps = records.rows, records.steps
        self._state, self._stats = dict(records.state), dict(records.stats)
        if records.dirty is not None:
            self._dirty = records.dirty

    def _key_column(self) -> torch.Tensor:
        """The id of each slot (the id index's key column): the records' id field."""
        return self._rec.ids

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> SparseTable:
        """Build from ``{"dim", "optimizer", "initializer", "seed"}`` and the life-cycle keys (optional ones).

        ``max_rows`` is the job's cap; with ``servers`` S each shard keeps at most ``max_rows // S``.
        """
        check_table_config("sparse", config, cls.CONFIG_KEYS, _REQUIRED_KEYS)
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
        try:
            lifecycle = LifeCycle.from_config(config, shards=int(config.get("servers", 1)))
        except (TypeError, ValueError) as err:
            raise ValueError(f"sparse table config: {err}") from None
        return cls(dim, spec, init, seed, lifecycle)

    def __len__(self) -> int:
        """Number of rows the table holds now."""
        return len(self._index)

    def info(self) -> dict[str, Any]:
        return {"rows": len(self), "clock": self.clock, **self.counts}

    # ------------------------------------------------------------------ transactions
    @contextlib.contextmanager
    def transaction(self) -> Iterator[UndoLog]:
        """Every change made inside, or on an exception none: the table is rolled back, then it re-raises.

        Operations open their own; an enclosing one (a load followed by its deltas) makes them
        one. Grown storage stays grown (its contents are rolled back): capacity is not state.
        """
        if self._undo is not None:
            yield self._undo
            return
        undo = UndoLog()
        undo.attrs(self, "clock", "_next_expiry", "counts", "_deleted", "_deleted_count", "saved")
        self.counts = dict(self.counts)  # changed in place below: the rollback restores the original
        if self._deleted is not None:
            self._deleted = list(self._deleted)
        self._undo = undo
        try:
            yield undo
        except BaseException:
            undo.rollback()
            self._recent.forget()  # the rollback may take back rows that a remembered pull created
            raise
        finally:
            self._undo = None

    def _log(self) -> UndoLog:
        if self._undo is None:
            raise RuntimeError("a sparse table change outside a transaction cannot be undone")
        return self._undo

    #: per-row tensors, by name: what compaction and reordering move (the records hold every saved field and the id)
    def _row_names(self) -> list[str]:
        return ["records"] if self._rec.dirty is not None else ["records", "dirty"]

    def _getter(self, name: str) -> Getter:
        """The tensor called ``name`` as the table holds it when the getter runs (storage may grow meanwhile)."""
        kind, _, key = name.partition(".")
        if kind == "state":
            return lambda: self._state[key]
        if kind == "stats":
            return lambda: self._stats[key]
        attr = f"_{kind}"
        return lambda: getattr(self, attr)

    # ------------------------------------------------------------------ saves
    def state_dict(self, delta: bool = False) -> dict[str, Any]:
        """See :meth:`fleet.sparse.saves.TableSaves.state_dict`."""
        return self._saves.state_dict(delta)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """See :meth:`fleet.sparse.saves.TableSaves.load_state_dict`."""
        self._saves.load_state_dict(state)

    def apply_delta(self, state: dict[str, Any]) -> None:
        """See :meth:`fleet.sparse.saves.TableSaves.apply_delta`."""
        self._saves.apply_delta(state)

    def export(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, rows) of every row the table holds, for serving (no optimizer state, no statistics)."""
        return self.slot_ids(), self._rows[: len(self)].clone()

    @property
    def state_width(self) -> int:
        """Columns of each per-row optimizer state tensor: ``dim``, or 1 for row-wise Adagrad."""
        return self._opt.state_width or self.dim

    @property
    def state_names(self) -> tuple[str, ...]:
        """The optimizer's per-row state tensors (``state.<name>`` in a save)."""
        return tuple(self._opt.state_names)

    def stat_dtypes(self) -> dict[str, torch.dtype]:
        """The life cycle's per-row statistics (``stats.<name>`` in a save) and their dtypes."""
        return {name: t.dtype for name, t in self._stats.items()}

    def slot_ids(self) -> torch.Tensor:
        """The ids of the rows, in slot order (row ``i`` of :meth:`copy_rows` belongs to ``slot_ids()[i]``)."""
        return self._index.ids_by_slot()

    def _saved_fields(self) -> dict[str, torch.Tensor]:
        """The per-row fields a save holds that the table stores (``steps`` only where the optimizer counts them)."""
        out = {"rows": self._rows}
        if self._steps is not None:
            out["steps"] = self._steps
        out.update({f"state.{k}": t for k, t in self._state.items()})
        out.update({f"stats.{k}": t for k, t in self._stats.items()})
        return out

    def copy_rows(self, pick: slice | torch.Tensor) -> dict[str, torch.Tensor]:
        """Copies of the per-row fields (``rows``, ``steps``, ``state.*``, ``stats.*``) of the slots ``pick``."""
        n = len(self)
        out = {name: t[:n][pick].clone() for name, t in self._saved_fields().items()}
        if "steps" not in out:  # not counted by this optimizer: 0, as documented for saves
            out["steps"] = torch.zeros(out["rows"].shape[0], dtype=torch.int64)
        return out

    def changed_slots(self) -> torch.Tensor:
        """The slots of rows created or changed since :meth:`mark_saved`."""
        return self._dirty[: len(self)].nonzero().squeeze(1)

    def evicted_since_save(self) -> torch.Tensor | None:
        """The ids evicted since :meth:`mark_saved`; None when too many to remember (the next save is a base)."""
        if self._deleted is None:
            return None
        return torch.cat(self._deleted) if self._deleted else torch.empty(0, dtype=torch.int64)

    def header(self) -> dict[str, Any]:
        """The table-wide state a save holds besides the rows: clock, next expiry, counts, admission."""
        return {
            "clock": self.clock,
            "next_expiry": self._next_expiry,
            "counts": dict(self.counts),
            "admission": self._admission.state_dict(),
        }

    def mark_saved(self) -> None:
        """The last :meth:`state_dict` is on disk: the next delta starts from here."""
        with self.transaction() as undo:
            undo.span(self._getter("dirty"), 0, len(self))
            self._dirty[: len(self)] = False  # rows past the end are marked when created
            self._deleted, self._deleted_count = [], 0
            self.saved = True

    def _set_header(self, header: dict[str, Any]) -> None:
        self.clock = int(header["clock"])
        self._next_expiry = int(header["next_expiry"])
        self.counts.update(header["counts"])
        if self._admission.sketch is not None:
            self._log().attrs(self._admission.sketch, "counters", "added")
        self._admission.load_state_dict(header["admission"])

    def replace_rows(self, ids: torch.Tensor, fields: dict[str, torch.Tensor], header: dict[str, Any]) -> None:
        """Replace every row with ``ids`` and their checked ``fields`` (as :meth:`copy_rows` names them); saved."""
        n = ids.numel()
        cap = 1024
        while cap < n:
            cap *= 2
        with self.transaction() as undo:
            # everything is replaced by new tensors: the undo keeps the old ones
            undo.attrs(self, "_index", "_capacity", "_rec", "_records", "_rows", "_steps", "_state", "_dirty")
            undo.attrs(self, "_stats")
            self._reset(cap)
            self._index.insert_new(ids)
            for name, t in self._saved_fields().items():
                t[:n] = fields[name]
            self._set_header(header)
            self.mark_saved()

    def merge_rows(
        self, deleted: torch.Tensor, ids: torch.Tensor, fields: dict[str, torch.Tensor], header: dict[str, Any]
    ) -> None:
        """Evict ``deleted``, then write ``ids``' checked ``fields`` (creating rows as needed); saved."""
        with self.transaction() as undo:
            if deleted.numel():
                slots = self._index.lookup(deleted)
                gone = torch.zeros(len(self), dtype=torch.bool)
                gone[slots[slots >= 0]] = True
                self._remove(gone)
            slots = self._slots_creating(ids, undo)
            for name, t in self._saved_fields().items():
                undo.rows(self._getter(name), slots)
                t.index_copy_(0, slots, fields[name])
            self._set_header(header)
            self.mark_saved()

    def rows_page(self, start: int, count: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(ids, copies of the per-row fields) of the rows in slots ``start .. start+count`` (a bounded read)."""
        end = min(len(self), max(0, start) + max(0, count))
        pick = slice(min(max(0, start), end), end)
        return self.slot_ids()[pick].clone(), self.copy_rows(pick)

    def sort_by_id(self) -> None:
        """Put the rows in ascending id order (a state dict's order), so that a table loaded from one holds
        its rows in the same slots as this one: where slots break ties (evicting equal scores), both agree."""
        n = len(self)
        ids = self.slot_ids()
        if n < 2 or bool((ids[1:] > ids[:-1]).all()):
            return
        order = torch.argsort(ids)
        new_slot = torch.empty(n, dtype=torch.int64)
        new_slot[order] = torch.arange(n)
        with self.transaction() as undo:
            self._recent.forget()  # slots move
            for name in self._row_names():
                get = self._getter(name)
                undo.span(get, 0, n)
                t = get()
                t[:n] = t[:n].index_select(0, order)
            self._index.renumber(new_slot, undo)

    def _slots_creating(self, ids: torch.Tensor, undo: Any) -> torch.Tensor:
        """``ids``' slots, appending a row for each id not in the table yet (undone with ``undo``)."""
        first = len(self)
        slots = self._index.lookup(ids)
        new = (slots < 0).nonzero().squeeze(1)
        if new.numel():
            self._grow_to(first + new.numel(), used=first)
            slots.index_copy_(0, new, self._index.insert_new(ids.index_select(0, new), undo))
        return slots

    def write_rows(self, ids: torch.Tensor, fields: dict[str, torch.Tensor], replace: bool = False) -> None:
        """Set rows ``ids`` to ``fields`` (``rows`` required; ``steps``, ``state.*``, ``stats.*`` optional).

        Given rows: a row without the optional fields starts fresh (optimizer state and statistics as
        for a new row). Rows are created as needed whatever the life cycle's admission says;
        ``replace`` evicts every other row first. Written rows count as changed for the next delta save.
        ``steps`` are kept only where the optimizer counts them (they read 0 otherwise, as saves say).
        """
        ids = as_ids(ids)
        n = ids.numel()
        if torch.unique(ids).numel() != n:
            raise ValueError("write_rows: 'ids' contains duplicates")
        names = self._saved_fields()
        known = set(names) | {"steps"}  # steps: stored where the optimizer counts them, else always 0
        unknown = sorted(set(fields) - known)
        if unknown or "rows" not in fields:
            raise ValueError(f"write_rows takes 'rows' and optionally {sorted(known - {'rows'})}, got {unknown}")
        given = {}
        for name, value in fields.items():
            if name == "rows" or name.startswith("state."):
                given[name] = self.check_rows(name, value, n, names[name].shape[1])
            elif tuple(value.shape) != (n,):
                raise ValueError(f"write_rows: '{name}' has shape {tuple(value.shape)}, expected ({n},)")
            elif name in names:
                given[name] = value.to(names[name].dtype)
        with self.transaction() as undo:
            if replace and len(self):
                self._remove(torch.ones(len(self), dtype=torch.bool))
            slots = self._slots_creating(ids, undo)
            fresh = {k: t.new_empty((n, *t.shape[1:])) for k, t in names.items() if k not in given}
            self._start_fresh(fresh)
            for name, t in self._saved_fields().items():
                undo.rows(self._getter(name), slots)
                t.index_copy_(0, slots, given[name] if name in given else fresh[name])
            undo.rows(self._getter("dirty"), slots)
            self._dirty.index_fill_(0, slots, True)
            self._recent.forget()

    # ------------------------------------------------------------------ storage
    def _grow_to(self, needed: int, used: int) -> None:
        """Make room for ``needed`` rows (keeping the first ``used``), doubling so growth is amortised.

        Usually a longer view of reserved memory (:mod:`fleet.sparse.growable`); otherwise every new tensor
        is made before any is swapped in, so a failed allocation changes nothing.
        """
        if needed <= self._capacity:
            return
        cap = self._capacity
        while cap < needed:
            cap *= 2
        n = used
        records = self._rec.over(grow(self._records, cap, n))
        dirty = grow(self._dirty, cap, n) if records.dirty is None else records.dirty  # rows past n: marked when made
        if records.data.data_ptr() != self._records.data_ptr():
            self._prefaulted = min(self._prefaulted, n)  # copied into fresh memory: not faulted in yet
        self._set_records(records)
        self._dirty, self._capacity = dirty, cap

    def _slots(self, ids: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        """Slots for ``ids`` (any order, duplicates allowed), creating missing rows (in a transaction).

        ``slots``: the index's lookup of ``ids``, when the caller did it already. New ids are
        de-duplicated and sorted, so their slots follow id order within one call; their rows are
        written before the index learns them.
        """
        slots = self._index.lookup(ids) if slots is None else slots
        missing = slots < 0
        if not bool(missing.any()):
            return slots
        where = missing.nonzero().squeeze(1)
        new_ids = ids.index_select(0, where)
        inverse = None
        if not bool((new_ids[1:] > new_ids[:-1]).all()):  # ascending ids (a pull's unique ids) are unique already
            new_ids, inverse = torch.unique(new_ids, sorted=True, return_inverse=True)
        self._init_rows(len(self), new_ids)
        new_slots = self._index.insert_new(new_ids, self._log())
        slots.index_copy_(0, where, new_slots if inverse is None else new_slots.index_select(0, inverse))
        return slots

    def _init_rows(self, first: int, new_ids: torch.Tensor) -> None:
        """Fill the free slots ``first ..`` (past the live length: nothing to undo) for ``new_ids``."""
        end = first + new_ids.numel()
        self._grow_to(end, used=first)
        initial_rows(new_ids, self.dim, self.initializer, self.seed, out=self._rows[first:end])
        self._start_fresh({name: t[first:end] for name, t in self._saved_fields().items() if name != "rows"})
        self._dirty[first:end] = True
        self._prefault_ahead(end)

    def _start_fresh(self, fields: dict[str, torch.Tensor]) -> None:
        """Set per-row ``fields`` (named as :meth:`copy_rows` names them, any but ``rows``) as a new row starts:
        no steps, the optimizer's initial state, statistics counted from now."""
        state = {}
        for name, t in fields.items():
            if name.startswith("state."):
                state[name[len("state.") :]] = t
            elif name == "stats.last_seen":
                t.fill_(self.clock)
            else:  # steps, stats.show, stats.click
                t.zero_()
        self._opt.fill_new_state(state)

    def _prefault_ahead(self, end: int) -> None:
        """Have the pages of the rows after ``end`` made present off the loop, a few MiB ahead (fleet.sparse.pages)."""
        ahead = max(4096, (2 << 20) // self._rec.record_bytes)  # about one (huge) page of records
        if end + ahead // 2 < self._prefaulted:
            return
        lo = max(end, self._prefaulted)
        hi = min(self._capacity, lo + ahead)
        if hi > lo:
            for name in self._row_names():
                prefault(self._getter(name)()[lo:hi])
        self._prefaulted = hi

    def check_rows(self, name: str, values: torch.Tensor, n: int, width: int | None = None) -> torch.Tensor:
        """``values`` as float32 ``[n, width]`` rows (``width``: ``dim`` unless given), or an error naming ``name``."""
        width = self.dim if width is None else width
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(values).__name__}")
        if tuple(values.shape) != (n, width):
            raise ValueError(f"{name} has shape {tuple(values.shape)}, expected ({n}, {width}) for {n} ids")
        if not values.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point tensor, got {values.dtype}")
        return values.to(torch.float32)

    # ------------------------------------------------------------------ requests
    def pull(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows for ``ids`` as a new float32 ``[len(ids), dim]`` tensor; missing rows are created.

        With a life cycle nothing is created: an id without a row reads its initial value, or
        zeros while an entry has not admitted it.
        """
        ids = as_ids(ids)
        if not self.lifecycle.active:
            # one native pass: each row is copied as its id is confirmed in the record (same cache lines)
            slots, rows = self._index.lookup_rows(ids, self._rows[: len(self)])
            if not bool((slots < 0).any()):
                self._recent.remember(ids, slots)  # nothing changed: no transaction needed
                return rows
            new = (slots < 0).nonzero().squeeze(1)  # before _slots, which fills these slots in
            with self.transaction():  # the gather below can fail too: then the new rows go again
                slots = self._slots(ids, slots)  # first: creating rows may replace self._rows
                # the rows found were copied by the lookup: only the new ones (their initial values) are gathered
                rows.index_copy_(0, new, self._gather_rows(slots.index_select(0, new)))
                self._recent.remember(ids, slots)  # a failure here takes the rows back and forgets
                return rows
        slots, out = self._index.lookup_rows(ids, self._rows[: len(self)])  # absent ids' rows: filled below
        missing = (slots < 0).nonzero().squeeze(1)
        if missing.numel():
            if self.lifecycle.entry is not None:
                out.index_fill_(0, missing, 0.0)
            else:
                fresh = initial_rows(ids.index_select(0, missing), self.dim, self.initializer, self.seed)
                out.index_copy_(0, missing, fresh)
        return out

    def apply_gradient(
        self,
        ids: torch.Tensor,
        grads: torch.Tensor,
        lr: float,
        clicks: torch.Tensor | None = None,
        step: int | None = None,
    ) -> None:
        """One row-wise optimizer step on the named rows; duplicate ids' gradients are summed first.

        Advances the clock (to ``step`` when given). ``clicks`` (one per id, optional) feed the
        rows' click counts.
        """
        ids = as_ids(ids)
        grads = self.check_rows("grads", grads, ids.numel())
        clicks = self._check_clicks(clicks, ids.numel())
        # Outermost, this operation ends with the kernel's all-or-nothing write: it needs no undo record.
        # Inside an enclosing transaction a later operation may fail, and the rows must go back then.
        nested = self._undo is not None
        with self.transaction() as undo:
            self.tick(step)
            if ids.numel() == 0:
                return
            slots, grads, clicks = self._update_slots(ids, grads, clicks)
            if slots.numel() == 0:
                return
            self._touch(slots, clicks, mark_dirty=nested)  # outermost, the kernel marks the rows changed
            self._step_rows(slots, grads, float(lr), undo if nested else None)  # the last change: keep it last

    def add_delta(
        self, ids: torch.Tensor, deltas: torch.Tensor, step: int | None = None, clicks: torch.Tensor | None = None
    ) -> None:
        """Geo mode: add per-row parameter changes (duplicates add up); optimizer state untouched. ``clicks``
        (one per id, optional): the clicks the worker recorded for these rows since its last sync."""
        ids = as_ids(ids)
        deltas = self.check_rows("deltas", deltas, ids.numel())
        clicks = self._check_clicks(clicks, ids.numel())
        with self.transaction() as undo:
            self.tick(step)
            if ids.numel():
                slots, deltas, clicks = self._update_slots(ids, deltas, clicks)
                self._touch(slots, clicks)
                undo.rows(self._getter("rows"), slots)
                self._rows.index_add_(0, slots, deltas)

    def _step_rows(self, slots: torch.Tensor, grads: torch.Tensor, lr: float, undo: UndoLog | None) -> None:
        """The row optimizer's step on ``slots`` (duplicates' gradients summed first, in batch order), natively.

        The kernel finds repeated slots with a hash of the batch (no sort) and updates each row once
        with its total: the same sums as ``torch.unique`` + ``index_add_``. It checks every slot before
        it writes. With ``undo`` it hands back what each row held, which the undo writes back if a later
        step fails (repeated slots get the same old values, so the undo's writes agree whatever their
        order); ``undo`` None is for a caller whose operation ends with this step (nothing after it can
        fail), which spares copying every touched row of every state tensor; the kernel then also sets
        the rows' dirty flags (else :meth:`_touch` did, with their undo record).
        """
        names = self._opt.state_names
        state = [buf(self._state[name], f"state.{name}", torch.float32, 2, strided=True) for name in names]
        steps = buf(self._steps, "steps", torch.int64, 1, strided=True) if self._track_steps else None
        # else marked by _touch; a strided view where the records hold the flags
        dirty = buf(self._dirty, "dirty", torch.bool, 1, strided=True) if undo is None else None
        old: list[Any] = [None] * 4
        if undo is not None:
            n = slots.numel()
            old_rows = torch.empty(n, self.dim)
            old_state = {name: torch.empty(n, self._state[name].shape[1]) for name in names}
            old_steps = torch.empty(n, dtype=torch.int64) if self._track_steps else None
            old = [old_rows.numpy()] + [old_state[name].numpy() for name in names] + [None] * (2 - len(names))
            old.append(old_steps.numpy() if old_steps is not None else None)
        kernels.apply_rows(
            native_hyper(self.optimizer, lr),
            buf(self._rows, "rows", torch.float32, 2, strided=True),
            state[0] if names else None,
            state[1] if len(names) > 1 else None,
            steps,
            dirty,
            slots.contiguous().numpy(),
            buf(grads.contiguous(), "grads", torch.float32, 2),
            len(self),
            *old,
        )
        if undo is None:
            return
        # recorded after the kernel's one write (it either writes everything or raises before writing)
        undo.rows(self._getter("rows"), slots, old_rows)
        for name in names:
            undo.rows(self._getter(f"state.{name}"), slots, old_state[name])
        if old_steps is not None:
            undo.rows(self._getter("steps"), slots, old_steps)

    def _gather_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """``self._rows[slots]`` as a new tensor: a native gather (prefetching, GIL released, bounds checked)."""
        out = torch.empty(slots.numel(), self.dim, dtype=torch.float32)
        if slots.numel():
            rows = buf(self._rows, "rows", torch.float32, 2, strided=True)
            kernels.gather_rows(rows, slots.contiguous().numpy(), len(self), out.numpy())
        return out

    def _check_clicks(self, clicks: torch.Tensor | None, n: int) -> torch.Tensor | None:
        if clicks is None:
            return None
        if not isinstance(clicks, torch.Tensor) or tuple(clicks.shape) != (n,) or not clicks.dtype.is_floating_point:
            raise ValueError(f"clicks must be a float tensor of shape ({n},), one per id")
        return clicks.to(torch.float32)
