"""Open-addressing hash index from int64 ids to dense row slots, probed by native code.

Why native: a parameter server looks up ~13k ids per request at tens of millions of ids per
second. A per-id Python loop tops out near 5 M/s; the previous index did every lookup as a few
dozen whole-batch torch ops ("probe rounds", kept as the reference in
``tests/sparse/reference_id_index.py``). The probe loops now run in C++
(:mod:`fleet.sparse.native`, GIL released) with the entries of the next lookups prefetched, so a
lookup costs about one cache miss and the misses of several lookups overlap.

Layout: one int32 tensor of ``capacity`` entries, each ``-1`` (free), ``-2`` (removed) or
``(slot << tag_bits) | tag`` with ``tag_bits = 31 - log2(capacity)`` (a slot is always below the
capacity, so it fits) and the tag the id's hash bits just below its home bits. The id itself is not in
the entry: it lives in a key column indexed by slot -- the table's own records
(:mod:`fleet.sparse.records`: the id next to its row, so confirming a match reads the cache line the
row gather reads next), or a column the index keeps when used on its own. A probe compares tags
first, so it reads the id of only the entry that (almost surely) matches. Every int64 value is a
valid id, none is reserved as a sentinel. 4 bytes per entry at a load of 3/8 to 3/4: 5.3 to 10.7
bytes of index per id (the entries held (id, slot) pairs of 16 bytes at a load of 1/8 to 1/4 before,
64 to 128 bytes per id: a fifth to a half of a dim-16 SGD table's memory).

Collision handling is linear probing from a multiply-xorshift-multiply hash's top bits.
Capacity is a power of two and doubles before the load would exceed 3/4 (see ``_MAX_LOAD``).
Growth is incremental, so that no single request pays for it
(a one-shot rehash of 4 M ids took 3.5 s with the torch index, all inside one request of 32k ids):
from 3/4 of the limit on, every insert initialises the next slice of the doubled arrays;
once they are ready they take the inserts, the full arrays stay beside them, lookups that miss
in the new arrays look in the old, and every insert moves the next ``_MIGRATE_ENTRIES`` old
entries (at least 16 per inserted id) across. A removed entry becomes a tombstone (-2,
still occupied for probing, free for inserts), which is what keeps "an empty entry before any
match means absent" correct; a rehash drops the tombstones.

Slots are handed out densely in creation order (0, 1, 2, ...) so the caller can
keep rows in a plain growable tensor indexed by slot; :meth:`IdIndex.renumber` removes
ids and renumbers the rest before the caller compacts its rows (and its key column). Not thread-safe: a server
must serialise calls per table.

Changes are all-or-nothing: growth builds the new arrays aside and swaps them in only when
every id is placed, and inserts into the live arrays record what they overwrite in an
:class:`~fleet.sparse.undo.UndoLog` (the caller's, so that a table can undo an insert when a
later step of the same operation fails; an own one otherwise).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fleet.sparse.growable import grow, row_tensor
from fleet.sparse.native import kernels
from fleet.sparse.pages import large_empty, prefault
from fleet.sparse.undo import UndoLog

# Grow (x2) beyond this load. The torch index needed 0.25 (at 0.5 a fifth of its lookups took extra probe
# rounds); the native probe reads the next entries in the same cache line and tells other ids apart by their
# tags, so a lookup at 3/4 still reads one entry line and one key (the matching row's record) -- and the
# index costs 5.3-10.7 bytes per id instead of 64-128.
_MAX_LOAD = 0.75
# Old entries moved per insert while growing (at least 16 per inserted id), and the move ends long before
# the new arrays fill (they take 0.25 x the old capacity of new ids; the move, 1/16 of it). The floor is
# ~1 ms of work: at 1 << 18 (~10 ms) every small request paid it, and a worker's 1,024-id request that
# came in during growth held the loop 10-20 ms instead of ~1 (a third of another worker's requests
# waited that long beside a 4 M-id pull).
_MIGRATE_ENTRIES = 1 << 15
# New entries initialised per insert while preparing the doubled arrays (at least 32 per inserted id: they
# are ready before the current arrays reach the limit, 1/16 of their capacity of ids later).
_PREPARE_ENTRIES = 1 << 15
_EMPTY = -1  # a free entry
_TOMBSTONE = -2  # a removed entry: probing goes on past it, inserts may reuse it
_MAX_CAPACITY = 1 << 31  # int32 entries: (slot << tag_bits) | tag stays below 2**31

# 64-bit odd multipliers (from splitmix64), as signed int64 so torch accepts them.
_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)


def as_ids(ids: torch.Tensor) -> torch.Tensor:
    """Validate a 1-D integer id tensor and return it as contiguous int64."""
    # Every table operation checks its ids here, often more than once: the common case (CPU int64, 1-D,
    # contiguous) is answered with the fewest calls into torch.
    if type(ids) is torch.Tensor and ids.dtype is torch.int64 and ids.dim() == 1 and ids.is_contiguous() and ids.is_cpu:
        return ids
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"ids must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dim() != 1:
        raise ValueError(f"ids must be 1-D, got shape {tuple(ids.shape)}; flatten them first")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"ids must be an integer tensor (int64), got {ids.dtype}")
    if ids.device.type != "cpu":
        raise ValueError(f"ids must be on the CPU, got a tensor on {ids.device}")
    return ids.to(torch.int64).contiguous()


class IdIndex:
    """Map arbitrary int64 ids to dense slots ``0..len-1`` assigned on insertion.

    ``keys``: where the id of each slot lives, as a getter of an int64 column with room for every slot
    that an insert hands out (a table's record ids: the table grows it before it inserts, compacts it
    after :meth:`renumber`, and the index writes each new id at its slot). Without one, the index
    keeps its own column.
    """

    def __init__(self, capacity: int = 1024, keys: Callable[[], torch.Tensor] | None = None) -> None:
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
        self._own_keys = row_tensor(64, (), torch.int64) if keys is None else None
        self._keys = keys if keys is not None else self._own_key_column

    # ------------------------------------------------------------------ basics
    def _alloc(self, capacity: int, fill: bool = True) -> None:
        if capacity > _MAX_CAPACITY:
            raise ValueError(f"id index: {capacity:,} entries needed, at most {_MAX_CAPACITY:,} (2**31) are possible")
        self._capacity = capacity
        self._bits = capacity.bit_length() - 1
        self._tag_bits = 31 - self._bits
        self._table = large_empty((capacity,), torch.int32)
        if fill:  # else the caller fills it
            self._table.fill_(_EMPTY)

    def _own_key_column(self) -> torch.Tensor:
        assert self._own_keys is not None
        return self._own_keys

    def __len__(self) -> int:
        return self._size

    @property
    def capacity(self) -> int:
        """Number of hash entries (a power of two; ``len`` is at most 3/4 of it)."""
        return self._capacity

    def _home(self, ids: torch.Tensor) -> torch.Tensor:
        """Home entry of each id: a multiply-xorshift-multiply hash, top bits kept (as the native probe does).

        Taking the top bits of the product (not the low bits) keeps strided ids
        (multiples of 2**k, common for packed feature ids) spread out.
        """
        h = ids * _M1
        h = h ^ (h >> 31)
        h = h * _M2
        return (h >> (64 - self._bits)) & (self._capacity - 1)

    def _key_buffer(self) -> object:
        """The live part of the key column (an entry naming a slot past it is never followed)."""
        keys = self._keys()
        if keys.dtype != torch.int64 or keys.dim() != 1 or keys.shape[0] < self._size:
            raise ValueError(
                f"the id index's key column must be 1-D int64 of {self._size}+ ids, got {keys.dtype} "
                f"{tuple(keys.shape)}"
            )
        return (keys if not keys.requires_grad else keys.detach())[: self._size].numpy()

    # ------------------------------------------------------------------ lookup
    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Slot of each id, ``-1`` where absent. Duplicates and any order are fine.

        One native pass (GIL released); while growing, misses look in the old arrays too.
        """
        ids = as_ids(ids)
        out = torch.empty(ids.numel(), dtype=torch.int64)
        if ids.numel():
            old = self._old._table.numpy() if self._old is not None else None
            kernels.lookup(self._table.numpy(), self._key_buffer(), ids.numpy(), out.numpy(), old)
        return out

    def lookup_rows(self, ids: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(:meth:`lookup`'s slots, ``rows[slot]`` of each id found), in one native pass.

        ``rows``: float32 ``[len(self), dim]``, each row's elements adjacent -- the row field of the records
        that hold the key column, so each row is copied while its record, read to confirm the id, is in
        cache. The rows of absent ids are left uninitialised.
        """
        slots, found, _, _ = self.lookup_rows_misses(ids, rows)
        return slots, found

    def lookup_rows_misses(
        self, ids: torch.Tensor, rows: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
        """:meth:`lookup_rows`, and the positions of the absent ids (ascending) with whether those ids ascend.

        The same native pass finds the absent ids (``(slots < 0).nonzero()`` took torch two passes and as
        long as the lookup of a few thousand ids); ascending absent ids are unique, so a table creates
        their rows in this order without sorting them. ``out``: where the rows go (float32 ``[len(ids), dim]``,
        contiguous; the native pass checks it), instead of a new tensor.
        """
        if rows.dtype is not torch.float32 or rows.dim() != 2 or rows.shape[0] != self._size or not rows.is_cpu:
            raise ValueError(
                f"lookup_rows needs float32 rows [{self._size}, dim] on the CPU, got {rows.dtype} "
                f"{tuple(rows.shape)} on {rows.device}"
            )
        return self._lookup(as_ids(ids), rows, out)

    def lookup_misses(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(:meth:`lookup`'s slots, the positions of the absent ids, whether the absent ids ascend strictly)."""
        slots, _, misses, ascending = self._lookup(as_ids(ids), None)
        return slots, misses, ascending

    def _lookup(
        self, ids: torch.Tensor, rows: torch.Tensor | None, found: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, bool]:
        count = ids.numel()
        out = torch.empty(count, dtype=torch.int64)
        if found is None and rows is not None:
            found = torch.empty(count, rows.shape[1], dtype=torch.float32)
        if not count:
            return out, found, out, True
        misses = torch.empty(count, dtype=torch.int64)
        old = self._old._table.numpy() if self._old is not None else None
        missing, ascending = kernels.lookup(
            self._table.numpy(),
            self._key_buffer(),
            ids.numpy(),
            out.numpy(),
            old,
            (rows if not rows.requires_grad else rows.detach()).numpy() if rows is not None else None,
            found.numpy() if found is not None else None,
            misses.numpy(),
        )
        return out, found, misses[:missing], ascending

    # ------------------------------------------------------------------ insert
    _ARRAYS = ("_capacity", "_bits", "_tag_bits", "_table", "_tombstones")
    _GROWTH = ("_old", "_moved", "_next", "_ready")

    def insert_new(self, ids: torch.Tensor, undo: UndoLog | None = None) -> torch.Tensor:
        """Insert ids that are unique and absent; return their new slots.

        The caller guarantees uniqueness and absence (``lookup`` + ``torch.unique``);
        this is what lets insertion skip a membership test. Slots are
        ``len .. len + n - 1`` in the order given; each id is written at its slot of the key
        column (past the live length: nothing to undo). ``undo``: where to record how to take
        the insert back (all-or-nothing on its own without one).
        """
        ids = as_ids(ids)
        n = ids.numel()
        slots = torch.arange(self._size, self._size + n, dtype=torch.int64)
        if n == 0:
            return slots
        log = undo if undo is not None else UndoLog()
        try:
            log.attrs(self, "_size", "_own_keys", *self._ARRAYS, *self._GROWTH)
            if self._own_keys is not None and self._size + n > self._own_keys.shape[0]:
                cap = self._own_keys.shape[0]
                while cap < self._size + n:
                    cap *= 2
                self._own_keys = grow(self._own_keys, cap, self._size)
            keys = self._keys()
            if keys.shape[0] < self._size + n:
                raise ValueError(f"id index: the key column has room for {keys.shape[0]} ids, {self._size + n} needed")
            keys.narrow(0, self._size, n).copy_(ids)  # not item assignment: several times cheaper
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
        fresh._tombstones = 0
        self._next, self._ready = fresh, 0

    def _prepare(self, entries: int) -> None:
        ahead = self._next
        assert ahead is not None
        hi = min(ahead._capacity, self._ready + entries)
        ahead._table[self._ready : hi].fill_(_EMPTY)  # not live yet: nothing to undo
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
        live = (old._table[lo:hi] >= 0).nonzero().squeeze(1) + lo
        if live.numel():
            slots = (old._table.index_select(0, live) >> old._tag_bits).to(torch.int64)
            self._place(self._keys().index_select(0, slots), slots, undo)
            undo.rows(lambda: old._table, live)
            old._table.index_fill_(0, live, _TOMBSTONE)  # still occupied for the old arrays' probing
        self._moved = hi
        if hi == old._capacity:
            self._old = None

    def renumber(self, new_slot: torch.Tensor, undo: UndoLog | None = None) -> torch.Tensor:
        """Give every id at slot ``s`` the slot ``new_slot[s]``, removing those mapped to -1; return the removed ids.

        ``new_slot`` has one entry per slot (``len(self)``); the kept ids must map onto
        ``0 .. kept - 1``. One pass over the entries, no rehash (removed entries become tombstones).
        A key column of the caller's must still hold the ids at their old slots (the removed ids
        are read there); the caller moves them afterwards. The index's own column it moves itself.
        Everything is computed before the first write, so it is all-or-nothing on its own;
        ``undo`` records how to take it back.
        """
        if tuple(new_slot.shape) != (self._size,):
            raise ValueError(f"renumber needs one new slot per id ({self._size}), got shape {tuple(new_slot.shape)}")
        keys = self._keys()
        plans = [(arrays, *arrays._renumbered(new_slot, keys)) for arrays in (self, self._old) if arrays is not None]
        own = self._own_keys
        if own is not None:
            src = (new_slot >= 0).nonzero().squeeze(1)
            moved_keys = own.index_select(0, src)
        if undo is not None:
            undo.attrs(self, "_size", "_tombstones")
            if own is not None:
                undo.span(self._own_key_column, 0, self._size)
        removed = []
        for arrays, pos, old, values, gone, removed_ids in plans:
            if undo is not None:
                undo.rows(lambda arrays=arrays: arrays._table, pos, old)
            arrays._table.index_copy_(0, pos, values)
            self._size -= gone
            self._tombstones += gone if arrays is self else 0
            removed.append(removed_ids)
        if own is not None:
            own.index_copy_(0, new_slot.index_select(0, src), moved_keys)
        return torch.cat(removed) if len(removed) > 1 else removed[0]

    def _renumbered(
        self, new_slot: torch.Tensor, keys: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
        """For :meth:`renumber`, in these arrays: live positions, their entries, the new entries, removed count, ids."""
        pos = (self._table >= 0).nonzero().squeeze(1)
        old = self._table.index_select(0, pos)
        slot = (old >> self._tag_bits).to(torch.int64)
        moved = new_slot.index_select(0, slot)
        removed = moved < 0
        tags = old & ((1 << self._tag_bits) - 1)
        values = torch.where(removed, _TOMBSTONE, (moved.clamp(min=0).to(torch.int32) << self._tag_bits) | tags)
        gone = slot[removed]
        return pos, old, values.to(torch.int32), gone.numel(), keys.index_select(0, gone)

    def _place(self, keys: torch.Tensor, vals: torch.Tensor, undo: UndoLog | None) -> None:
        """Enter unique, absent keys into free entries (native: each from its home to the first free entry).

        Every entry between a key's home and its final entry is occupied, which is the invariant
        ``lookup`` relies on. ``undo`` (None for arrays not yet in use) records the entries
        written and what they held. The kernel is all-or-nothing on its own: when no free entry is
        left it takes its writes back and raises.
        """
        n = keys.numel()
        pos = torch.empty(n, dtype=torch.int64)
        old = torch.empty(n, dtype=torch.int32)
        keys, vals = keys.contiguous(), vals.contiguous()
        kernels.place(self._table.numpy(), keys.numpy(), vals.numpy(), pos.numpy(), old.numpy())
        if undo is not None:
            # recorded after the write: the kernel hands the old entries back (nothing ran in between)
            undo.rows(lambda: self._table, pos, old)

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
        return self._keys()[: self._size].clone()
