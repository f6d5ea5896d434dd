"""The pure-torch id index that fleet used before its native engine: the reference of the differential test.

Kept verbatim (fleet/sparse/id_index.py at b2621c7, but for this paragraph) so that
tests/sparse/test_native_index.py can drive the same random operations through both and compare
the slots they give. Not used by fleet.

Why not a Python ``dict``: a parameter server looks up ~13k ids per request and
must do it at tens of millions of ids per second; a per-id Python loop tops out
near 5 M/s before any real work. This index does every lookup and insert as a
handful of whole-batch torch ops ("probe rounds"), so its cost per batch is a
few dozen kernel launches regardless of the batch size.

Layout: one ``[capacity, 2]`` int64 tensor of (id, row slot) entries, with
slot ``-1`` marking a free entry. Occupancy is carried by the slot column, so
every int64 value (negative, zero, ``2**63 - 1``) is a valid id and none is
reserved as a sentinel. Lookups gather entries through a ``complex128`` view of
the same memory: one 16-byte element per entry, so a plain 1-D
``index_select`` fetches id and slot with one cache miss (torch's 2-D row
gather is ~2x slower, two separate arrays cost two misses). The table is far
larger than the caches, so random misses are what a lookup pays for.

Collision handling is linear probing. Lookup reads one entry per query in the
first round, then a window of consecutive entries per remaining query, so the
tail costs a few rounds. (Reading a whole 4-entry cache line per query in the
first round was tried and is ~2.5x slower: with one thread, the number of
misses in flight is bounded by instructions per miss, and torch's gather
spends a few per element.) Capacity is a power of two and doubles before the load
would exceed 0.25 (see ``_MAX_LOAD``). Growth is incremental, so that no single
request pays for it (a one-shot rehash of 4 M ids took 3.5 s, all inside one request
of 32k ids): from 3/4 of the limit on, every insert initialises the next slice of the
doubled arrays; once they are ready they take the inserts, the full arrays stay beside
them, lookups that miss in the new arrays look in the old, and every insert moves the
next ``_MIGRATE_ENTRIES`` old entries (at least 16 per inserted id) across. A removed
entry becomes a tombstone (slot ``-2``, still occupied for probing, free for inserts),
which is what keeps "an empty entry before any match means absent" correct; a rehash
drops the tombstones.

Slots are handed out densely in creation order (0, 1, 2, ...) so the caller can
keep rows in a plain growable tensor indexed by slot; :meth:`IdIndex.renumber` removes
ids and renumbers the rest after the caller compacted its rows. Not thread-safe: a server
must serialise calls per table.

Changes are all-or-nothing: growth builds the new arrays aside and swaps them in only when
every id is placed, and inserts into the live arrays record what they overwrite in an
:class:`~fleet.sparse.undo.UndoLog` (the caller's, so that a table can undo an insert when a
later step of the same operation fails; an own one otherwise).
"""

from __future__ import annotations

import torch

from fleet.sparse.pages import large_empty, prefault
from fleet.sparse.undo import UndoLog

_TAIL_WINDOWS = (4, 16, 64)  # entries per query in lookup rounds after the first (last repeats)
_INSERT_WINDOW = 8
# Grow (x2) beyond this load. 0.25 rather than 0.5: at 0.5 a fifth of the lookups miss their home entry
# and need extra rounds; measured at 900k ids, 13k-id lookups take ~650 us at 0.25 vs ~840 us at 0.5, for
# 16 bytes x 4-8 entries per id of index memory.
_MAX_LOAD = 0.25
# Old entries moved per insert while growing (at least 16 per inserted id), and the move ends long before
# the new arrays fill (they take 0.25 x the old capacity of new ids; the move, 1/16 of it). The floor is
# ~1 ms of work: at 1 << 18 (~10 ms) every small request paid it, and a worker's 1,024-id request that
# came in during growth held the loop 10-20 ms instead of ~1 (a third of another worker's requests
# waited that long beside a 4 M-id pull).
_MIGRATE_ENTRIES = 1 << 15
# New entries initialised per insert while preparing the doubled arrays (at least 32 per inserted id: they
# are ready before the current arrays reach the limit, 1/16 of their capacity of ids later).
_PREPARE_ENTRIES = 1 << 15
_EMPTY = -1  # slot-column marker; never an id
_TOMBSTONE = -2  # a removed entry: probing goes on past it, inserts may reuse it

