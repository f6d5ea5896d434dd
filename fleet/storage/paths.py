"""Which store holds a path (:mod:`fleet.storage.store`), and the names of paths on any store.

A local path (no ``scheme://``) belongs to :class:`~fleet.storage.local.LocalStore`; a URL to the store
:func:`register`-ed for its scheme, else to fsspec's filesystem for it (:func:`~fleet.storage.remote.fsspec_store`).
A URL none of them can write raises :class:`~fleet.storage.store.StorageError` naming it and the install
command: it is never taken for a local folder named ``s3:``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

from fleet.storage.local import LocalStore
from fleet.storage.remote import fsspec_store
from fleet.storage.store import StorageError, Store

__all__ = ["absolute", "basename", "is_url", "join", "register", "scheme_of", "split", "store_for"]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
_COLLAPSED = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*):/(?!/)")
"""A URL whose ``//`` was lost (``pathlib.Path("s3://b/run")`` is ``s3:/b/run``): never a local folder ``s3:``."""
_LOCAL = LocalStore()
_STORES: dict[str, Callable[[str], Store]] = {}


def register(scheme: str, make: Callable[[str], Store]) -> None:
    """Serve URLs ``<scheme>://...`` with ``make(scheme)`` (before fsspec is asked): how a third store plugs in."""
    _STORES[scheme.lower()] = make


def scheme_of(path: str) -> str | None:
    """The scheme of a URL (``s3`` of ``s3://b/k``); None for a local path."""
    match = _SCHEME.match(path)
    return match.group(1).lower() if match else None


def is_url(path: str | os.PathLike[str]) -> bool:
    return isinstance(path, str) and scheme_of(path) is not None


def store_for(path: str | os.PathLike[str]) -> Store:
    """The store that holds ``path``; :class:`StorageError` for a URL that none can write."""
    if isinstance(path, os.PathLike) or (scheme := scheme_of(path)) is None:
        text = os.fspath(path)
        if isinstance(text, str) and (collapsed := _COLLAPSED.match(text)) and len(collapsed.group(1)) > 1:
            raise StorageError(
                f"{text} looks like a {collapsed.group(1)}:// URL whose '//' was lost (pathlib.Path collapses it): "
                "pass the URL as a str, not a pathlib.Path"
            )
        return _LOCAL
    if scheme in _STORES:
        return _STORES[scheme](scheme)
    return fsspec_store(scheme, path)


def join(base: str, *names: str) -> str:
    return store_for(base).join(base, *names)


def split(path: str) -> tuple[str, str]:
    return store_for(path).split(path)


def basename(path: str) -> str:
    return split(path)[1]


def absolute(path: str | os.PathLike[str]) -> str:
    """``path`` as every process names it: a local path made absolute, a URL as it is (checked: writable)."""
    path = os.fspath(path)
    return store_for(path).absolute(path)
