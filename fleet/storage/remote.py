"""Any fsspec filesystem as a :class:`~fleet.storage.store.Store`: ``s3://``, ``gs://``, ``hdfs://``, ``memory://``...

fsspec is an optional dependency (``pip install 'fleet[s3]'`` installs it with s3fs); the filesystem of a scheme
is built by fsspec with its own configuration (``fsspec.config.conf``, or ``FSSPEC_<SCHEME>_<OPTION>``
environment variables, e.g. ``FSSPEC_S3_ENDPOINT_URL``), and the usual credentials of the service (for S3:
``AWS_ACCESS_KEY_ID``... or an instance role, read by botocore itself).

How the store's guarantees hold without an atomic rename:

- a write goes to a local spool first and is uploaded only once the writer finished without an error; on an
  object store (:data:`OBJECT_STORES`) an object is visible only once its upload completed (a multipart
  upload that fails is aborted), so a name holds the whole new object or what it held before. Elsewhere
  (HDFS, a mounted filesystem) the upload goes to a temporary name that is then moved over the name;
- a listing is never answered from fsspec's cache of an earlier listing (another process may have written since).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

from fleet.storage.store import INSTALL, Entry, StorageError, Store

__all__ = ["OBJECT_STORES", "FsspecStore", "fsspec_store"]

OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss", "r2"})
"""Schemes whose objects appear only once their upload completes: written in place, no temporary name."""
_SPOOL_IN_MEMORY = 32 << 20
_COPY_CHUNK = 8 << 20


def fsspec_store(scheme: str, url: str) -> FsspecStore:
    """The store of ``url`` through fsspec; :class:`StorageError` naming the URL and what to install."""
    try:
        import fsspec
    except ImportError:
        raise StorageError(
            f"{url}: fleet reads and writes {scheme}:// URLs through fsspec, which is not installed. "
            f"Install it with {INSTALL} (or fsspec and fsspec's package for {scheme}://), or use a local path."
        ) from None
    try:
        fs = fsspec.filesystem(scheme)
    except ValueError:
        raise StorageError(
            f"{url}: no store knows the scheme {scheme}:// (fsspec knows none by that name either): "
            "use a local path or a URL of a filesystem fsspec supports (s3://, gs://, hdfs://...; for s3:// "
            f"{INSTALL})."
        ) from None
    except ImportError as error:
        raise StorageError(
            f"{url}: fsspec needs another package for {scheme}:// ({error}). For s3:// install it with {INSTALL}."
        ) from None
    return FsspecStore(fs, scheme)


class FsspecStore(Store):
    """The paths of one fsspec filesystem, named by full URLs (``s3://bucket/run/latest``)."""

    def __init__(self, fs: Any, scheme: str):
        self.fs = fs
        self.scheme = scheme
        self.objects = scheme in OBJECT_STORES

    def _key(self, path: str) -> str:
        """The filesystem's own name of ``path`` (no scheme, no trailing ``/``)."""
        from fsspec.core import strip_protocol

        return strip_protocol(path).rstrip("/")

    def entry(self, path: str, follow_links: bool = False) -> Entry | None:
        self.fs.invalidate_cache(self._key(path))
        try:
            info = self.fs.info(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        kind = info.get("type")
        if kind == "file":
            return Entry("file", int(info.get("size") or 0))
        return Entry("dir" if kind == "directory" else "other")

    def list(self, path: str) -> list[str]:
        key = self._key(path)
        self.fs.invalidate_cache(key)
        try:
            found = self.fs.ls(path, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        names = (name.rstrip("/").rsplit("/", 1)[-1] for name in found if name.rstrip("/") != key)
        return [name for name in names if name]

    def walk(self, root: str) -> Iterator[tuple[str, Entry]]:
        key = self._key(root)
        self.fs.invalidate_cache(key)
        try:
            found = self.fs.find(root, withdirs=True, detail=True)
        except FileNotFoundError:
            return
        for name, info in found.items():
            name = name.rstrip("/")
            if name == key or not name.startswith(key + "/"):
                continue
            kind = info.get("type")
            entry = Entry("file", int(info.get("size") or 0)) if kind == "file" else Entry("dir")
            yield name[len(key) + 1 :], entry

    def read(self, path: str, limit: int) -> bytes:
        return self.fs.cat_file(path)[:limit]  # one request; callers ask for a file's whole size (and 1 more)

    def open_read(self, path: str) -> IO[bytes]:
        return self.fs.open(path, "rb")

    @contextmanager
    def open_write(self, path: str) -> Iterator[IO[bytes]]:
        with tempfile.SpooledTemporaryFile(max_size=_SPOOL_IN_MEMORY) as spool:
            yield spool  # type: ignore[misc]
            spool.seek(0)
            target = path if self.objects else f"{path}.tmp-upload"
            self._upload(spool, target)
            if not self.objects:
                self.fs.mv(target, path)

    def _upload(self, source: IO[bytes], target: str) -> None:
        handle = self.fs.open(target, "wb")
        try:
            shutil.copyfileobj(source, handle, _COPY_CHUNK)
        except BaseException:
            discard = getattr(handle, "discard", None)
            if discard is not None:
                discard()  # an unfinished multipart upload: aborted, nothing appears
            raise
        handle.close()

    def make_dirs(self, path: str) -> None:
        if not self.objects:  # an object store has no folders: a name's prefix is one
            self.fs.makedirs(path, exist_ok=True)

    def delete(self, path: str) -> None:
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(self._key(path))

    def checkpoint_writer(self, path: str) -> Any:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(path)

    def checkpoint_reader(self, path: str) -> Any:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(path)
