"""Files written so that a reader (or a crash) never sees half of one: a temporary name, then a rename.

A full disk (or a spent quota) is said as such: :class:`~fleet.errors.DiskFullError`, "No
space left on device" with the path, and the temporary file is gone. ``torch.save`` alone
would say ``unexpected pos 1600 vs 1494``: it turns the failed write into a RuntimeError, so
the file object it writes to records the OSError underneath.
"""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fleet.errors import DiskFullError

_FULL = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in _FULL


def write_atomic(path: str | Path, write: Callable[[str], None]) -> None:
    """``write(temporary path)``, then move it over ``path``; on failure the temporary file is removed."""
    path = str(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException as error:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if is_disk_full(error) and not isinstance(error, DiskFullError):
            raise DiskFullError(path) from error
        raise


def make_dirs(path: str | Path) -> None:
    """``os.makedirs(path, exist_ok=True)``, a full disk said as such."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        if is_disk_full(error):
            raise DiskFullError(str(path), "creating the directory") from error
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    write_atomic(path, lambda tmp: Path(tmp).write_text(text))


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

    def write(tmp: str) -> None:
        with open(tmp, "wb") as handle:
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
