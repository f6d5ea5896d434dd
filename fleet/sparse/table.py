"""One server's shard of a sparse embedding table: rows keyed by arbitrary int64 ids.

Why rows are created on first touch: CTR-style ids come from a huge, open
space (hashed feature values), so the table cannot be allocated up front. A row
is created the first time any request (pull or push) names its id, with the
value :func:`fleet.sparse.optim.initial_rows` gives that id, so the result does not
depend on which worker touched it first or how ids are sharded over servers.

The table composes three parts, each through a declared face of the table: its storage (a
:class:`~fleet.sparse.row_store.RowStore`: records, id index, growth, the native optimizer step), its life
cycle (:class:`~fleet.sparse.table_lifecycle.TableLifeCycle`, through ``LivingTable``) and its saves
(:class:`~fleet.sparse.saves.TableSaves`, through ``StoredTable``). Every operation is a fixed number of
whole-batch torch ops or one native pass; nothing loops over ids in Python.

Updates are row-wise ("lazy"): only the rows named in a push change, each with
its own state and step, so a row that gets a gradient every step follows
``torch.optim`` exactly. Not thread-safe: the server serialises calls per table.

With a life cycle (:mod:`fleet.sparse.lifecycle`: admission, TTL, ``max_rows``) rows are
created by updates only, once admitted; a pull of an id without a row returns its
initial value (zeros while an entry has not admitted it) and stores nothing. Every
table remembers which rows changed since the last save and which ids it evicted, so a
save can be a delta (:meth:`state_dict` with ``delta=True``, :meth:`apply_delta`).

Every operation is all-or-nothing (:meth:`transaction`, :mod:`fleet.sparse.undo`): if any step
fails -- an allocation when memory runs out, above all -- the table is rolled back to what
it was and stays usable. New rows are written into the free slots past the live length
before the id index learns their ids, so the index never names a slot without a row.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

from fleet.sparse.growable import grow
from fleet.sparse.id_index import IdIndex, as_ids
from fleet.sparse.lifecycle import LifeCycle
from fleet.sparse.native import buf, kernels, native_hyper
from fleet.sparse.optim import (
    InitializerSpec,
    OptimizerSpec,
    ServerOptimizer,
    check_table_config,
    initial_rows,
)
from fleet.sparse.recent_slots import RecentSlots
from fleet.sparse.row_store import RowStore
from fleet.sparse.saves import MAX_REMEMBERED_DELETIONS, TableSaves
from fleet.sparse.table_lifecycle import TableLifeCycle
from fleet.sparse.undo import Getter, UndoLog

_REQUIRED_KEYS = ("dim", "optimizer")


class _Transaction:
    """:meth:`SparseTable.transaction`: a class, not a generator-based context manager, because every pull and
    push of a parameter server opens one or two, and contextlib's generator machinery showed in their profiles."""

    __slots__ = ("_table", "_undo")

    def __init__(self, table: SparseTable) -> None:
        self._table = table
        self._undo: UndoLog | None = None  # None: an enclosing transaction's (its exit does the rest)

    def __enter__(self) -> UndoLog:
        table = self._table
        if table._undo is not None:
            return table._undo
        self._undo = table._open_transaction()
        return self._undo

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        undo = self._undo
        if undo is None:
            return False
        self._undo = None
        self._table._close_transaction(undo, failed=kind is not None)
        return False  # an exception goes on