# 64-bit odd multipliers (from splitmix64), as signed int64 so torch accepts them.
_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)


def as_ids(ids: torch.Tensor) -> torch.Tensor:
    """Validate a 1-D integer id tensor and return it as contiguous int64."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"ids must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dim() != 1:
        raise ValueError(f"ids must be 1-D, got shape {tuple(ids.shape)}; flatten them first")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"ids must be an integer tensor (int64), got {ids.dtype}")
    return ids.to(torch.int64).contiguous()


class IdIndex:
    """Map arbitrary int64 ids to dense slots ``0..len-1`` assigned on insertion."""

    def __init__(self, capacity: int = 1024) -> None:
        cap = 64
        while cap < capacity:
            cap *= 2
        self._alloc(cap)
        self._size = 0
        self._tombstones = 0
        self._old: IdIndex | None = None  # while growing: the previous arrays, entries from _moved on not moved yet
        self._moved = 0
        self._next: IdIndex | None = None  # before that: the doubled arrays, initialised up to _ready
        self._ready = 0

    # ------------------------------------------------------------------ basics
    def _alloc(self, capacity: int, fill: bool = True) -> None:
        self._capacity = capacity
        self._bits = capacity.bit_length() - 1
        self._table = large_empty((capacity, 2), torch.int64)
        if fill:  # else the caller fills it (a free entry's id is never read: one contiguous fill)
            self._table.fill_(_EMPTY)
        self._keys = self._table[:, 0]  # strided views, for the (rare) insert path
        self._slots = self._table[:, 1]  # -1: entry is free
        # The same memory as one 16-byte element per entry: a 1-D index_select of these moves
        # id and slot together (one cache miss) and is much faster than a 2-D row gather.
        self._packed = self._table.view(torch.complex128).view(capacity)
        self._claim = large_empty((capacity,), torch.int32)  # scratch for insert races (pending-key indices)

    def _gather(self, pos: torch.Tensor) -> torch.Tensor:
        """Entries at ``pos`` as int64 ``[len(pos), 2]`` (id, slot); a bit-exact byte copy."""
        return torch.view_as_real(self._packed.index_select(0, pos)).view(torch.int64)

    def __len__(self) -> int:
        return self._size

    @property
    def capacity(self) -> int:
        """Number of hash entries (a power of two, at least four times ``len``)."""
        return self._capacity

    def _home(self, ids: torch.Tensor) -> torch.Tensor:
        """Home entry of each id: a multiply-xorshift-multiply hash, top bits kept.

        Taking the top bits of the product (not the low bits) keeps strided ids
        (multiples of 2**k, common for packed feature ids) spread out.
        """
        h = ids * _M1
        h = h ^ (h >> 31)
        h = h * _M2
        return (h >> (64 - self._bits)) & (self._capacity - 1)

    # ------------------------------------------------------------------ lookup
    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Slot of each id, ``-1`` where absent. Duplicates and any order are fine.

        Round 0 reads one entry per query: most resolve there (hit, or a free
        entry proves the id absent). The rest read a window of consecutive
        entries per round, so the long tail of linear probing costs a few rounds
        rather than one per entry. While growing, misses look in the old arrays too.
        """
        ids = as_ids(ids)
        out = self._lookup_here(ids)
        if self._old is not None:
            miss = (out < 0).nonzero().squeeze(1)
            if miss.numel():
                out.index_copy_(0, miss, self._old._lookup_here(ids.index_select(0, miss)))
        return out

    def _lookup_here(self, ids: torch.Tensor) -> torch.Tensor:
        """:meth:`lookup` in these arrays only."""
        n = ids.numel()
        if n == 0 or self._size == 0:
            return torch.full((n,), -1, dtype=torch.int64)
        pos = self._home(ids)
        entry = self._gather(pos)
        slot = entry[:, 1]
        hit = (entry[:, 0] == ids) & (slot >= 0)
        out = torch.where(hit, slot, -1)
        active = ((slot != _EMPTY) & ~hit).nonzero().squeeze(1)
        if active.numel():
            self._lookup_tail(ids, pos, active, out)
        return out

    def _lookup_tail(self, ids: torch.Tensor, pos: torch.Tensor, active: torch.Tensor, out: torch.Tensor) -> None:
        """Continue probing, a window of entries per round, for queries not resolved at home."""
        mask = self._capacity - 1
        q_ids = ids.index_select(0, active)
        q_pos = pos.index_select(0, active) + 1
        rnd = 0
        while active.numel():
            width = _TAIL_WINDOWS[min(rnd, len(_TAIL_WINDOWS) - 1)]
            rnd += 1
            entry = self._gather(((q_pos.unsqueeze(1) + torch.arange(width)) & mask).view(-1)).view(-1, width, 2)
            occupied = entry[:, :, 1] != _EMPTY
            match = (entry[:, :, 1] >= 0) & (entry[:, :, 0] == q_ids.unsqueeze(1))
            flat_hit = match.view(-1).nonzero().squeeze(1)
            if flat_hit.numel():
                found = entry.view(-1).index_select(0, flat_hit * 2 + 1)
                out.index_copy_(0, active.index_select(0, flat_hit // width), found)
            nxt = (~match.any(1) & occupied.all(1)).nonzero().squeeze(1)
            active = active.index_select(0, nxt)
            q_ids = q_ids.index_select(0, nxt)
            q_pos = q_pos.index_select(0, nxt) + width

    # ------------------------------------------------------------------ insert
    _ARRAYS = ("_capacity", "_bits", "_table", "_keys", "_slots", "_packed", "_claim", "_tombstones")
    _GROWTH = ("_old", "_moved", "_next", "_ready")

    def insert_new(self, ids: torch.Tensor, undo: UndoLog | None = None) -> torch.Tensor:
        """Insert ids that are unique and absent; return their new slots.

        The caller guarantees uniqueness and absence (``lookup`` + ``torch.unique``);
        this is what lets insertion skip a membership test. Slots are
        ``len .. len + n - 1`` in the order given. ``undo``: where to record how to take
        the insert back (all-or-nothing on its own without one).
        """
        ids = as_ids(ids)
        n = ids.numel()
        slots = torch.arange(self._size, self._size + n, dtype=torch.int64)
        if n == 0:
            return slots
        log = undo if undo is not None else UndoLog()
        try:
            log.attrs(self, "_size", *self._ARRAYS, *self._GROWTH)
            self._grow_a_step(n, log)
            if self._size + self._tombstones + n > _MAX_LOAD * self._capacity:
                self._grow_now(n, log)
            self._place(ids, slots, log)
            self._size += n
        except BaseException:
            if undo is None:
                log.rollback()
            raise
        return slots

    def _grow_a_step(self, n: int, undo: UndoLog) -> None:
        """The next bounded step of growth before inserting ``n`` ids.

        Phases: none; preparing (from 3/4 of the load limit on, ``_next`` initialised a slice per
        step; it takes over when the limit is reached); moving (``_old`` emptied a slice per step).
        Only the insert's own attributes change (the caller recorded them) and live entries are
        written with undo records, so a failure at any point changes nothing.
        """
        if self._old is not None:
            self._migrate(max(_MIGRATE_ENTRIES, 16 * n), undo)
            return
        needed = self._size + self._tombstones + n
        if self._next is not None and needed > 0.75 * _MAX_LOAD * self._next._capacity:
            self._next = None  # one big insert: the arrays being prepared are too small already
        if self._next is None:
            if needed <= 0.75 * _MAX_LOAD * self._capacity:
                return
            self._start_next(needed)
        self._prepare(max(_PREPARE_ENTRIES, 32 * n))
        if needed > _MAX_LOAD * self._capacity and self._ready == self._next._capacity:
            self._switch()

    def _grow_now(self, n: int, undo: UndoLog) -> None:
        """When one insert outran the steps (a huge batch): finish whatever growth is under way and switch now."""
        if self._old is not None:
            self._migrate(self._old._capacity, undo)
        needed = self._size + self._tombstones + n
        if self._next is None or needed > 0.75 * _MAX_LOAD * self._next._capacity:
            self._start_next(needed)
        self._prepare(self._next._capacity)
        self._switch()

    def _start_next(self, needed: int) -> None:
        cap = self._capacity
        # Room for tombstones and for the inserts while the old entries move: doubled at least.
        while needed > 0.5 * _MAX_LOAD * cap:
            cap *= 2
        fresh = IdIndex.__new__(IdIndex)
        fresh._alloc(cap, fill=False)  # untouched memory: initialised a slice per step
        prefault(fresh._table)  # meanwhile, its pages are faulted in off the loop (fleet.sparse.pages)
        prefault(fresh._claim)
        fresh._tombstones = 0
        self._next, self._ready = fresh, 0

    def _prepare(self, entries: int) -> None:
        ahead = self._next
        assert ahead is not None
        hi = min(ahead._capacity, self._ready + entries)
        ahead._table[self._ready : hi].fill_(_EMPTY)  # not live yet: nothing to undo
        ahead._claim[self._ready : hi].zero_()  # scratch, but touched now so its pages are not faulted in later
        self._ready = hi

    def _switch(self) -> None:
        """The prepared arrays take the inserts; the current ones become the old, emptied step by step."""
        ahead = self._next
        assert ahead is not None and self._ready == ahead._capacity
        old = IdIndex.__new__(IdIndex)
        for name in self._ARRAYS:
            setattr(old, name, getattr(self, name))
        old._size, old._old, old._next = self._size, None, None
        for name in self._ARRAYS:
            setattr(self, name, getattr(ahead, name))
        self._tombstones, self._old, self._moved, self._next, self._ready = 0, old, 0, None, 0

    def _migrate(self, entries: int, undo: UndoLog) -> None:
        """Move the live ids of the old arrays' next ``entries`` entries into the new ones (tombstones there)."""
        old = self._old
        assert old is not None
        lo, hi = self._moved, min(self._moved + entries, old._capacity)
        live = (old._slots[lo:hi] >= 0).nonzero().squeeze(1) + lo
        if live.numel():
            self._place(old._keys.index_select(0, live), old._slots.index_select(0, live), undo)
            undo.rows(lambda: old._table, live)
            old._slots.index_fill_(0, live, _TOMBSTONE)  # still occupied for the old arrays' probing
        self._moved = hi
        if hi == old._capacity:
            self._old = None

    def renumber(self, new_slot: torch.Tensor, undo: UndoLog | None = None) -> torch.Tensor:
        """Give every id at slot ``s`` the slot ``new_slot[s]``, removing those mapped to -1; return the removed ids.

        ``new_slot`` has one entry per slot (``len(self)``); the kept ids must map onto
        ``0 .. kept - 1``. One pass over the entries, no rehash (removed entries become tombstones).
        Everything is computed before the one write, so it is all-or-nothing on its own;
        ``undo`` records how to take it back.
        """
        if tuple(new_slot.shape) != (self._size,):
            raise ValueError(f"renumber needs one new slot per id ({self._size}), got shape {tuple(new_slot.shape)}")
        plans = [(arrays, *arrays._renumbered(new_slot)) for arrays in (self, self._old) if arrays is not None]
        if undo is not None:
            undo.attrs(self, "_size", "_tombstones")
        removed = []
        for arrays, pos, old, values, gone, removed_ids in plans:
            if undo is not None:
                undo.rows(lambda arrays=arrays: arrays._slots, pos, old)
            arrays._slots.index_copy_(0, pos, values)
            self._size -= gone
            self._tombstones += gone if arrays is self else 0
            removed.append(removed_ids)
        return torch.cat(removed) if len(removed) > 1 else removed[0]

    def _renumbered(self, new_slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
        """For :meth:`renumber`, in these arrays: live positions, their slots, the new slots, removed count, ids."""
        pos = (self._slots >= 0).nonzero().squeeze(1)
        old = self._slots.index_select(0, pos)
        moved = new_slot.index_select(0, old)
        removed = moved < 0
        gone = pos[removed]
        return pos, old, torch.where(removed, _TOMBSTONE, moved), gone.numel(), self._keys.index_select(0, gone)

    def _place(self, keys: torch.Tensor, vals: torch.Tensor, undo: UndoLog | None) -> None:
        """Write unique, absent keys into free entries, in vectorised claim rounds.

        Each round, every pending key picks the first free entry of its current
        window and scatters its own index into a claim array at that entry; the
        key whose index survives the scatter won the entry and writes itself;
        the others retry. Keys whose window is full move to the next window.
        Every entry between a key's home and its final entry is occupied, which
        is the invariant ``lookup`` relies on. ``undo`` (None for arrays not yet in use) records
        the entries each round overwrites.
        """
        mask = self._capacity - 1
        width = _INSERT_WINDOW
        offsets = torch.arange(width)
        pending = torch.arange(keys.numel(), dtype=torch.int64)
        pos = self._home(keys)
        while pending.numel():
            win = (pos.unsqueeze(1) + offsets) & mask
            free = self._slots.index_select(0, win.view(-1)).view(-1, width) < 0
            has_free = free.any(1)
            first = free.to(torch.int8).argmax(1)
            target = win.gather(1, first.unsqueeze(1)).squeeze(1)
            cand = has_free.nonzero().squeeze(1)
            c_target = target.index_select(0, cand)
            c_key = pending.index_select(0, cand)
            self._claim.index_put_((c_target,), c_key.to(torch.int32))
            won = self._claim.index_select(0, c_target) == c_key
            w_target, w_key = c_target[won], c_key[won]
            new_keys, new_vals = keys.index_select(0, w_key), vals.index_select(0, w_key)
            if undo is not None:
                undo.rows(lambda: self._table, w_target)
            self._keys.index_put_((w_target,), new_keys)
            self._slots.index_put_((w_target,), new_vals)
            # Losers retry the same window (now one entry fuller); full windows move on.
            placed = torch.zeros(pending.numel(), dtype=torch.bool)
            placed[cand[won]] = True
            pos = torch.where(has_free, pos, pos + width)
            keep = (~placed).nonzero().squeeze(1)
            pending = pending.index_select(0, keep)
            pos = pos.index_select(0, keep)

    # ------------------------------------------------------------------ helpers
    def get_or_insert(self, ids: torch.Tensor, undo: UndoLog | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots for ``ids``, inserting absent ones; also return the new ids.

        New ids are de-duplicated and sorted before insertion, so their slots
        follow id order within one call (deterministic, whatever the batch order).
        """
        ids = as_ids(ids)
        slots = self.lookup(ids)
        missing = slots < 0
        if not bool(missing.any()):
            return slots, ids.new_empty(0)
        where = missing.nonzero().squeeze(1)
        new_ids, inverse = torch.unique(ids.index_select(0, where), sorted=True, return_inverse=True)
        new_slots = self.insert_new(new_ids, undo)
        slots.index_copy_(0, where, new_slots.index_select(0, inverse))
        return slots, new_ids

    def ids_by_slot(self) -> torch.Tensor:
        """All ids, ordered by slot (``result[s]`` is the id stored at slot ``s``)."""
        out = torch.empty(self._size, dtype=torch.int64)
        for arrays in (self, self._old):
            if arrays is not None:
                live = arrays._slots >= 0
                out[arrays._slots[live]] = arrays._keys[live]
        return out
