"""The slots of the last few pulled id lists, so that a push of the same ids skips the id index.

Why: in async training a worker pulls a batch's unique ids (ahead, by prefetch) and, one
step later, pushes the gradients of exactly those ids in the same order. Both requests
would look every id up in the hash index, a random memory access per id that was ~30 % of a
W2 server's time. A push that names the same list as a recent pull reuses that pull's slots.

A remembered list is only valid while no slot moves: the table forgets everything when it
removes rows (eviction, shrink: they compact the slots), loads, or rolls back a failed
operation (which may take back rows a pull created). Tables with a life cycle do not use it
(their pulls create no rows, so a pull's slots are not the push's).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

# Two lists per worker in flight (the step's own and the prefetched next one) for a few workers.
_CAPACITY = 16
# Below this many ids a lookup costs less than remembering.
_MIN_IDS = 256


class RecentSlots:
    """At most ``capacity`` (ids, slots) pairs, newest last; each is taken at most once."""

    def __init__(self, capacity: int = _CAPACITY) -> None:
        self._capacity = capacity
        self._entries: OrderedDict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    @staticmethod
    def _key(ids: torch.Tensor) -> tuple[int, int, int]:
        ends = ids.numpy()  # a CPU int64 tensor (the table's checked ids): numpy's indexing is ~10x cheaper
        return ends.size, int(ends[0]), int(ends[-1])

    def remember(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """``slots[i]`` is where ``ids[i]`` lives now (every one >= 0); ``slots`` is the table's own tensor."""
        if ids.numel() < _MIN_IDS:
            return
        key = self._key(ids)
        self._entries[key] = (ids.clone(), slots)  # ids may be a view of the request's frame
        self._entries.move_to_end(key)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)

    def take(self, ids: torch.Tensor) -> torch.Tensor | None:
        """The slots remembered for exactly this list of ids, or None."""
        if ids.numel() < _MIN_IDS or not self._entries:
            return None
        key = self._key(ids)
        entry = self._entries.get(key)
        if entry is None or not torch.equal(entry[0], ids):
            return None
        del self._entries[key]
        return entry[1]

    def forget(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
