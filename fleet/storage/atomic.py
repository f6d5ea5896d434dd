"""Files that are never torn: written whole through their store (:mod:`fleet.storage.store`), or not at all.

Every file fleet saves goes through :func:`write_atomic` (the one funnel: a test that counts or fails writes
patches it). On the local filesystem a file is written under a temporary name, then renamed; a full disk (or a
spent quota) is said as such: :class:`~fleet.errors.DiskFullError`, "No space left on device" with the path,
and the temporary file is gone. ``torch.save`` alone would say ``unexpected pos 1600 vs 1494``: it turns the
failed write into a RuntimeError, so the file object it writes to records the OSError underneath.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from fleet.storage.local import is_disk_full
from fleet.storage.paths import store_for

__all__ = ["Hashing", "commit_text", "is_disk_full", "make_dirs", "save_atomic", "write_atomic", "write_text_atomic"]


def write_atomic(path: str | Path, write: Callable[[IO[bytes]], None], commit: bool = False) -> None:
    """``write(file)``, then the file appears under ``path`` whole; on failure nothing of it does.

    ``commit``: ``path`` is a commit object (a ``latest`` pointer), replaced in one step (:meth:`Store.commit
    <fleet.storage.store.Store.commit>`).
    """
    path = os.fspath(path)
    store = store_for(path)
    if commit:
        buffer = io.BytesIO()
        write(buffer)
        store.commit(path, buffer.getvalue())
        return
    with store.open_write(path) as handle:
        write(handle)


def make_dirs(path: str | Path) -> None:
    """The folder ``path`` made (where the store has folders), a full disk said as such."""
    path = os.fspath(path)
    store_for(path).make_dirs(path)


def write_text_atomic(path: str | Path, text: str) -> None:
    write_atomic(path, lambda handle: handle.write(text.encode()))


def commit_text(path: str | Path, text: str) -> None:
    """Replace the commit object ``path`` (a ``latest`` pointer) with ``text`` in one step."""
    write_atomic(path, lambda handle: handle.write(text.encode()), commit=True)


class _Recording:
    """The file ``torch.save`` writes to, keeping the OSError that torch turns into a RuntimeError."""

    def __init__(self, handle: Any):
        self.handle = handle
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.handle.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        self.handle.flush()


class Hashing:
    """A file object that hashes what is written through it (sequential writes, as ``torch.save`` does)."""

    def __init__(self, handle: Any):
        self.handle = handle
        self.digest = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        written = self.handle.write(data)
        view = memoryview(data).cast("B")
        self.digest.update(view)
        self.size += view.nbytes
        return written

    def flush(self) -> None:
        self.handle.flush()

    def sum(self) -> dict[str, Any]:
        return {"size": self.size, "sha256": self.digest.hexdigest()}


def save_atomic(obj: Any, path: str | Path) -> dict[str, Any]:
    """``torch.save`` without ever leaving a torn file under ``path``; the file's size and SHA-256
    (hashed as written: :mod:`fleet.storage.checksums`)."""
    import torch

    hashing: list[Hashing] = []

    def write(handle: IO[bytes]) -> None:
        hashing[:] = [Hashing(handle)]
        target = _Recording(hashing[0])
        try:
            torch.save(obj, target)
        except RuntimeError:
            if target.error is not None:
                raise target.error from None
            raise

    write_atomic(path, write)
    return hashing[0].sum()
