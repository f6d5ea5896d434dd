"""The one checkpoint layout: numbered save directories, a ``latest`` pointer, parents, pruning.

Every checkpoint fleet writes (``save_checkpoint`` of any strategy, ``save_persistables`` of a
parameter-server job) is laid out the same way, only the name of a save differs by kind::

    <dirname>/<prefix>-<n>/   one save (what the strategy, the servers and the workers wrote)
    <dirname>/latest          the name of the newest complete save, written atomically

:data:`STEPS` (``step-%09d``, numbered by the training step) is ``save_checkpoint``'s kind,
:data:`SAVES` (``save-%06d``, numbered one above every save there) ``save_persistables``'.
A save is written by a :class:`SaveWriter` (``prepare`` -> ``write`` parts -> ``commit``, or
``abort``): its parts are files or directories named inside the save, never paths, and
``latest`` moves only at ``commit``, after every part is on disk, so a failure at any moment
leaves the previous save the one that loads. Strategies receive the writer (or a :class:`Save`
to read) and never name a save directory themselves.

``latest`` is trusted only as far as it names a save of this kind right inside ``dirname``
(:meth:`Layout.resolve`): an empty pointer, an absolute path, ``..`` or a name of another kind
is refused with the pointer's path and what is wrong with it, instead of reading elsewhere.

Every committed save lists its files' sizes and SHA-256 sums in ``checksums.json``
(:mod:`fleet.storage.checksums`); :meth:`Save.load` and :meth:`Save.read` check a file against
them before using a byte of it, so a file truncated or bit-flipped since is an error naming it.
Saves written before checksums (no ``checksums.json``) load unchecked.

A save may build on a parent (a delta save): the kind's manifest (``save.json``) names the
parent's directory. :func:`follow` walks such chains with cycle detection and a depth bound;
:meth:`Layout.prune` keeps the newest :attr:`SaveKind.keep` saves and every save the newest
one builds on.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fleet.storage import checksums
from fleet.storage.atomic import make_dirs, save_atomic, write_text_atomic
from fleet.storage.checksums import CHECKSUMS, LayoutError

__all__ = [
    "CHECKSUMS",
    "LATEST",
    "MANIFEST",
    "MAX_DEPTH",
    "SAVES",
    "STEPS",
    "Layout",
    "LayoutError",
    "Save",
    "SaveKind",
    "SaveWriter",
    "committed",
    "follow",
]

LATEST = "latest"
MANIFEST = "save.json"
MAX_DEPTH = 1024
"""The longest parent chain followed: a longer one is an error, never a walk without end."""
_MAX_POINTER_BYTES = 4096


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


STEPS = SaveKind("step", 9)
"""``save_checkpoint``: ``step-%09d``, one save per training step saved."""
SAVES = SaveKind("save", 6, manifest=MANIFEST)
"""``save_persistables``: ``save-%06d``, each one above every save there; deltas name a parent."""


def follow(
    start: str, parent_of: Callable[[str], str | None], what: str = "save", max_depth: int = MAX_DEPTH
) -> list[str]:
    """``start`` and its ancestors (``parent_of`` gives each one's parent, None at a base), start first.

    Raises :class:`LayoutError` on a cycle or a chain longer than ``max_depth``: a parent chain
    is written by fleet and a loop in it means the files were edited or mixed up.
    """
    chain = [start]
    seen = {os.path.abspath(start)}
    while (parent := parent_of(chain[-1])) is not None:
        if os.path.abspath(parent) in seen:
            raise LayoutError(
                f"the {what} {chain[-1]} builds on {parent}, which was already read (a cycle): "
                f"{' -> '.join(chain)} -> {parent}"
            )
        if len(chain) > max_depth:
            raise LayoutError(f"the {what} {start} builds on more than {max_depth} saves before a base (a loop?)")
        seen.add(os.path.abspath(parent))
        chain.append(parent)
    return chain


class Save:
    """One save directory, to read: its parts are named inside it."""

    def __init__(self, path: str, kind: SaveKind):
        self.path = path
        self.kind = kind
        self._sums: dict[str, dict[str, Any]] | None | bool = False  # False: checksums.json not read yet

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    @property
    def number(self) -> int | None:
        return self.kind.number(self.name)

    def part(self, name: str) -> str:
        """The path of part ``name`` (a file or directory name right inside the save)."""
        if not name or name in (".", "..") or os.sep in name or (os.altsep and os.altsep in name):
            raise ValueError(f"a part of a save is a name inside it, not a path (got {name!r})")
        return os.path.join(self.path, name)

    def file(self, rel: str) -> str:
        """The path of file ``rel`` inside the save (``part`` or ``part/inner/name``; never leaving it)."""
        pieces = rel.split("/")
        for piece in pieces:
            self.part(piece)
        return os.path.join(self.path, *pieces)

    def has(self, name: str) -> bool:
        return os.path.exists(self.part(name))

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
                f"{path} is not among the files {os.path.join(self.path, CHECKSUMS)} lists: "
                + ("it is missing" if not os.path.lexists(path) else "it was added after the save")
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
        if not os.path.lexists(path):
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

    def __init__(self, layout: Layout, number: int):
        super().__init__(layout.path(number), layout.kind)
        self.layout = layout
        self.fresh = False
        """Whether :meth:`prepare` created the directory (no earlier attempt at this save left it)."""
        self._written: list[str] = []
        self._written_sums: dict[str, dict[str, Any]] = {}

    def prepare(self) -> SaveWriter:
        """Create the save's directory (a full disk raises :class:`~fleet.errors.DiskFullError`)."""
        make_dirs(self.layout.dirname)
        self.fresh = not os.path.isdir(self.path)
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
            shutil.rmtree(self.path, ignore_errors=True)
            return
        for path in reversed(self._written):
            if os.path.exists(path):
                os.unlink(path)


class Layout:
    """The saves of one kind under ``dirname``: naming, the ``latest`` pointer, parents, pruning."""

    def __init__(self, dirname: str, kind: SaveKind):
        self.dirname = dirname
        self.kind = kind

    @property
    def pointer(self) -> str:
        return os.path.join(self.dirname, LATEST)

    def path(self, number: int) -> str:
        return os.path.join(self.dirname, self.kind.name(number))

    def numbers(self) -> list[int]:
        """The numbers of every save directory here, finished or not, ascending."""
        try:
            names = os.listdir(self.dirname)
        except FileNotFoundError:
            return []
        return sorted(n for n in map(self.kind.number, names) if n is not None)

    def writer(self, number: int | None = None) -> SaveWriter:
        """A writer for save ``number`` (None: one above every save here, finished or not)."""
        if number is None:
            number = max(self.numbers(), default=0) + 1
        return SaveWriter(self, number)

    def pointed(self) -> str | None:
        """The name ``latest`` holds, unchecked (None when there is no pointer).

        A pointer that is not a small regular text file is a :class:`LayoutError`: a folder or a
        device there must never read as "no checkpoint yet".
        """
        if not os.path.lexists(self.pointer):
            return None
        try:
            data = checksums.read_verified(self.pointer, None) if _small(self.pointer) else None
        except (OSError, LayoutError) as error:
            raise LayoutError(f"{self.pointer} cannot be read as the name of a save ({error})") from None
        if data is None:
            raise LayoutError(
                f"{self.pointer} is not a file naming a save (it must be a small text file, as fleet writes it)"
            )
        try:
            return data.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise LayoutError(f"{self.pointer} is not text: it must hold the name of a save") from None

    def resolve(self) -> Save | None:
        """The save ``latest`` names; None when there is no pointer.

        Refused (:class:`LayoutError`, naming the pointer and what is wrong): an empty pointer, an
        absolute path, a path that leaves or descends ``dirname``, a name that is not a save of
        this kind, or a save that is not there.
        """
        name = self.pointed()
        if name is None:
            return None
        path = os.path.join(self.dirname, name)
        if not name:
            wrong = "it is empty"
        elif os.path.isabs(name):
            wrong = "an absolute path; it must name a save inside the directory"
        elif name in (".", "..") or os.sep in name or (os.altsep and os.altsep in name):
            wrong = "a path, not the name of a save right inside the directory"
        elif self.kind.number(name) is None:
            wrong = f"not named {self.kind.prefix}-<n>"
        elif not os.path.isdir(path):
            wrong = "there is no such directory"
        elif not _inside(path, self.dirname):
            wrong = "a link to a directory outside it"
        else:
            return Save(path, self.kind)
        raise LayoutError(
            f"{self.pointer} names {name!r}, which is not a save in {self.dirname}: {wrong} (the pointer was edited?)"
        )

    def commit(self, name: str) -> None:
        """Point ``latest`` at save ``name`` (atomically), then drop the saves nothing needs."""
        if self.kind.number(name) is None:
            raise ValueError(f"{name!r} is not a {self.kind.prefix}-<n> save")
        write_text_atomic(self.pointer, name)
        self.prune(name)

    def committed(self, name: str) -> bool:
        """Whether save ``name`` is complete: it exists and ``latest`` names it or a later save."""
        number, latest = self.kind.number(name), self.kind.number(self.pointed() or "")
        return number is not None and latest is not None and number <= latest and os.path.isdir(self.path(number))

    def chain(self, save: Save) -> list[Save]:
        """``save`` and every save it builds on back to its base (cycle and depth checked)."""
        return [Save(path, self.kind) for path in follow(save.path, lambda p: Save(p, self.kind).parent())]

    def prune(self, latest: str) -> None:
        """Keep save ``latest``, the newest others up to :attr:`SaveKind.keep` in all (none numbered above
        ``latest``: those never completed), and every save here that ``latest`` builds on; remove the rest.

        A parent chain that cannot be followed (a cycle, too deep) prunes nothing: keeping a save
        too many is better than removing one a delta still needs.
        """
        newest = self.kind.number(latest)
        if newest is None:
            raise ValueError(f"{latest!r} is not a {self.kind.prefix}-<n> save")
        numbers = self.numbers()
        older = [n for n in numbers if n < newest]
        keep = {newest, *(older[-(self.kind.keep - 1) :] if self.kind.keep > 1 else [])}
        try:
            ancestors = self.chain(Save(self.path(newest), self.kind))
        except LayoutError as error:
            print(f"fleet: not pruning {self.dirname} (every save is kept): {error}", file=sys.stderr, flush=True)
            return
        here = os.path.abspath(self.dirname)
        for save in ancestors:  # a parent in another directory is not this layout's to keep or remove
            if os.path.dirname(os.path.abspath(save.path)) == here and save.number is not None:
                keep.add(save.number)
        for number in numbers:
            if number not in keep:
                shutil.rmtree(self.path(number), ignore_errors=True)


def committed(path: str, kind: SaveKind) -> bool:
    """Whether ``path`` is a complete save: a ``<prefix>-<n>`` its directory's ``latest`` covers, or, for a
    directory not named as a save (written before numbered saves), that it exists."""
    parent, name = os.path.split(os.path.abspath(path))
    if kind.number(name) is None:
        return os.path.isdir(path)
    return Layout(parent, kind).committed(name)


def _small(path: str) -> bool:
    """Whether ``path`` is a regular file (a link followed) no larger than a pointer ever is."""
    import stat

    try:
        info = os.stat(path)
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_size <= _MAX_POINTER_BYTES


def _inside(path: str, dirname: str) -> bool:
    """Whether ``path``, links resolved, lies inside ``dirname`` (links resolved too)."""
    real, root = os.path.realpath(path), os.path.realpath(dirname)
    return os.path.commonpath([real, root]) == root and real != root
