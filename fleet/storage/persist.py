"""``save_persistables`` directories that are never torn: one new directory per save, then a pointer.

Layout: ``<dirname>/save-<n>/`` holds one save (every server's ``ps-server-<i>/`` and worker
0's ``worker-0.pt``); ``<dirname>/latest`` names the newest complete one. A save writes a
new ``save-<n>`` and moves ``latest`` only after every server answered and worker 0's file
is in place, so a failure at any moment (a full disk, a dead server) leaves the previous
save loadable; worker 0 then removes the unfinished directory. Loading follows ``latest``;
a directory written before versions (shards right under ``dirname``) still loads.

A delta's shards name the save they build on (its ``save-<n>`` path, never ``latest``,
which moves). After a save, the directory keeps the newest :data:`KEEP` saves and every
save the newest one builds on (``save.json`` names its parent); older ones are removed.

The server records each save in its restart record (:mod:`fleet.ps.server.shard_io`); a
restarted server loads the newest recorded save that ``latest`` committed. Worker 0 and
the servers must see ``dirname`` as one filesystem (shared, or one host), as
``save_checkpoint`` assumes for its workers.
"""

from __future__ import annotations

import json
import os
import re
import shutil

from fleet.errors import FleetError
from fleet.storage.atomic import make_dirs, write_text_atomic

LATEST = "latest"
MANIFEST = "save.json"
KEEP = 2
VERSION = re.compile(r"^save-(\d+)$")


def resolve(dirname: str) -> str:
    """The complete save ``latest`` names under ``dirname``; ``dirname`` itself when it has no pointer."""
    pointer = os.path.join(dirname, LATEST)
    try:
        with open(pointer) as handle:
            name = handle.read().strip()
    except FileNotFoundError:
        return dirname
    path = os.path.join(dirname, name)
    if not VERSION.match(name) or not os.path.isdir(path):
        raise FleetError(f"{pointer} names {name!r}, which is not a save in {dirname} (the pointer was edited?)")
    return path


def committed(path: str) -> bool:
    """Whether ``path`` (a ``save-<n>`` directory, or a save from before versions) is a complete save."""
    parent, name = os.path.split(os.path.abspath(path))
    if not VERSION.match(name):
        return os.path.isdir(path)
    try:
        with open(os.path.join(parent, LATEST)) as handle:
            latest = handle.read().strip()
    except OSError:
        return False
    match = VERSION.match(latest)
    return bool(match) and int(VERSION.match(name).group(1)) <= int(match.group(1)) and os.path.isdir(path)


def begin(dirname: str) -> str:
    """A new, empty ``save-<n>`` under ``dirname`` (n above every save there, finished or not)."""
    make_dirs(dirname)
    numbers = [int(m.group(1)) for m in map(VERSION.match, os.listdir(dirname)) if m]
    path = os.path.abspath(os.path.join(dirname, f"save-{max(numbers, default=0) + 1:06d}"))
    make_dirs(path)
    return path


def commit(dirname: str, path: str, parent: str | None) -> None:
    """Every part of ``path`` is written: point ``latest`` at it, then drop the saves nothing needs."""
    write_text_atomic(os.path.join(path, MANIFEST), json.dumps({"parent": parent}))
    write_text_atomic(os.path.join(dirname, LATEST), os.path.basename(path))
    _prune(dirname, os.path.basename(path))


def abandon(path: str) -> None:
    """Remove an unfinished save (what the servers and worker 0 wrote of it)."""
    shutil.rmtree(path, ignore_errors=True)


def _prune(dirname: str, latest: str) -> None:
    names = sorted((d for d in os.listdir(dirname) if VERSION.match(d)), key=lambda d: int(VERSION.match(d).group(1)))
    newest = int(VERSION.match(latest).group(1))
    keep = {d for d in names if int(VERSION.match(d).group(1)) <= newest}
    keep = set(sorted(keep, key=lambda d: int(VERSION.match(d).group(1)))[-KEEP:])
    chain = latest
    while chain:
        keep.add(chain)
        chain = _parent_in(dirname, chain)
    for name in names:
        if name not in keep:
            shutil.rmtree(os.path.join(dirname, name), ignore_errors=True)


def _parent_in(dirname: str, name: str) -> str | None:
    """The save ``name`` builds on, when it lies in ``dirname`` too."""
    try:
        with open(os.path.join(dirname, name, MANIFEST)) as handle:
            parent = json.load(handle).get("parent")
    except (OSError, ValueError, AttributeError):
        return None
    if not parent or os.path.dirname(os.path.abspath(parent)) != os.path.abspath(dirname):
        return None
    return os.path.basename(parent)
