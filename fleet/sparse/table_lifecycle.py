"""A sparse table's life cycle, as the table applies it: the clock, admission, statistics, eviction.

The rules (what an entry admits, how statistics decay, the score) are :mod:`fleet.sparse.lifecycle`'s;
:class:`TableLifeCycle` is the part of :class:`fleet.sparse.table.SparseTable` that applies them to its rows:
advancing the clock and expiring rows past their TTL, admitting new ids, evicting the lowest-scoring rows
under ``max_rows``, and recording each update in the rows' statistics (natively:
:func:`fleet.sparse.native.kernels.touch_stats`). The table composes it and it works through the table's
declared face, :class:`LivingTable` (as :mod:`fleet.sparse.saves` works through ``StoredTable``): it holds
only its own state (the admission entry's, the next expiry), which the table's transactions roll back too.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from fleet.sparse.id_index import IdIndex
from fleet.sparse.lifecycle import EVICT_SLACK, Admission, LifeCycle
from fleet.sparse.native import kernels
from fleet.sparse.undo import Getter, UndoLog


class LivingTable(Protocol):
    """What the life cycle uses of a :class:`~fleet.sparse.table.SparseTable`: its clock, counters, rows and undo."""

    lifecycle: LifeCycle
    clock: int
    counts: dict[str, int]

    def __len__(self) -> int: ...

    def transaction(self) -> AbstractContextManager[UndoLog]: ...

    def undo_log(self) -> UndoLog: ...

    @property
    def index(self) -> IdIndex: ...

    @property
    def stats(self) -> dict[str, torch.Tensor]: ...

    @property
    def dirty(self) -> torch.Tensor: ...

    def getter(self, name: str) -> Getter: ...

    def advance_clock(self, step: int | None) -> None: ...

    def remove_slots(self, gone: torch.Tensor) -> int: ...

    def init_rows(self, first: int, new_ids: torch.Tensor) -> None: ...


class TableLifeCycle:
    """The life cycle of one table's rows (see the module docstring)."""

    def __init__(self, table: LivingTable, seed: int) -> None:
        self.table = table
        lc = table.lifecycle
        self.admission = Admission(lc.entry, lc.sketch_width, seed)
        self.next_expiry = 0
        """The clock at which rows past their TTL are looked for next."""

    def state_dict(self) -> dict[str, Any]:
        return {"next_expiry": self.next_expiry, "admission": self.admission.state_dict()}

    def load_state_dict(self, state: dict[str, Any], undo: UndoLog) -> None:
        self.next_expiry = int(state["next_expiry"])
        if self.admission.sketch is not None:
            undo.attrs(self.admission.sketch, "counters", "added")
        self.admission.load_state_dict(state["admission"])

    # ------------------------------------------------------------------ clock and removal
    def tick(self, step: int | None = None) -> None:
        """Advance the clock: to ``step`` when given (never back), else by one; expire rows past their TTL."""
        table = self.table
        with table.transaction():
            table.advance_clock(step)
            ttl = table.lifecycle.ttl_steps
            if ttl is not None and table.clock >= self.next_expiry:
                self.next_expiry = table.clock + max(1, ttl // 8)
                table.remove_slots(self.expired())

    def expired(self) -> torch.Tensor:
        """By slot: whether the row is past its TTL."""
        table = self.table
        n = len(table)
        ttl = table.lifecycle.ttl_steps
        if ttl is None or not n:
            return torch.zeros(n, dtype=torch.bool)
        return (table.clock - table.stats["last_seen"][:n]) > ttl

    def scores(self) -> torch.Tensor:
        """Each row's decayed show/click score (Paddle's CTR accessor score), by slot."""
        table = self.table
        n = len(table)
        stats = table.stats
        if not stats:
            return torch.zeros(n)
        age = table.clock - stats["last_seen"][:n]
        lc = table.lifecycle
        return lc.score(lc.decayed(stats["show"][:n], age), lc.decayed(stats["click"][:n], age))

    def shrink(self, threshold: float | None = None) -> int:
        """Remove rows past their TTL and, with ``threshold``, rows scoring below it; return how many went."""
        with self.table.transaction():
            gone = self.expired()
            if threshold is not None and self.table.stats:
                gone |= self.scores() < float(threshold)
            return self.table.remove_slots(gone)

    # ------------------------------------------------------------------ admission
    def _make_room(self, new_ids: torch.Tensor, protect: torch.Tensor) -> torch.Tensor:
        """Evict lowest-scoring rows (not those in ``protect``) so ``new_ids`` fit under max_rows; return those that fit."""
        table = self.table
        cap = table.lifecycle.max_rows
        n = len(table)
        if cap is None or n + new_ids.numel() <= cap:
            return new_ids
        target = min(cap - new_ids.numel(), int(cap * (1 - EVICT_SLACK)))
        score = self.scores()
        score[protect] = float("inf")
        evictable = n - int(torch.unique(protect).numel())
        count = min(max(n - target, 0), evictable)
        if count:
            gone = torch.zeros(n, dtype=torch.bool)
            gone[torch.topk(score, count, largest=False, sorted=False).indices] = True
            table.remove_slots(gone)
        room = cap - len(table)
        if room < new_ids.numel():
            table.counts["refused_rows"] += new_ids.numel() - room
            new_ids = new_ids[:room]
        return new_ids

    def _admitted_slots(self, ids: torch.Tensor) -> torch.Tensor:
        """Slots for an update's ``ids``: new ids get rows once admitted; -1 for the rest."""
        table = self.table
        slots = table.index.lookup(ids)
        missing = slots < 0
        if not bool(missing.any()):
            return slots
        new_ids = torch.unique(ids[missing])
        admitted = new_ids[self.admission.admit(new_ids, table.clock, table.undo_log())]
        if admitted.numel():
            before = len(table)
            admitted = self._make_room(admitted, protect=slots[~missing])
            evicted = len(table) != before
            table.init_rows(len(table), admitted)
            table.index.insert_new(admitted, table.undo_log())
            if evicted:  # eviction compacts, so every slot may have moved
                return table.index.lookup(ids)
            where = missing.nonzero().squeeze(1)
            slots = slots.index_copy(0, where, table.index.lookup(ids.index_select(0, where)))
        return slots

    def update_slots(self, ids: torch.Tensor, values: torch.Tensor, clicks: torch.Tensor | None):
        """Slots, values and clicks of the ids an update may change (dropping, and counting, the unadmitted)."""
        slots = self._admitted_slots(ids)
        kept = slots >= 0
        if not bool(kept.all()):
            self.table.counts["dropped_gradients"] += int((~kept).sum())
            where = kept.nonzero().squeeze(1)
            slots, values = slots.index_select(0, where), values.index_select(0, where)
            clicks = clicks.index_select(0, where) if clicks is not None else None
        return slots, values, clicks

    # ------------------------------------------------------------------ statistics
    def touch(self, slots: torch.Tensor, clicks: torch.Tensor | None, mark_dirty: bool = True) -> None:
        """Record an update of ``slots`` (duplicates allowed): dirty, last seen now, one more show, the clicks.

        ``mark_dirty`` False: the caller's kernel sets the dirty flags itself (with no undo record).
        """
        table = self.table
        undo = table.undo_log()
        if mark_dirty:
            undo.rows(table.getter("dirty"), slots)
            table.dirty.index_fill_(0, slots, True)
        stats = table.stats
        if not stats:
            return
        lc = table.lifecycle
        factors = None
        if lc.decay != 1.0:  # the decay factor in torch (its exp), the rest in one native pass
            factors = lc.decayed(torch.ones(slots.numel()), table.clock - stats["last_seen"].index_select(0, slots))
        n = slots.numel()
        seen, old_show, old_click = torch.empty(n, dtype=torch.int32), torch.empty(n), torch.empty(n)
        kernels.touch_stats(
            stats["last_seen"].numpy(),
            stats["show"].numpy(),
            stats["click"].numpy(),
            slots.contiguous().numpy(),
            factors.numpy() if factors is not None else None,
            clicks.to(torch.float32).contiguous().numpy() if clicks is not None else None,
            table.clock,
            seen.numpy(),
            old_show.numpy(),
            old_click.numpy(),
        )
        # After the kernel (it checks everything before it writes): undone in reverse, all three come back.
        undo.rows(table.getter("stats.show"), slots, old_show)
        undo.rows(table.getter("stats.click"), slots, old_click)
        undo.rows(table.getter("stats.last_seen"), slots, seen)
