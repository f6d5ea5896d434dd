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

import numpy as np
import torch

# Two lists per worker in flight (the step's own and the prefetched next one) for a few workers.
_CAPACITY = 16
# Below this many ids a lookup costs less than remembering.
_MIN_IDS = 256


class RecentSlots:
    """At most ``capacity`` (ids, slots) pairs, newest last; each is taken at most once.

    The ids are kept as their bytes: a push's list is compared with one ``memcmp`` (``torch.equal`` cost more
    than the lookup it saves on a few thousand ids, and let go of the GIL on the way).
    """

    def __init__(self, capacity: int = _CAPACITY) -> None:
        self._capacity = capacity
        self._entries: OrderedDict[tuple[int, int, int], tuple[bytes, torch.Tensor]] = OrderedDict()

    @staticmethod
    def _key(ends: np.ndarray) -> tuple[int, int, int]:
        return ends.size, int(ends[0]), int(ends[-1])

    def remember(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """``slots[i]`` is where ``ids[i]`` lives now (every one >= 0); ``slots`` is the table's own tensor.

        ``ids``: the table's checked ids (CPU int64, contiguous): numpy reads them ~10x cheaper than torch's indexing.
        """
        if ids.numel() < _MIN_IDS:
            return
        ends = ids.numpy()
        key = self._key(ends)
        self._entries[key] = (ends.tobytes(), slots)  # a copy: ids may be a view of the request's frame
        self._entries.move_to_end(key)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)

    def take(self, ids: torch.Tensor) -> torch.Tensor | None:
        """The slots remembered for exactly this list of ids (checked, contiguous), or None."""
        if ids.numel() < _MIN_IDS or not self._entries:
            return None
        ends = ids.numpy()
        key = self._key(ends)
        entry = self._entries.get(key)
        if entry is None or entry[0] != ends.tobytes():
            return None
        del self._entries[key]
        return entry[1]

    def forget(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
