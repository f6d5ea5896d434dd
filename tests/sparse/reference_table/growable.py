"""fleet/sparse/growable.py at c4b15f1, kept for tests/sparse/reference_table/table.py (the differential test's reference).

The original docstring: per-row tensors that grow without copying: views over reserved address space.

Why: a sparse table doubles its row storage as rows arrive. Copying a 2 GB table into a new
4 GB one held a server's loop for 9.7 s (4 M rows of dim 64 with Adam, measured with
``benchmarks/ps_hardening.py``) and needed both copies at once -- the moment a server is most
likely to run out of memory. Instead, on Linux, each per-row tensor is a view over an anonymous
mapping that reserves far more address space than it uses (``MAP_NORESERVE``: no memory is
committed, the kernel hands out zeroed pages as rows are first written). Growing is a longer
view of the same memory, in microseconds, and a failed growth cannot happen half-way.

Where the reservation is refused (strict overcommit, an address-space limit, another OS) or
used up, growth falls back to allocating a bigger tensor and copying, as before. Reserved
mappings are asked for transparent huge pages like :func:`fleet.sparse.pages.large_empty`.
"""

from __future__ import annotations

import mmap
import sys
import weakref

import torch

from fleet.sparse.pages import large_empty

#: address space reserved per tensor: committed only as it is written, so it costs nothing until then
RESERVE_BYTES = 16 << 30
_MAP_NORESERVE = 0x4000  # Linux; Python's mmap module does not name it
#: start address of each reserved mapping -> (its size, the mapping, weakly: it lives as long as its views)
_RESERVED: dict[int, tuple[int, weakref.ref]] = {}


def _reserve(nbytes: int) -> mmap.mmap | None:
    if not sys.platform.startswith("linux"):
        return None
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
    try:
        mapping = mmap.mmap(-1, nbytes, flags=flags)
    except (OSError, ValueError, OverflowError):
        return None
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, AttributeError, ValueError):
        pass  # only a hint
    return mapping


def _view(mapping: mmap.mmap, rows: int, tail: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    per_row = 1
    for d in tail:
        per_row *= d
    return torch.frombuffer(mapping, dtype=dtype, count=rows * per_row).view(rows, *tail)


def row_tensor(rows: int, tail: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised ``[rows, *tail]`` tensor that :func:`grow` can lengthen in place."""
    row_bytes = torch.empty((), dtype=dtype).element_size()
    for d in tail:
        row_bytes *= d
    reserved = max(RESERVE_BYTES, 8 * rows * row_bytes)
    mapping = _reserve(reserved) if rows * row_bytes <= reserved else None
    if mapping is None:
        return large_empty((rows, *tail), dtype)
    t = _view(mapping, rows, tail, dtype)
    for start in [k for k, (_, ref) in _RESERVED.items() if ref() is None]:
        del _RESERVED[start]  # mappings whose views are all gone
    _RESERVED[t.untyped_storage().data_ptr()] = (reserved, weakref.ref(mapping))
    return t


def grow(t: torch.Tensor, rows: int, used: int) -> torch.Tensor:
    """``t`` with ``rows`` rows, its first ``used`` kept: a longer view when ``t`` has the room reserved, else a copy."""
    tail = tuple(t.shape[1:])
    entry = _RESERVED.get(t.untyped_storage().data_ptr())
    mapping = entry[1]() if entry is not None else None
    per_row = t.element_size()
    for d in tail:
        per_row *= d
    if mapping is not None and rows * per_row <= entry[0] and t.storage_offset() == 0:
        return _view(mapping, rows, tail, t.dtype)
    new = row_tensor(rows, tail, t.dtype)
    new[:used] = t[:used]
    return new
