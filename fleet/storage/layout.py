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

import os
import sys
from collections.abc import Callable

from fleet.storage import checksums
from fleet.storage.atomic import commit_text
from fleet.storage.checksums import CHECKSUMS, LayoutError
from fleet.storage.paths import absolute, store_for
from fleet.storage.save import Save, SaveKind, SaveWriter

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
    seen = {absolute(start)}
    while (parent := parent_of(chain[-1])) is not None:
        if absolute(parent) in seen:
            raise LayoutError(
                f"the {what} {chain[-1]} builds on {parent}, which was already read (a cycle): "
                f"{' -> '.join(chain)} -> {parent}"
            )
        if len(chain) > max_depth:
            raise LayoutError(f"the {what} {start} builds on more than {max_depth} saves before a base (a loop?)")
        seen.add(absolute(parent))
        chain.append(parent)
    return chain


class Layout:
    """The saves of one kind under ``dirname``: naming, the ``latest`` pointer, parents, pruning."""

    def __init__(self, dirname: str, kind: SaveKind):
        self.dirname = dirname
        self.kind = kind
        self.store = store_for(dirname)

    @property
    def pointer(self) -> str:
        return self.store.join(self.dirname, LATEST)

    def path(self, number: int) -> str:
        return self.store.join(self.dirname, self.kind.name(number))

    def numbers(self) -> list[int]:
        """The numbers of every save directory here, finished or not, ascending."""
        names = self.store.list(self.dirname)
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
        if not self.store.exists(self.pointer):
            return None
        try:
            data = checksums.read_verified(self.pointer, None) if self._small(self.pointer) else None
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
        path = self.store.join(self.dirname, name)
        if not name:
            wrong = "it is empty"
        elif os.path.isabs(name):
            wrong = "an absolute path; it must name a save inside the directory"
        elif name in (".", "..") or os.sep in name or (os.altsep and os.altsep in name):
            wrong = "a path, not the name of a save right inside the directory"
        elif self.kind.number(name) is None:
            wrong = f"not named {self.kind.prefix}-<n>"
        elif not self.store.is_dir(path):
            wrong = "there is no such directory"
        elif not self.store.inside(path, self.dirname):
            wrong = "a link to a directory outside it"
        else:
            return Save(path, self.kind)
        raise LayoutError(
            f"{self.pointer} names {name!r}, which is not a save in {self.dirname}: {wrong} (the pointer was edited?)"
        )

    def unpointed(self) -> LayoutError | None:
        """With no ``latest``: the error to raise when a complete save is there all the same (its pointer went,
        so "nothing saved yet" would silently drop it); None when no save here completed."""
        if self.pointed() is not None:
            return None
        complete = [n for n in self.numbers() if self.store.is_file(self.store.join(self.path(n), CHECKSUMS))]
        if not complete:
            return None
        return LayoutError(
            f"{self.pointer} is missing, but {self.path(complete[-1])} is a complete save: the pointer was removed. "
            f"Write its name ({self.kind.name(complete[-1])}) into {self.pointer} to load it, or remove the "
            "directory to start fresh."
        )

    def commit(self, name: str) -> None:
        """Point ``latest`` at save ``name`` (atomically), then drop the saves nothing needs."""
        if self.kind.number(name) is None:
            raise ValueError(f"{name!r} is not a {self.kind.prefix}-<n> save")
        commit_text(self.pointer, name)
        self.prune(name)

    def committed(self, name: str) -> bool:
        """Whether save ``name`` is complete: it exists and ``latest`` names it or a later save."""
        number, latest = self.kind.number(name), self.kind.number(self.pointed() or "")
        return number is not None and latest is not None and number <= latest and self.store.is_dir(self.path(number))

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
        here = absolute(self.dirname)
        for save in ancestors:  # a parent in another directory is not this layout's to keep or remove
            if self.store.split(absolute(save.path))[0] == here and save.number is not None:
                keep.add(save.number)
        for number in numbers:
            if number not in keep:
                self.store.delete(self.path(number))

    def _small(self, path: str) -> bool:
        """Whether ``path`` is a regular file (a link followed) no larger than a pointer ever is."""
        entry = self.store.entry(path, follow_links=True)
        return entry is not None and entry.kind == "file" and entry.size <= _MAX_POINTER_BYTES


def committed(path: str, kind: SaveKind) -> bool:
    """Whether ``path`` is a complete save: a ``<prefix>-<n>`` its directory's ``latest`` covers, or, for a
    directory not named as a save (written before numbered saves), that it exists."""
    store = store_for(path)
    parent, name = store.split(store.absolute(path))
    if kind.number(name) is None:
        return store.is_dir(path)
    return Layout(parent, kind).committed(name)
