"""The local filesystem as a :class:`~fleet.storage.store.Store`: what fleet always wrote, unchanged.

A file is written under ``<name>.tmp-<pid>`` and renamed over its name (:func:`os.replace`), so no reader and
no crash ever sees half of one. A full disk (or a spent quota) is said as such:
:class:`~fleet.errors.DiskFullError`, "No space left on device" with the path, and the temporary file is gone.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

from fleet.errors import DiskFullError
from fleet.storage.store import Entry, Store

__all__ = ["LocalStore", "is_disk_full"]

_FULL = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in _FULL


class LocalStore(Store):
    """Plain paths on this machine (or a filesystem every host mounts)."""

    def join(self, base: str, *names: str) -> str:
        return os.path.join(base, *names)

    def split(self, path: str) -> tuple[str, str]:
        return os.path.split(path)

    def absolute(self, path: str) -> str:
        return os.path.abspath(path)

    def inside(self, path: str, root: str) -> bool:
        real, top = os.path.realpath(path), os.path.realpath(root)
        return os.path.commonpath([real, top]) == top and real != top

    def entry(self, path: str, follow_links: bool = False) -> Entry | None:
        try:
            info = os.stat(path) if follow_links else os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        if stat.S_ISREG(info.st_mode):
            return Entry("file", info.st_size)
        return Entry("dir" if stat.S_ISDIR(info.st_mode) else "other")

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(path)  # a link to a folder counts, as it always did

    def list(self, path: str) -> list[str]:
        try:
            return os.listdir(path)
        except (FileNotFoundError, NotADirectoryError):
            return []

    def walk(self, root: str) -> Iterator[tuple[str, Entry]]:
        for top, dirs, files in os.walk(root, followlinks=False):
            rel = os.path.relpath(top, root)
            prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            for name in dirs:
                yield prefix + name, Entry("dir")
            for name in files:
                yield prefix + name, self.entry(os.path.join(top, name)) or Entry("other")

    def open_read(self, path: str) -> IO[bytes]:
        return open(path, "rb")  # noqa: SIM115 - the caller closes it

    @contextmanager
    def open_write(self, path: str) -> Iterator[IO[bytes]]:
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as handle:
                yield handle
            os.replace(tmp, path)
        except BaseException as error:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if is_disk_full(error) and not isinstance(error, DiskFullError):
                raise DiskFullError(path) from error
            raise

    def make_dirs(self, path: str) -> None:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as error:
            if is_disk_full(error):
                raise DiskFullError(str(path), "creating the directory") from error
            raise

    def delete(self, path: str) -> None:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.lexists(path):
            os.unlink(path)

    def checkpoint_writer(self, path: str) -> Any:
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(path)

    def checkpoint_reader(self, path: str) -> Any:
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(path)
