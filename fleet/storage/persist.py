"""``save_persistables``' saves: the :data:`~fleet.storage.layout.SAVES` kind of the checkpoint layout.

Layout (:mod:`fleet.storage.layout`): ``<dirname>/save-<n>/`` holds one save (every server's
``ps-server-<i>/`` and worker 0's ``worker-0.pt``); ``<dirname>/latest`` names the newest
complete one. A save writes a new ``save-<n>`` and moves ``latest`` only after every server
answered and worker 0's file is in place, so a failure at any moment (a full disk, a dead
server) leaves the previous save loadable; worker 0 then removes the unfinished directory.
Loading follows ``latest``; a directory written before versions (shards right under
``dirname``) still loads.

A delta's shards name the save they build on (its ``save-<n>`` path, never ``latest``,
which moves). After a save, the directory keeps the newest two saves and every save the
newest one builds on (``save.json`` names its parent); older ones are removed.

The server records each save in its restart record (:mod:`fleet.ps.server.shard_io`); a
restarted server loads the newest recorded save that ``latest`` committed. Worker 0 and
the servers must see ``dirname`` as one filesystem (shared, one host, or a URL every one of them
reaches: ``s3://bucket/run``, :mod:`fleet.storage.store`), as ``save_checkpoint`` assumes for its workers.
"""

from __future__ import annotations

from fleet.storage import layout
from fleet.storage.layout import LATEST, MANIFEST, SAVES, Layout, SaveWriter
from fleet.storage.paths import absolute, basename, split

__all__ = ["LATEST", "MANIFEST", "abandon", "begin", "commit", "committed", "resolve", "writer"]


def writer(dirname: str) -> SaveWriter:
    """A prepared writer for a new save under ``dirname`` (numbered above every save there, finished or not)."""
    return Layout(absolute(dirname), SAVES).writer().prepare()


def resolve(dirname: str) -> str:
    """The complete save ``latest`` names under ``dirname``; ``dirname`` itself when it has no pointer (a save
    from before numbered saves), unless complete saves are there without one (:meth:`Layout.unpointed`)."""
    saves = Layout(dirname, SAVES)
    save = saves.resolve()
    if save is None and (orphaned := saves.unpointed()) is not None:
        raise orphaned
    return dirname if save is None else save.path


def committed(path: str) -> bool:
    """Whether ``path`` (a ``save-<n>`` directory, or a save from before versions) is a complete save."""
    return layout.committed(path, SAVES)


def begin(dirname: str) -> str:
    """A new, empty ``save-<n>`` under ``dirname`` (its absolute path)."""
    return absolute(writer(dirname).path)


def commit(dirname: str, path: str, parent: str | None) -> None:
    """Every part of ``path`` is written: record its parent, point ``latest`` at it, drop the saves nothing needs."""
    saves = Layout(dirname, SAVES)
    number = SAVES.number(basename(path))
    if number is None:
        raise ValueError(f"{path} is not a save-<n> directory")
    saves.writer(number).commit(parent)


def abandon(path: str) -> None:
    """Remove an unfinished save (what the servers and worker 0 wrote of it)."""
    parent, name = split(absolute(path))
    number = SAVES.number(name)
    if number is None:
        raise ValueError(f"{path} is not a save-<n> directory")
    Layout(parent, SAVES).writer(number).abort(whole=True)
