"""The admission sketch as it was before it went native: torch ops over the whole batch (the reference).

A copy of ``fleet.sparse.lifecycle``'s ``CountSketch`` and ``Admission`` as they were written in torch,
so that the differential test compares the native sketch (``fleet.sparse._native.sketch_add``) with
an independent implementation, not with itself.
"""

from __future__ import annotations

from typing import Any

import torch

from fleet.sparse.lifecycle import _MULTIPLIERS, DEFAULT_SKETCH_WIDTH, SKETCH_DEPTH, CountFilterEntry, Entry, _mix, _shr


class CountSketch:
    """Approximate counts of ids not yet admitted: a count-min sketch of uint8 counters.

    ``SKETCH_DEPTH`` rows of ``width`` counters; an id's count is the minimum of its counters,
    which never undercounts. Conservative update (raise only the counters at the minimum)
    keeps the overcount small; counters saturate at 255 and all halve once ``width / 2``
    counts went in, so ids seen long ago fade and a full sketch does not admit everything.
    Admitted ids stop being counted here.
    """

    @staticmethod
    def window(width: int) -> int:
        """Sightings between two halvings: half the width keeps the counters' load under one."""
        return width // 2

    def __init__(self, width: int = DEFAULT_SKETCH_WIDTH, seed: int = 0):
        self.width = width
        self.seed = seed
        self.counters = torch.zeros(SKETCH_DEPTH, width, dtype=torch.uint8)
        self.added = 0

    def _positions(self, ids: torch.Tensor) -> torch.Tensor:
        """``[depth, n]`` flat counter positions of each id."""
        bits = self.width.bit_length() - 1
        salt = (self.seed * _MULTIPLIERS[4]) & (
            (1 << 64) - 1
        )  # wrapped to 64 bits: any seed (was OverflowError from 2 on)
        salted = ids ^ (salt - (1 << 64) if salt >= 1 << 63 else salt)
        rows = [_shr(_mix(salted, m), 64 - bits) for m in _MULTIPLIERS[:SKETCH_DEPTH]]
        offsets = torch.arange(SKETCH_DEPTH).unsqueeze(1) * self.width
        return torch.stack(rows) + offsets

    def add(self, ids: torch.Tensor, undo: Any = None) -> torch.Tensor:
        """Count each (unique) id once more; return every id's count after this.

        ``undo``: a :class:`fleet.sparse.undo.UndoLog` to record how to take the counts back.
        """
        if ids.numel() == 0:
            return torch.zeros(0, dtype=torch.int64)
        pos = self._positions(ids)
        flat = self.counters.view(-1)
        current = flat.index_select(0, pos.view(-1)).view(SKETCH_DEPTH, -1)
        new = (current.min(0).values.to(torch.int16) + 1).clamp_(max=255).to(torch.uint8)
        result = new.to(torch.int64)
        if undo is not None:
            undo.rows(lambda: self.counters.view(-1), pos.view(-1), current.view(-1))
            undo.attrs(self, "counters", "added")  # undone first: the rows go back into the old counters
        flat.scatter_reduce_(0, pos.view(-1), new.repeat(SKETCH_DEPTH), "amax")
        self.added += ids.numel()
        if self.added >= self.window(self.width):
            self.counters = self.counters >> 1  # new counters, so that an undo can keep the old ones
            self.added //= 2
        return result

    def state_dict(self) -> dict[str, Any]:
        return {"counters": self.counters.clone(), "added": self.added}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        counters = state["counters"]
        if tuple(counters.shape) != (SKETCH_DEPTH, self.width) or counters.dtype != torch.uint8:
            raise ValueError(
                f"admission sketch of shape {tuple(counters.shape)} ({counters.dtype}); this table's is "
                f"({SKETCH_DEPTH}, {self.width}) uint8"
            )
        self.counters = counters.clone()
        self.added = int(state["added"])


class Admission:
    """Decides which new ids get a row, per the table's entry."""

    def __init__(self, entry: Entry | None, sketch_width: int, seed: int):
        self.entry = entry
        self.seed = seed
        self.sketch = CountSketch(sketch_width, seed) if isinstance(entry, CountFilterEntry) else None

    def admit(self, new_ids: torch.Tensor, clock: int, undo: Any = None) -> torch.Tensor:
        """A bool mask over unique, absent ``new_ids``: which get a row now (``undo``: see CountSketch.add)."""
        if self.entry is None:
            return torch.ones(new_ids.numel(), dtype=torch.bool)
        if self.sketch is not None:
            return self.sketch.add(new_ids, undo) >= self.entry.min_count
        draw = _mix(new_ids ^ (clock * _MULTIPLIERS[3]) ^ (self.seed * _MULTIPLIERS[4]), _MULTIPLIERS[0])
        uniform = _shr(draw, 11).to(torch.float64) / float(1 << 53)
        return uniform < self.entry.probability

    def state_dict(self) -> dict[str, Any]:
        return self.sketch.state_dict() if self.sketch is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.sketch is not None and state:
            self.sketch.load_state_dict(state)
