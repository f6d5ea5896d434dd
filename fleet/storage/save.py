"""One save directory: :class:`Save` to read it (every file checked against its checksums), :class:`SaveWriter`
to write it (``prepare`` -> ``write`` parts -> ``commit`` or ``abort``). Part of :mod:`fleet.storage.layout`,
which names and finds saves; strategies receive these objects and never name a save's files themselves.
"""

from __future__ import annotations

import io
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from fleet.storage import checksums
from fleet.storage.atomic import make_dirs, save_atomic, write_text_atomic
from fleet.storage.checksums import CHECKSUMS, LayoutError
from fleet.storage.paths import store_for
from fleet.storage.store import Store

__all__ = ["Save", "SaveKind", "SaveWriter"]


class _Layout(Protocol):
    """What a :class:`SaveWriter` uses of its :class:`~fleet.storage.layout.Layout`."""

    dirname: str
    kind: SaveKind

    def path(self, number: int) -> str: ...

    def commit(self, name: str) -> None: ...


@dataclass(frozen=True)
class SaveKind:
    """How the saves of one kind are named (``<prefix>-<number zero-padded to digits>``) and kept."""

    prefix: str
    digits: int
    keep: int = 2
    """Complete saves kept after a commit (besides the parents the newest one builds on)."""
    manifest: str | None = None
    """The file in each save naming its parent (None: saves of this kind have no parents)."""
    pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "pattern", re.compile(rf"^{re.escape(self.prefix)}-(\d+)$"))

    def name(self, number: int) -> str:
        """The directory name of save ``number`` (``step-000000012``)."""
        if number < 0:
            raise ValueError(f"a {self.prefix} number is not negative (got {number})")
        return f"{self.prefix}-{int(number):0{self.digits}d}"

    def number(self, name: str) -> int | None:
        """The number of a save's directory name; None when ``name`` is not a save of this kind."""
        match = self.pattern.match(name)
        return int(match.group(1)) if match else None


class Save:
    """One save directory, to read: its parts are named inside it."""

    def __init__(self, path: str, kind: SaveKind):
        self.path = path
        self.kind = kind
        self.store: Store = store_for(path)
        self._sums: dict[str, dict[str, Any]] | None | bool = False  # False: checksums.json not read yet

    @property
    def name(self) -> str:
        return self.store.split(self.path)[1]

    @property
    def number(self) -> int | None:
        return self.kind.number(self.name)

    def part(self, name: str) -> str:
        """The path of part ``name`` (a file or directory name right inside the save)."""
        if not name or name in (".", "..") or os.sep in name or (os.altsep and os.altsep in name):
            raise ValueError(f"a part of a save is a name inside it, not a path (got {name!r})")
        return self.store.join(self.path, name)

    def file(self, rel: str) -> str:
        """The path of file ``rel`` inside the save (``part`` or ``part/inner/name``; never leaving it)."""
        pieces = rel.split("/")
        for piece in pieces:
            self.part(piece)
        return self.store.join(self.path, *pieces)

    def has(self, name: str) -> bool:
        return self.store.exists(self.part(name))

    def checksums(self) -> dict[str, dict[str, Any]] | None:
        """The sums ``checksums.json`` lists (read once); None for a save written before checksums."""
        if self._sums is False:
            self._sums = checksums.read_manifest(self.path)
        return self._sums  # type: ignore[return-value]

    def read(self, rel: str) -> bytes:
        """The bytes of file ``rel`` (see :meth:`file`), checked against the save's checksums first."""
        path = self.file(rel)
        sums = self.checksums()
        if sums is not None and rel not in sums:
            raise LayoutError(
                f"{path} is not among the files {self.store.join(self.path, CHECKSUMS)} lists: "
                + ("it is missing" if not self.store.exists(path) else "it was added after the save")
            )
        return checksums.read_verified(path, None if sums is None else sums[rel])

    def load(self, rel: str) -> Any:
        """``torch.load`` of file ``rel``, data only (``weights_only=True``), checked against its checksum.

        Any failure (missing, damaged, not fleet's format) is a :class:`LayoutError` naming the file.
        """
        import torch

        data = self.read(rel)
        try:
            return torch.load(io.BytesIO(data), weights_only=True)
        except Exception as error:  # noqa: BLE001 - said with the file's name: whatever it is, the file is unusable
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise LayoutError(f"{self.file(rel)} cannot be loaded ({type(error).__name__}: {first})") from None

    def checkpoint_reader(self, name: str) -> Any:
        """A ``torch.distributed.checkpoint`` storage reader of the part ``name`` (check it first: :meth:`verify`)."""
        return self.store.checkpoint_reader(self.part(name))

    def verify(self, under: str | None = None) -> list[str]:
        """Check every file the checksums list (or those under part ``under``) against its sum; their names.

        For parts another library reads itself (``torch.distributed.checkpoint``'s folder): checked
        here first, so a damaged one is an error naming the file before anything is loaded.
        """
        sums = self.checksums()
        if sums is None:
            return []
        if under is not None:
            self.part(under)
        prefix = None if under is None else f"{under}/"
        names = [rel for rel in sums if prefix is None or rel.startswith(prefix)]
        for rel in names:
            self.read(rel)
        return names

    def parent(self) -> str | None:
        """The save this one builds on (its directory), from the kind's manifest; None for a base.

        A manifest that is there but unreadable is a :class:`LayoutError` (never taken for a base).
        """
        if self.kind.manifest is None:
            return None
        path = self.part(self.kind.manifest)
        if not self.store.exists(path):
            return None
        try:
            parent = json.loads(checksums.read_verified(path, None)).get("parent")
            if parent is not None and not isinstance(parent, str):
                raise ValueError(f"parent is {parent!r}")
        except (ValueError, AttributeError, UnicodeDecodeError) as error:
            raise LayoutError(f"{path} is damaged ({error}): which save this one builds on is unknown") from None
        return parent or None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r})"


