"""A save's checksums: every file's size and SHA-256, written when the save is committed and checked
before any byte of a file is used.

``<save>/checksums.json`` lists every regular file of the save (paths relative to it, ``/``
between folders) as ``{"size": bytes, "sha256": hex}``. The processes that write a part
hash it as they write it (:func:`~fleet.storage.atomic.save_atomic` returns the sum), so a
commit reads back only files whose writer did not report a sum. A file truncated, grown or
bit-flipped after it was written no longer matches, and its reader says so, naming it,
before anything is loaded from it.

Every walk over a save is bounded (:data:`MAX_FILES` files, links not followed), and a file
is read only when it is a regular file (on any store: :mod:`fleet.storage.store`) of the size recorded, so a link to ``/dev/zero`` or a
FIFO put in a save is an error, never an endless read or a hang.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from fleet.errors import FleetError
from fleet.storage.atomic import write_text_atomic
from fleet.storage.paths import join, store_for

__all__ = ["CHECKSUMS", "MAX_FILES", "LayoutError", "file_sum", "read_manifest", "read_verified", "walk"]

CHECKSUMS = "checksums.json"
MAX_FILES = 1 << 16
"""The most files one save may hold: a walk over more is an error, never a walk without end."""
_CHUNK = 1 << 22
_MAX_MANIFEST_BYTES = 64 << 20


class LayoutError(FleetError):
    """A checkpoint directory that does not hold what its pointer or manifest says."""


def _regular(path: str) -> int:
    """``path``'s size; :class:`LayoutError` unless it is a regular file (a link is not followed)."""
    entry = store_for(path).entry(path)
    if entry is None:
        raise LayoutError(f"{path} is missing")
    if entry.kind != "file":
        raise LayoutError(f"{path} is not a regular file (a link, a folder or a device): not written by fleet")
    return entry.size


def file_sum(path: str) -> dict[str, Any]:
    """The size and SHA-256 of the regular file ``path``, read in bounded chunks up to its size."""
    size = _regular(path)
    digest, left = hashlib.sha256(), size
    with store_for(path).open_read(path) as handle:
        while left > 0:
            chunk = handle.read(min(_CHUNK, left))
            if not chunk:
                break
            digest.update(chunk)
            left -= len(chunk)
    return {"size": size - left, "sha256": digest.hexdigest()}


def walk(root: str, skip: tuple[str, ...] = ()) -> list[str]:
    """Every regular file under ``root`` (relative, ``/``-separated, sorted), links not followed; names in
    ``skip`` right under ``root`` left out. More than :data:`MAX_FILES` entries is a :class:`LayoutError`."""
    found: list[str] = []
    for seen, (rel, entry) in enumerate(store_for(root).walk(root), 1):
        if seen > MAX_FILES:
            raise LayoutError(f"{root} holds more than {MAX_FILES} files and folders: not a save fleet wrote")
        if entry.kind == "file" and rel not in skip:
            found.append(rel)
    return sorted(found)


def read_manifest(save: str) -> dict[str, dict[str, Any]] | None:
    """The sums ``<save>/checksums.json`` lists; None for a save written before checksums (no such file)."""
    path = join(save, CHECKSUMS)
    try:
        size = _regular(path)
    except LayoutError:
        if not store_for(path).exists(path):
            return None
        raise
    if size > _MAX_MANIFEST_BYTES:
        raise LayoutError(f"{path} is {size} bytes, more than any list of checksums fleet writes: damaged")
    try:
        files = json.loads(store_for(path).read(path, size + 1).decode("utf-8"))["files"]
        if not isinstance(files, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str)
            for v in files.values()
        ):
            raise ValueError("entries are not {size, sha256} objects")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise LayoutError(f"{path} is damaged ({error}): the save's files cannot be checked") from None
    return files


def write_manifest(save: str, sums: dict[str, dict[str, Any]]) -> None:
    """Write ``<save>/checksums.json`` (atomically)."""
    write_text_atomic(join(save, CHECKSUMS), json.dumps({"files": dict(sorted(sums.items()))}, indent=0))


def read_verified(path: str, expected: dict[str, Any] | None) -> bytes:
    """The bytes of the regular file ``path``, checked against ``expected`` (its recorded sum; None: unchecked).

    A file of another size is refused before it is read; one whose SHA-256 differs after reading.
    """
    size = _regular(path)
    if expected is not None and size != expected["size"]:
        raise LayoutError(
            f"{path} is {size} bytes but was {expected['size']} when saved: truncated or changed since (checksums)"
        )
    data = store_for(path).read(path, size + 1)
    if len(data) != size:
        raise LayoutError(f"{path} changed size while it was read ({size} bytes, then {len(data)})")
    if expected is not None and hashlib.sha256(data).hexdigest() != expected["sha256"]:
        raise LayoutError(f"{path} does not match its checksum: its bytes changed after it was saved (damaged)")
    return data
