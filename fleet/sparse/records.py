"""A sparse table's per-row fields as one row-major record per row: id, step, row, optimizer state, statistics.

Why one array: a pull looks its ids up (reading each row's id to confirm the index's match) and then
copies the rows; a push reads and writes the row, its optimizer state and its step. With the fields
side by side those accesses share cache lines -- one or two misses per row instead of one per field
-- and there is one growable allocation per table instead of one per field, each with its own
capacity slack and page-fault front. Separate tensors cost the same bytes, but not the same misses.

Layout, in 4-byte words, fields in this order (each present only when the table keeps it):
``id`` (2 words, int64), ``step`` (2, int64: only for optimizers whose math reads it -- momentum SGD,
Adam/AdamW, Adagrad with ``lr_decay``), ``row`` (``dim`` float32), each optimizer state
(``state_width`` float32 each), the life cycle's ``last_seen`` (int32), ``show`` and ``click``
(float32); the record is padded to a whole number of 8 bytes so that the int64 fields stay aligned,
and where that leaves 4 bytes free, the row's "changed since the last save" flag takes one of them
(``dirty``; else the table keeps the flags in a tensor of their own, 1 byte per row). Dim 16: SGD 72
bytes, Adagrad 136, row-wise Adagrad 80 (flag inside), Adam 208; a life cycle adds 12, 16 with the
padding that then holds the flag. The fields are strided torch views of the one array (``rows``, ``state[name]``, ``ids``,
``steps``, ``stats[name]``), so whole-batch torch ops (``index_select``, ``index_copy_``, slicing)
work on them as on separate tensors, and the native kernels take them with their row stride.

The array is a :func:`fleet.sparse.growable.row_tensor`: growing is a longer view of reserved address
space (a copy only where no address space could be reserved), and memory is committed only as rows
are first written.
"""

from __future__ import annotations

import torch

from fleet.sparse.growable import row_tensor

#: the life cycle's per-row statistics and their dtypes (4 bytes each: ages fit in int32 steps)
STAT_DTYPES = {"last_seen": torch.int32, "show": torch.float32, "click": torch.float32}


class RowRecords:
    """Row-major per-row records of one table, and strided views of each field (rebuilt when the array grows)."""

    def __init__(
        self,
        capacity: int,
        dim: int,
        state_width: int,
        state_names: tuple[str, ...],
        steps: bool,
        stats: bool,
        data: torch.Tensor | None = None,
    ) -> None:
        self.dim, self.state_width, self.state_names = dim, state_width, tuple(state_names)
        self.has_steps, self.has_stats = steps, stats
        words = 2  # the id
        self._step_word = words if steps else -1
        words += 2 if steps else 0
        self._row_word = words
        words += dim
        self._state_words = {}
        for name in self.state_names:
            self._state_words[name] = words
            words += state_width
        self._stat_words = {}
        if stats:
            for name in STAT_DTYPES:
                self._stat_words[name] = words
                words += 1
        self._dirty_byte = 4 * words if words % 2 else -1  # the first byte of the padding word, if any
        self.words = words + (words % 2)
        self.data = data if data is not None else row_tensor(capacity, (self.words // 2,), torch.int64)
        self._views()

    @property
    def record_bytes(self) -> int:
        """Bytes per record (what one row costs here, padding included)."""
        return 4 * self.words

    @property
    def capacity(self) -> int:
        return self.data.shape[0]

    def _views(self) -> None:
        data = self.data
        f32, i32 = data.view(torch.float32), data.view(torch.int32)
        self.ids = data[:, 0]
        self.steps = data[:, self._step_word // 2] if self.has_steps else None
        self.rows = f32[:, self._row_word : self._row_word + self.dim]
        self.state = {n: f32[:, w : w + self.state_width] for n, w in self._state_words.items()}
        self.dirty = data.view(torch.bool)[:, self._dirty_byte] if self._dirty_byte >= 0 else None
        self.stats = {n: (i32 if STAT_DTYPES[n] == torch.int32 else f32)[:, w] for n, w in self._stat_words.items()}

    def over(self, data: torch.Tensor) -> RowRecords:
        """Records of this layout over ``data`` (this array grown by :func:`fleet.sparse.growable.grow`)."""
        if data.dtype != torch.int64 or tuple(data.shape[1:]) != (self.words // 2,):
            raise ValueError(f"records of {self.words // 2} int64 words, got {data.dtype} {tuple(data.shape)}")
        return RowRecords(
            data.shape[0], self.dim, self.state_width, self.state_names, self.has_steps, self.has_stats, data=data
        )
