"""A sparse table's life cycle, as the table applies it: the clock, admission, statistics, eviction.

The rules (what an entry admits, how statistics decay, the score) are :mod:`fleet.sparse.lifecycle`'s;
this is the part of :class:`fleet.sparse.table.SparseTable` that applies them to its rows (kept here,
as a base class of the table, so that the table's module holds its storage and requests only):
advancing the clock and expiring rows past their TTL, admitting new ids, evicting the
lowest-scoring rows under ``max_rows``, compacting the rows that stay, and recording each update
in the rows' statistics (natively: :func:`fleet.sparse.native.kernels.touch_stats`).
"""

from __future__ import annotations

import torch

from fleet.sparse.lifecycle import EVICT_SLACK
from fleet.sparse.native import kernels
from fleet.sparse.saves import MAX_REMEMBERED_DELETIONS


class TableLifeCycle:
    """The life-cycle half of :class:`~fleet.sparse.table.SparseTable` (a base class: it uses the table's
    storage, index and transactions, and the table's requests call it)."""

    # Set by SparseTable.__init__/_reset; declared here for readers and type checkers.
    clock: int
    counts: dict[str, int]

    # ------------------------------------------------------------------ life cycle
    def tick(self, step: int | None = None) -> None:
        """Advance the clock: to ``step`` when given (never back), else by one; expire rows past their TTL."""
        with self.transaction():
            self.clock = self.clock + 1 if step is None else max(self.clock, int(step))
            ttl = self.lifecycle.ttl_steps
            if ttl is not None and self.clock >= self._next_expiry:
                self._next_expiry = self.clock + max(1, ttl // 8)
                self._remove(self._expired())

    def _expired(self) -> torch.Tensor:
        n = len(self)
        ttl = self.lifecycle.ttl_steps
        if ttl is None or not n:
            return torch.zeros(n, dtype=torch.bool)
        return (self.clock - self._stats["last_seen"][:n]) > ttl

    def scores(self) -> torch.Tensor:
        """Each row's decayed show/click score (Paddle's CTR accessor score), by slot."""
        n = len(self)
        if not self._stats:
            return torch.zeros(n)
        age = self.clock - self._stats["last_seen"][:n]
        lc = self.lifecycle
        return lc.score(lc.decayed(self._stats["show"][:n], age), lc.decayed(self._stats["click"][:n], age))

    def shrink(self, threshold: float | None = None) -> int:
        """Remove rows past their TTL and, with ``threshold``, rows scoring below it; return how many went."""
        with self.transaction():
            gone = self._expired()
            if threshold is not None and self._stats:
                gone |= self.scores() < float(threshold)
            return self._remove(gone)

    def _remove(self, gone: torch.Tensor) -> int:
        """Drop the rows whose slot is set in ``gone``, compacting the rest in place (slot order kept).

        The undo keeps only the removed rows: it spreads the kept ones back to their old slots.
        """
        count = int(gone.sum())
        if not count:
            return 0
        undo = self._log()
        n = len(self)
        keep = (~gone).nonzero().squeeze(1)
        drop = gone.nonzero().squeeze(1)
        m = keep.numel()
        self._recent.forget()  # compaction moves slots
        new_slot = torch.full((n,), -1, dtype=torch.int64)
        new_slot[keep] = torch.arange(m)
        removed_ids = self._index.renumber(new_slot, undo)  # first: it reads the removed ids at their slots
        for name in self._row_names():
            get = self._getter(name)
            t = get()
            compacted, removed = t[:n].index_select(0, keep), t[:n].index_select(0, drop)
            t[:m] = compacted
            # recorded after the write, not before like the others: spreading undoes a compaction only
            undo.add(lambda get=get, removed=removed: _spread(get(), keep, drop, removed))
        self._remember_deleted(removed_ids)
        self.counts["evicted"] += count
        return count

    def _remember_deleted(self, ids: torch.Tensor) -> None:
        if self._deleted is None:
            return
        self._deleted.append(ids)
        self._deleted_count += ids.numel()
        if self._deleted_count > max(MAX_REMEMBERED_DELETIONS, 4 * len(self)):
            self._deleted = None  # unbounded memory otherwise, for a job that never saves a delta

    def _make_room(self, new_ids: torch.Tensor, protect: torch.Tensor) -> torch.Tensor:
        """Evict lowest-scoring rows (not those in ``protect``) so ``new_ids`` fit under max_rows; return those that fit."""
        cap = self.lifecycle.max_rows
        n = len(self)
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
            self._remove(gone)
        room = cap - len(self)
        if room < new_ids.numel():
            self.counts["refused_rows"] += new_ids.numel() - room
            new_ids = new_ids[:room]
        return new_ids

    def _admitted_slots(self, ids: torch.Tensor) -> torch.Tensor:
        """Slots for an update's ``ids`` under the life cycle: new ids get rows once admitted; -1 for the rest."""
        slots = self._index.lookup(ids)
        missing = slots < 0
        if not bool(missing.any()):
            return slots
        new_ids = torch.unique(ids[missing])
        admitted = new_ids[self._admission.admit(new_ids, self.clock, self._log())]
        if admitted.numel():
            before = len(self)
            admitted = self._make_room(admitted, protect=slots[~missing])
            evicted = len(self) != before
            self._init_rows(len(self), admitted)
            self._index.insert_new(admitted, self._log())
            if evicted:  # eviction compacts, so every slot may have moved
                return self._index.lookup(ids)
            where = missing.nonzero().squeeze(1)
            slots = slots.index_copy(0, where, self._index.lookup(ids.index_select(0, where)))
        return slots

    def _update_slots(self, ids: torch.Tensor, values: torch.Tensor, clicks: torch.Tensor | None):
        """Slots, values and clicks of the ids an update may change (dropping, and counting, the unadmitted)."""
        if not self.lifecycle.active:
            return self._slots(ids, self._recent.take(ids)), values, clicks
        slots = self._admitted_slots(ids)
        kept = slots >= 0
        if not bool(kept.all()):
            self.counts["dropped_gradients"] += int((~kept).sum())
            where = kept.nonzero().squeeze(1)
            slots, values = slots.index_select(0, where), values.index_select(0, where)
            clicks = clicks.index_select(0, where) if clicks is not None else None
        return slots, values, clicks

    def _touch(self, slots: torch.Tensor, clicks: torch.Tensor | None, mark_dirty: bool = True) -> None:
        """Record an update of ``slots`` (duplicates allowed): dirty, last seen now, one more show, the clicks.

        ``mark_dirty`` False: the caller's kernel sets the dirty flags itself (with no undo record).
        """
        undo = self._log()
        if mark_dirty:
            undo.rows(self._getter("dirty"), slots)
            self._dirty.index_fill_(0, slots, True)
        if not self._stats:
            return
        lc, stats = self.lifecycle, self._stats
        factors = None
        if lc.decay != 1.0:  # the decay factor in torch (its exp), the rest in one native pass
            factors = lc.decayed(torch.ones(slots.numel()), self.clock - stats["last_seen"].index_select(0, slots))
        n = slots.numel()
        seen, old_show, old_click = torch.empty(n, dtype=torch.int32), torch.empty(n), torch.empty(n)
        kernels.touch_stats(
            stats["last_seen"].numpy(),
            stats["show"].numpy(),
            stats["click"].numpy(),
            slots.contiguous().numpy(),
            factors.numpy() if factors is not None else None,
            clicks.to(torch.float32).contiguous().numpy() if clicks is not None else None,
            self.clock,
            seen.numpy(),
            old_show.numpy(),
            old_click.numpy(),
        )
        # After the kernel (it checks everything before it writes): undone in reverse, all three come back.
        undo.rows(self._getter("stats.show"), slots, old_show)
        undo.rows(self._getter("stats.click"), slots, old_click)
        undo.rows(self._getter("stats.last_seen"), slots, seen)


def _spread(t: torch.Tensor, keep: torch.Tensor, drop: torch.Tensor, removed: torch.Tensor) -> None:
    """Undo a compaction of ``t``: the kept rows (now first) back to slots ``keep``, ``removed`` to ``drop``."""
    kept = t[: keep.numel()].clone()
    t.index_copy_(0, keep, kept)
    t.index_copy_(0, drop, removed)