class SaveWriter(Save):
    """One save being written: :meth:`prepare`, then :meth:`write` (or :meth:`directory`) each part,
    then :meth:`commit` (``latest`` moves; call once every writer of the save is done) or :meth:`abort`.

    Several processes may write parts of one save, each with its own writer on the same number;
    exactly one of them commits.
    """

    def __init__(self, layout: _Layout, number: int):
        super().__init__(layout.path(number), layout.kind)
        self.layout = layout
        self.fresh = False
        """Whether :meth:`prepare` created the directory (no earlier attempt at this save left it)."""
        self._written: list[str] = []
        self._written_sums: dict[str, dict[str, Any]] = {}

    def prepare(self) -> SaveWriter:
        """Create the save's directory (a full disk raises :class:`~fleet.errors.DiskFullError`)."""
        make_dirs(self.layout.dirname)
        self.fresh = not self.store.is_dir(self.path)
        make_dirs(self.path)
        return self

    def write(self, name: str, obj: Any) -> str:
        """``torch.save`` ``obj`` as part ``name``, atomically (a temporary name, then a rename)."""
        path = self.part(name)
        self._written_sums[name] = save_atomic(obj, path)
        self._written.append(path)
        return path

    def directory(self, name: str) -> str:
        """The path of a part that is a directory another writer fills (``torch.distributed.checkpoint``).

        :meth:`abort` leaves it: every worker writes its shards there, and one worker's failure
        is no reason to remove the others'.
        """
        return self.part(name)

    def checkpoint_writer(self, name: str) -> Any:
        """A ``torch.distributed.checkpoint`` storage writer filling the part ``name`` (see :meth:`directory`)."""
        return self.store.checkpoint_writer(self.directory(name))

    def commit(self, parent: str | None = None, sums: dict[str, dict[str, Any]] | None = None) -> None:
        """Every part is on disk: list every file's checksum, record ``parent`` (kinds with a manifest),
        move ``latest`` here, prune.

        ``sums``: the sums other writers reported for their files (relative paths, as
        :meth:`Save.read` takes them); a file nobody reported is read back and hashed here, and
        a reported file that is not there is an error (a part went missing).
        """
        if self.kind.manifest is None and parent is not None:
            raise ValueError(f"saves of kind {self.kind.prefix!r} have no parents (got parent={parent!r})")
        reported = {**(sums or {}), **self._written_sums}
        skip = (CHECKSUMS,) if self.kind.manifest is None else (CHECKSUMS, self.kind.manifest)
        files = checksums.walk(self.path, skip=skip)
        missing = sorted(set(reported) - set(files))
        if missing:
            raise LayoutError(f"{self.path} lacks {', '.join(missing)}, which its writers reported written")
        checksums.write_manifest(
            self.path, {rel: reported.get(rel) or checksums.file_sum(self.file(rel)) for rel in files}
        )
        if self.kind.manifest is not None:
            write_text_atomic(self.part(self.kind.manifest), json.dumps({"parent": parent}))
        self.layout.commit(self.name)

    def abort(self, whole: bool) -> None:
        """Remove the files this writer wrote (:meth:`write`); with ``whole``, the save's whole directory
        (when no other writer shares it). ``latest`` still names the save before."""
        if whole:
            self.store.delete(self.path)
            return
        for path in reversed(self._written):
            self.store.delete(path)