class SparseTable:
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
        self._hyper = native_hyper(optimizer, optimizer.lr)  # each push passes its own lr (native.with_lr)
        # Per-row step counts cost two random accesses per row; keep them only where the math reads them.
        self._track_steps = self._opt.needs_step
        self.lifecycle = lifecycle if lifecycle is not None else LifeCycle()
        self.clock = 0
        self.counts = {"dropped_gradients": 0, "evicted": 0, "refused_rows": 0}
        self._life = TableLifeCycle(self, seed)
        self._deleted: list[torch.Tensor] | None = []  # None: too many to remember, the next save must be a base
        self._deleted_count = 0
        self.saved = False  # whether a save (or load) set the start of the next delta
        self._undo: UndoLog | None = None  # the open transaction's log
        self._recent = RecentSlots()  # slots of recent pulls, for the pushes of the same ids
        self._reset(capacity=1024)
        self._saves = TableSaves(self)

    def _reset(self, capacity: int) -> None:
        self._recent.forget()
        # Steps are kept only where the math reads them (a save holds zeros otherwise, as it always did).
        self._store = RowStore(
            capacity,
            self.dim,
            self.state_width,
            self._opt.state_names,
            steps=self._track_steps,
            stats=self.lifecycle.active,
        )

    # The store's and the life cycle's pieces under the names the table's tests and benchmarks read.
    _index = property(lambda self: self._store.index)
    _capacity = property(lambda self: self._store.capacity)
    _records = property(lambda self: self._store.records)
    _rows = property(lambda self: self._store.rows)
    _state = property(lambda self: self._store.state)
    _dirty = property(lambda self: self._store.dirty)
    _next_expiry = property(lambda self: self._life.next_expiry)
    _admission = property(lambda self: self._life.admission)

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
        return len(self._store.index)

    def info(self) -> dict[str, Any]:
        return {"rows": len(self), "clock": self.clock, **self.counts}

    # ------------------------------------------------------------------ transactions
    def transaction(self) -> AbstractContextManager[UndoLog]:
        """Every change made inside, or on an exception none: the table is rolled back, then it re-raises.

        Operations open their own; an enclosing one (a load followed by its deltas) makes them
        one. Grown storage stays grown (its contents are rolled back): capacity is not state.
        """
        return _Transaction(self)

    def _open_transaction(self) -> UndoLog:
        undo = UndoLog()
        saved = (self.clock, self.counts, self._deleted, self._deleted_count, self.saved)

        def restore() -> None:  # UndoLog.attrs, unrolled: it runs per pull and push
            self.clock, self.counts, self._deleted, self._deleted_count, self.saved = saved

        undo.add(restore)
        undo.attrs(self._life, "next_expiry")
        self.counts = dict(self.counts)  # changed in place below: the rollback restores the original
        if self._deleted is not None:
            self._deleted = list(self._deleted)
        self._undo = undo
        return undo

    def _close_transaction(self, undo: UndoLog, failed: bool) -> None:
        try:
            if failed:
                undo.rollback()
                self._recent.forget()  # the rollback may take back rows that a remembered pull created
        finally:
            self._undo = None

    def undo_log(self) -> UndoLog:
        """The open transaction's undo log (a change outside one is a bug)."""
        if self._undo is None:
            raise RuntimeError("a sparse table change outside a transaction cannot be undone")
        return self._undo

    @property
    def index(self) -> IdIndex:
        """The id index: id -> slot of the live rows."""
        return self._store.index

    @property
    def stats(self) -> dict[str, torch.Tensor]:
        """The life cycle's per-row statistics (``last_seen``, ``show``, ``click``), by slot; empty without one."""
        return self._store.stats

    @property
    def dirty(self) -> torch.Tensor:
        """By slot: changed since the last save (a flag per row)."""
        return self._store.dirty

    def getter(self, name: str) -> Getter:
        """The per-row tensor called ``name`` as the table holds it when the getter runs (storage may grow)."""
        return self._store.getter(name)

    # ------------------------------------------------------------------ life cycle (the composed part)
    def tick(self, step: int | None = None) -> None:
        """Advance the clock: to ``step`` when given (never back), else by one; expire rows past their TTL."""
        self._life.tick(step)

    def advance_clock(self, step: int | None) -> None:
        """The clock to ``step`` (never back), or one on (in the open transaction)."""
        self.clock = self.clock + 1 if step is None else max(self.clock, int(step))

    def scores(self) -> torch.Tensor:
        """Each row's decayed show/click score (Paddle's CTR accessor score), by slot."""
        return self._life.scores()

    def shrink(self, threshold: float | None = None) -> int:
        """Remove rows past their TTL and, with ``threshold``, rows scoring below it; return how many went."""
        return self._life.shrink(threshold)

    def remove_slots(self, gone: torch.Tensor) -> int:
        """Drop the rows whose slot is set in ``gone`` (compacting the rest, slot order kept); return how many.

        Their ids are remembered for the next delta save, and count as evicted.
        """
        count = int(gone.sum())
        if not count:
            return 0
        self._recent.forget()  # compaction moves slots
        removed_ids = self._store.compact(gone, self.undo_log())
        if self._deleted is not None:
            self._deleted.append(removed_ids)
            self._deleted_count += removed_ids.numel()
            if self._deleted_count > max(MAX_REMEMBERED_DELETIONS, 4 * len(self)):
                self._deleted = None  # unbounded memory otherwise, for a job that never saves a delta
        self.counts["evicted"] += count
        return count

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
        return self.slot_ids(), self._store.rows[: len(self)].clone()

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
        return {name: t.dtype for name, t in self._store.stats.items()}

    def slot_ids(self) -> torch.Tensor:
        """The ids of the rows, in slot order (row ``i`` of :meth:`copy_rows` belongs to ``slot_ids()[i]``)."""
        return self._store.index.ids_by_slot()

    def _saved_fields(self) -> dict[str, torch.Tensor]:
        """The per-row fields a save holds that the table stores (``steps`` only where the optimizer counts them)."""
        return self._store.saved_fields()

    def copy_rows(self, pick: slice | torch.Tensor) -> dict[str, torch.Tensor]:
        """Copies of the per-row fields (``rows``, ``steps``, ``state.*``, ``stats.*``) of the slots ``pick``."""
        return self._store.copy_fields(pick, len(self))

    def changed_slots(self) -> torch.Tensor:
        """The slots of rows created or changed since :meth:`mark_saved`."""
        return self._store.dirty[: len(self)].nonzero().squeeze(1)

    def evicted_since_save(self) -> torch.Tensor | None:
        """The ids evicted since :meth:`mark_saved`; None when too many to remember (the next save is a base)."""
        if self._deleted is None:
            return None
        return torch.cat(self._deleted) if self._deleted else torch.empty(0, dtype=torch.int64)

    def header(self) -> dict[str, Any]:
        """The table-wide state a save holds besides the rows: clock, next expiry, counts, admission."""
        return {
            "clock": self.clock,
            "next_expiry": self._life.next_expiry,
            "counts": dict(self.counts),
            "admission": self._life.admission.state_dict(),
        }

    def mark_saved(self) -> None:
        """The last :meth:`state_dict` is on disk: the next delta starts from here."""
        with self.transaction() as undo:
            undo.span(self.getter("dirty"), 0, len(self))
            self._store.dirty[: len(self)] = False  # rows past the end are marked when created
            self._deleted, self._deleted_count = [], 0
            self.saved = True

    def _set_header(self, header: dict[str, Any]) -> None:
        self.clock = int(header["clock"])
        self.counts.update(header["counts"])
        self._life.load_state_dict(header, self.undo_log())

    def replace_rows(self, ids: torch.Tensor, fields: dict[str, torch.Tensor], header: dict[str, Any]) -> None:
        """Replace every row with ``ids`` and their checked ``fields`` (as :meth:`copy_rows` names them); saved."""
        n = ids.numel()
        cap = 1024
        while cap < n:
            cap *= 2
        with self.transaction() as undo:
            undo.attrs(self, "_store")  # everything is replaced by a new store: the undo keeps the old one
            self._reset(cap)
            self._store.index.insert_new(ids)
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
                slots = self._store.index.lookup(deleted)
                gone = torch.zeros(len(self), dtype=torch.bool)
                gone[slots[slots >= 0]] = True
                self.remove_slots(gone)
            slots = self._store.slots_creating(ids, len(self), undo, grow)
            for name, t in self._saved_fields().items():
                undo.rows(self.getter(name), slots)
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
        with self.transaction() as undo:
            self._recent.forget()  # slots move
            self._store.reorder(order, undo)

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
        given = self._store.given_fields(fields, n, self.check_rows)
        with self.transaction() as undo:
            if replace and len(self):
                self.remove_slots(torch.ones(len(self), dtype=torch.bool))
            slots = self._store.slots_creating(ids, len(self), undo, grow)
            fresh = {k: t.new_empty((n, *t.shape[1:])) for k, t in names.items() if k not in given}
            self._start_fresh(fresh)
            for name, t in self._saved_fields().items():
                undo.rows(self.getter(name), slots)
                t.index_copy_(0, slots, given[name] if name in given else fresh[name])
            undo.rows(self.getter("dirty"), slots)
            self._store.dirty.index_fill_(0, slots, True)
            self._recent.forget()

    # ------------------------------------------------------------------ storage
    def _slots(
        self, ids: torch.Tensor, slots: torch.Tensor | None = None, where: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Slots for ``ids`` (any order, duplicates allowed), creating missing rows (in a transaction).

        ``slots``: the index's lookup of ``ids``, when the caller did it already; ``where``: the positions of
        its misses (``slots < 0``), when the caller found them already. New ids are de-duplicated and
        sorted, so their slots follow id order within one call; their rows are written before the index
        learns them.
        """
        ascending = None
        if slots is None:  # the lookup finds the misses too
            slots, where, ascending = self._store.index.lookup_misses(ids)
        elif where is None:
            where = (slots < 0).nonzero().squeeze(1)
        if where.numel():
            self._create(ids, slots, where, ascending)
        return slots

    def _create(
        self, ids: torch.Tensor, slots: torch.Tensor, where: torch.Tensor, ascending: bool | None = None
    ) -> tuple[int, torch.Tensor | None]:
        """Create the rows of ``ids[where]`` (absent: ``slots[where]`` are -1) and fill in their slots.

        ``ascending``: whether those ids are known to be strictly ascending (None: not known, checked here).
        Returns (the first new slot, the inverse of the de-duplication or None): new id ``ids[where[i]]``
        has slot ``first + i``, or ``first + inverse[i]`` when the new ids were not ascending already.
        """
        new_ids = ids.index_select(0, where)
        inverse = None
        if ascending is None:
            ends = new_ids.numpy()
            ascending = bool((ends[1:] > ends[:-1]).all())
        if not ascending:  # ascending ids (a pull's unique ids) are unique already
            new_ids, inverse = torch.unique(new_ids, sorted=True, return_inverse=True)
        first = len(self)
        self.init_rows(first, new_ids)
        new_slots = self._store.index.insert_new(new_ids, self.undo_log())
        slots.index_copy_(0, where, new_slots if inverse is None else new_slots.index_select(0, inverse))
        return first, inverse

    def init_rows(self, first: int, new_ids: torch.Tensor) -> None:
        """Fill the free slots ``first ..`` (past the live length: nothing to undo) for ``new_ids``."""
        end = first + new_ids.numel()
        store = self._store
        store.grow_to(end, first, grow)
        initial_rows(new_ids, self.dim, self.initializer, self.seed, out=store.rows[first:end])
        fresh = store.fresh_fields()
        if fresh:  # the optimizer's state, steps, statistics: none for plain SGD without a life cycle
            self._start_fresh({name: t[first:end] for name, t in fresh.items()})
        store.dirty[first:end].fill_(True)  # fill_, not item assignment: several times cheaper
        store.prefault_ahead(end)

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

    def check_rows(self, name: str, values: torch.Tensor, n: int, width: int | None = None) -> torch.Tensor:
        """``values`` as float32 ``[n, width]`` rows (``width``: ``dim`` unless given), or an error naming ``name``."""
        width = self.dim if width is None else width
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(values).__name__}")
        if tuple(values.shape) != (n, width):
            raise ValueError(f"{name} has shape {tuple(values.shape)}, expected ({n}, {width}) for {n} ids")
        if not values.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point tensor, got {values.dtype}")
        return values if values.dtype is torch.float32 else values.to(torch.float32)  # .to costs a call even then

    # ------------------------------------------------------------------ requests
    def pull(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows for ``ids`` as a new float32 ``[len(ids), dim]`` tensor, or in ``out`` (such a tensor, contiguous)
        when given; missing rows are created.

        With a life cycle nothing is created: an id without a row reads its initial value, or
        zeros while an entry has not admitted it.
        """
        ids = as_ids(ids)
        if out is not None and (
            out.dtype is not torch.float32 or tuple(out.shape) != (ids.numel(), self.dim) or not out.is_contiguous()
        ):
            raise ValueError(
                f"pull: out must be contiguous float32 ({ids.numel()}, {self.dim}), got {out.dtype} {tuple(out.shape)}"
            )
        if not self.lifecycle.active:
            # one native pass: each row is copied as its id is confirmed in the record (same cache lines)
            store = self._store
            slots, rows, new, ascending = store.index.lookup_rows_misses(ids, store.rows[: len(self)], out)
            if new.numel() == 0:
                self._recent.remember(ids, slots)  # nothing changed: no transaction needed
                return rows
            with self.transaction():  # the copy below can fail too: then the new rows go again
                first, inverse = self._create(ids, slots, new, ascending)  # creating rows may replace store.rows
                # the rows found were copied by the lookup: only the new ones (their initial values, the rows just
                # written in slots first ..) are copied in
                fresh = self._store.rows[first : len(self)]
                kernels.scatter_rows(
                    buf(fresh if inverse is None else fresh.index_select(0, inverse), "rows", torch.float32, 2, True),
                    new.numpy(),
                    rows.numpy(),
                )
                self._recent.remember(ids, slots)  # a failure here takes the rows back and forgets
                return rows
        # absent ids: filled below
        slots, found, _, _ = self._store.index.lookup_rows_misses(ids, self._store.rows[: len(self)], out)
        missing = (slots < 0).nonzero().squeeze(1)
        if missing.numel():
            if self.lifecycle.entry is not None:
                found.index_fill_(0, missing, 0.0)
            else:
                fresh = initial_rows(ids.index_select(0, missing), self.dim, self.initializer, self.seed)
                found.index_copy_(0, missing, fresh)
        return found

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
        # a recent pull's slots (no life cycle): every one names a live row, nothing to look up or create
        taken = None if self.lifecycle.active else self._recent.take(ids)
        nested = self._undo is not None
        if taken is not None and not nested:
            # The usual push (one process, collective: the ids of this table's last pull, no life cycle): the
            # clock and the kernel's all-or-nothing write are all it changes, so no transaction is opened (its
            # undo log, copies and closures were a fixed cost of every table's step).
            clock = self.clock
            self.advance_clock(step)
            try:
                self._store.step_rows(self._hyper, taken, grads, float(lr), len(self), None)
            except BaseException:
                self.clock = clock  # the kernel wrote nothing
                raise
            return
        # Outermost, this operation ends with the kernel's all-or-nothing write: it needs no undo record.
        # Inside an enclosing transaction a later operation may fail, and the rows must go back then.
        with self.transaction() as undo:
            self.tick(step)
            if ids.numel() == 0:
                return
            if taken is not None:
                slots = taken
            else:  # (the recent pulls were asked above)
                slots, grads, clicks = self._update_slots(ids, grads, clicks, recent=False)
            if slots.numel() == 0:
                return
            self._life.touch(slots, clicks, mark_dirty=nested)  # outermost, the kernel marks the rows changed
            # the last change: keep it last (see RowStore.step_rows)
            self._store.step_rows(self._hyper, slots, grads, float(lr), len(self), undo if nested else None)

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
                self._life.touch(slots, clicks)
                undo.rows(self.getter("rows"), slots)
                self._store.rows.index_add_(0, slots, deltas)

    def _update_slots(self, ids: torch.Tensor, values: torch.Tensor, clicks: torch.Tensor | None, recent: bool = True):
        """Slots, values and clicks of the ids an update changes: every id's (rows created as needed) without a
        life cycle; with one, the admitted ids' (the life cycle drops, and counts, the rest). ``recent``: ask the
        recent pulls for the slots first (False: the caller asked them already)."""
        if not self.lifecycle.active:
            # a recent pull's slots: every one names a live row, nothing to create
            taken = self._recent.take(ids) if recent else None
            return (taken if taken is not None else self._slots(ids)), values, clicks
        return self._life.update_slots(ids, values, clicks)

    def _check_clicks(self, clicks: torch.Tensor | None, n: int) -> torch.Tensor | None:
        if clicks is None:
            return None
        if not isinstance(clicks, torch.Tensor) or tuple(clicks.shape) != (n,) or not clicks.dtype.is_floating_point:
            raise ValueError(f"clicks must be a float tensor of shape ({n},), one per id")
        return clicks.to(torch.float32)
