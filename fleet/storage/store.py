"""Where fleet's files live: the :class:`Store` protocol, through which every save, load and export of fleet
(and every data-file list) reaches storage (:func:`fleet.storage.paths.store_for` picks the store of a path).

Paths stay strings everywhere: a local path (``ckpt/run``, ``/data/run``) or a URL (``s3://bucket/run``,
``gs://...``, ``hdfs://...``: any scheme `fsspec <https://filesystem-spec.readthedocs.io>`_ knows). A local
path goes to :class:`~fleet.storage.local.LocalStore` (the local filesystem, as fleet always wrote it); a URL to
the store registered for its scheme (:func:`fleet.storage.paths.register`), else to
:class:`~fleet.storage.remote.FsspecStore` when fsspec is installed (``pip install 'fleet[s3]'``). A URL no store
can write is an error naming it and the install command, never a local folder named ``s3:``.

What every store guarantees, and what the save layout (:mod:`fleet.storage.layout`) builds on:

- :meth:`Store.open_write`: the object appears under its name whole, or not at all. A writer that fails (or a
  process killed while writing) leaves the object as it was (absent, or the old one), never part of the new one.
  Locally: a temporary name, renamed; on an object store: one upload, visible only once it is complete.
- :meth:`Store.commit`: a small commit object (a save directory's ``latest``) replaced in one step: a reader sees
  the old text or the new one, never a mix and never an empty object.
- :meth:`Store.read` returns the bytes as they are stored; :meth:`Store.entry` says what a name is (a regular
  file and its size, a folder, something else) without following links.
- :meth:`Store.list` and :meth:`Store.walk` list what is there now (no cached listing of an earlier moment).
- :meth:`Store.delete` removes a file or a whole folder; a name already gone is not an error.

On top of these the layout keeps its promise on any store, with or without an atomic rename: a save's parts
are written first, then ``checksums.json`` (every part's size and SHA-256), then ``latest`` is committed. A
save counts only once ``latest`` names it, so a reader never sees half a save (one killed half-way leaves
parts that no pointer names), and every part is checked against its checksum before a byte of it is used:
damage is an error naming the object.

A third store (say, a company's blob service) is one subclass of :class:`Store` and one
:func:`~fleet.storage.paths.register` call.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import IO, Any, NamedTuple

from fleet.errors import FleetError

__all__ = ["INSTALL", "Entry", "StorageError", "Store"]

INSTALL = "pip install 'fleet[s3]'"
"""How to get fsspec and s3fs (the optional extra); other schemes need fsspec's package for them."""


class StorageError(FleetError):
    """A path fleet cannot read or write: a URL of a scheme no store handles, or a store that is not installed."""


class Entry(NamedTuple):
    """What a name in a store is: ``kind`` is ``"file"`` (a regular file, ``size`` bytes), ``"dir"`` or ``"other"``
    (a link, a device, a FIFO: never written by fleet)."""

    kind: str
    size: int = 0


class Store:
    """One kind of storage. Every method takes whole paths (a local path, or a URL of this store's scheme).

    The guarantees each method must give are in this module's docstring; :class:`LocalStore
    <fleet.storage.local.LocalStore>` and :class:`FsspecStore <fleet.storage.remote.FsspecStore>` are the two
    implementations.
    """

    # --- names (pure string work: URLs are joined with "/") ----------------------------------------

    def join(self, base: str, *names: str) -> str:
        return posixpath.join(base, *names)

    def split(self, path: str) -> tuple[str, str]:
        """(the folder holding ``path``, its last name)."""
        scheme, rest = path.split("://", 1)
        head, tail = posixpath.split(rest.rstrip("/"))
        return f"{scheme}://{head}", tail

    def absolute(self, path: str) -> str:
        """``path`` as every process names it (a URL is absolute already)."""
        return path.rstrip("/") if "://" in path else path

    def inside(self, path: str, root: str) -> bool:
        """Whether ``path``, links resolved, lies inside ``root`` (stores without links: by its name)."""
        root = root.rstrip("/") + "/"
        return path.startswith(root) and path != root

    # --- what is there ---------------------------------------------------------------------------

    def entry(self, path: str, follow_links: bool = False) -> Entry | None:
        """What ``path`` is (links followed only with ``follow_links``), or None when nothing is there."""
        raise NotImplementedError

    def exists(self, path: str) -> bool:
        return self.entry(path) is not None

    def is_dir(self, path: str) -> bool:
        entry = self.entry(path)
        return entry is not None and entry.kind == "dir"

    def is_file(self, path: str) -> bool:
        entry = self.entry(path)
        return entry is not None and entry.kind == "file"

    def list(self, path: str) -> list[str]:
        """The names right inside the folder ``path`` (files and folders, unsorted); [] when it is not there."""
        raise NotImplementedError

    def walk(self, root: str) -> Iterator[tuple[str, Entry]]:
        """Every name under ``root`` (relative, ``/``-separated) and what it is, links not followed."""
        raise NotImplementedError

    # --- reading and writing ---------------------------------------------------------------------

    def read(self, path: str, limit: int) -> bytes:
        """Up to ``limit`` bytes of the file ``path``, from its start."""
        with self.open_read(path) as handle:
            return handle.read(limit)

    def open_read(self, path: str) -> IO[bytes]:
        raise NotImplementedError

    def open_write(self, path: str) -> AbstractContextManager[IO[bytes]]:
        """A file to write ``path`` through; the object appears whole when the block ends without an error,
        and not at all when it raises (or the process dies)."""
        raise NotImplementedError

    def commit(self, path: str, data: bytes) -> None:
        """Replace the small commit object ``path`` with ``data`` in one step (a reader sees old or new).

        The default is :meth:`open_write`, which gives this already on a store whose writes are whole.
        """
        with self.open_write(path) as handle:
            handle.write(data)

    def make_dirs(self, path: str) -> None:
        """Make the folder ``path`` (and those above it) where the store has folders."""
        raise NotImplementedError

    def delete(self, path: str) -> None:
        """Remove the file or the whole folder ``path``; nothing there is not an error."""
        raise NotImplementedError

    # --- torch.distributed.checkpoint ------------------------------------------------------------

    def checkpoint_writer(self, path: str) -> Any:
        """A ``torch.distributed.checkpoint`` storage writer into the folder ``path``."""
        raise NotImplementedError

    def checkpoint_reader(self, path: str) -> Any:
        raise NotImplementedError
