"""Memory for big tables: huge pages, and pages faulted in off the server's loop.

Why the second: the first write to fresh memory makes the kernel fault a page in (with
transparent huge pages, zero 2 MiB of it). Where that is slow -- measured in this project's
2-core VM, where the host backs guest memory on first touch -- the id index's bounded
growth steps (:mod:`fleet.sparse.id_index`) took 5-20 ms instead of under 1, and every other
worker's request that arrived meanwhile waited for them: while one worker pulled 4 M new
ids, the loop spent 2.2 s of 2.9 s in its slowest requests faulting pages in.
:func:`prefault` hands that to a helper thread (``madvise(MADV_POPULATE_WRITE)``, Linux 5.14
and later: the pages are made present and writable, their contents untouched), which runs
without the GIL, so the loop finds the memory ready. Elsewhere it does nothing, and the loop
faults the pages in itself, as before.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import queue
import sys
import threading
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23
_HUGE_MIN_BYTES = 8 << 20
_PAGE = 4096
#: pages are populated in pieces of this size, so that a tensor freed meanwhile is not populated for long
_CHUNK = 8 << 20


def _load_madvise() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise  # a CDLL call releases the GIL
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _load_madvise()


def _inner_pages(t: torch.Tensor) -> tuple[int, int]:
    """The page-aligned byte range that lies wholly inside ``t``'s memory: (start, length)."""
    start = t.data_ptr()
    nbytes = t.numel() * t.element_size()
    first = (start + _PAGE - 1) // _PAGE * _PAGE
    return first, max(0, (start + nbytes - first) // _PAGE * _PAGE)


def large_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty`` for big randomly accessed tables, backed by transparent huge pages where possible.

    Why: every lookup and row gather is a random access into tens of MB, and
    with 4 KiB pages most of them also miss the TLB. Asking the kernel for
    2 MiB pages (``madvise(MADV_HUGEPAGE)``, before the memory is first
    touched) made W3 pulls ~20 % faster here. It is only a hint: on other
    systems, or with THP disabled, this is plain ``torch.empty``. Callers must
    fill the tensor (it is uninitialised).
    """
    t = torch.empty(shape, dtype=dtype)
    if _madvise is not None and t.numel() * t.element_size() >= _HUGE_MIN_BYTES:
        _madvise(*_inner_pages(t), _MADV_HUGEPAGE)  # failure (e.g. THP off) just leaves normal pages
    return t


class _Prefaulter:
    """One daemon thread that populates the pages of the tensors handed to it, oldest first."""

    def __init__(self) -> None:
        self._work: queue.SimpleQueue[torch.Tensor | None] = queue.SimpleQueue()  # None: stop
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stopped = False
        self.supported = _madvise is not None

    def submit(self, t: torch.Tensor) -> None:
        if not self.supported:
            return
        with self._lock:
            if self._stopped:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="fleet-prefault", daemon=True)
                self._thread.start()
                atexit.register(self.stop)
        self._work.put(t)  # the reference keeps the memory mapped until it is populated

    def stop(self) -> None:
        """End the thread, between two chunks, and wait for it (registered to run at interpreter exit).

        Why: a daemon thread still running when the interpreter finalises is torn down wherever it
        is, and torn down inside torch's code (the tensor it lets go of) it aborted the whole process
        ("terminate called without an active exception", 2 exits in 30 of a script that had just
        created rows) -- a failed exit status for a job that had finished its work.
        """
        with self._lock:
            self._stopped = True
            thread = self._thread
        if thread is not None:
            self._work.put(None)
            thread.join(timeout=10.0)  # a chunk takes milliseconds; a stuck kernel call must not hang the exit

    def _run(self) -> None:
        while True:
            t = self._work.get()
            if t is None or self._stopped:
                return
            start, length = _inner_pages(t)
            for offset in range(0, length, _CHUNK):
                if self._stopped:
                    break
                if _madvise(start + offset, min(_CHUNK, length - offset), _MADV_POPULATE_WRITE) != 0:
                    if ctypes.get_errno() in (22, 95):  # EINVAL / EOPNOTSUPP: a kernel without it
                        self.supported = False
                        log.debug("MADV_POPULATE_WRITE is not supported here; pages fault in on first write")
                    break  # ENOMEM and the like: the first write will say so, where it happens
            del t


_PREFAULTER = _Prefaulter()


def prefault(t: torch.Tensor) -> None:
    """Have ``t``'s pages made present on a helper thread, so that the caller's first writes do not wait for them.

    ``t``'s contents are not changed. A hint: nothing happens where the kernel cannot do it.
    """
    _PREFAULTER.submit(t)
