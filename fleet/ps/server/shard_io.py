"""Saving and loading a server's table shards, on any store (:mod:`fleet.storage.store`).

Layout: ``<dirname>/ps-server-<index>/table-<id>.pt``, one file per table,
holding the shard's kind, its config (canonical JSON text) and its state
(version + the table's ``state_dict``). A delta save (``delta=True``) writes, for
each sparse table saved before, only the rows changed since that save and the ids
evicted since, with the path of that save as ``parent``; loading follows the parents
back to a base and replays the deltas forward. Each file is written whole or not at all
(:func:`~fleet.storage.atomic.save_atomic`: locally a temporary name moved into place), so a
crash mid-save never leaves a half-written checkpoint under the real name; each file's size and SHA-256 are
hashed as it is written and go back to worker 0, which lists them in the save's
``checksums.json`` (:mod:`fleet.storage.checksums`). A load reads every file of the
chain (checked against those sums, then ``torch.load(weights_only=True)``: even our own
files may hold no code) before it returns anything, so a caller can check everything before
it changes a table (:mod:`fleet.ps.server.staged_load`).

Server restarts (``fleetrun --max-restarts K``): after every successful SAVE a
server records the checkpoint directory in ``<record dir>/ps-server-<i>.checkpoint``
(:func:`record_checkpoint`, written atomically; the record dir is the job's log
directory, :data:`fleet.runtime.env.FLEET_LOG_DIR`), the newest last among the few kept. A
restarted server reads them back (:func:`last_checkpoint`) and loads its shards from the
newest one that is complete: one ``save_persistables`` committed (:mod:`fleet.storage.persist`:
a server's own SAVE may succeed while another's fails, and then that save never counts).

A directory with a ``latest`` pointer (``save_persistables``' layout) is read through
it; a delta names the save it builds on by that save's own directory, never the pointer.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

from fleet.storage import checksums, layout, persist
from fleet.storage.atomic import make_dirs, save_atomic, write_text_atomic
from fleet.storage.paths import absolute, basename, join, store_for
from fleet.storage.store import StorageError

_NAME = re.compile(r"^table-(\d+)\.pt$")
RECORDS = 8  # saves a server's restart record remembers (newest last)


def shard_dir(dirname: str, server_index: int) -> str:
    """Server ``server_index``'s part of the save in ``dirname`` (its table files are this module's format)."""
    return layout.Save(dirname, layout.SAVES).part(f"ps-server-{server_index}")


def save_shards(
    dirname: str, server_index: int, shards: Mapping[int, Any], parent: str | None = None
) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """Write every shard (a delta of each sparse one saved before when ``parent``, the previous save, is given).

    Returns the file paths and their checksums (by path relative to ``dirname``, as the save's
    ``checksums.json`` lists them). Pending sync accumulations are not saved.
    """
    if not dirname:
        raise ValueError("SAVE needs a directory path")
    target = shard_dir(dirname, server_index)
    make_dirs(target)
    parent = persist.resolve(parent) if parent is not None else None
    written, sums = [], {}
    for table, shard in sorted(shards.items()):
        name = f"table-{table}.pt"
        path = join(target, name)
        delta = parent is not None and shard.kind == "sparse" and shard.table.saved
        record = {"kind": shard.kind, "config": shard.key, "state": shard.state(delta=delta)}
        if delta:
            record["parent"] = absolute(parent)
        sums[f"{basename(target)}/{name}"] = save_atomic(record, path)
        written.append(path)
    for shard in shards.values():
        shard.saved()
    return written, sums


def record_path(record_dir: str, server_index: int) -> str:
    return os.path.join(record_dir, f"ps-server-{server_index}.checkpoint")


def record_checkpoint(record_dir: str, server_index: int, dirname: str) -> str:
    """Remember ``dirname`` as this server's newest save (atomic: temporary name, then rename)."""
    make_dirs(record_dir)
    path = record_path(record_dir, server_index)
    history = [d for d in _recorded(path) if d != absolute(dirname)][-(RECORDS - 1) :]
    write_text_atomic(path, "\n".join([*history, absolute(dirname)]))
    return path


def last_checkpoint(record_dir: str, server_index: int) -> str | None:
    """The newest recorded save of this server that is complete, or None when there is none (or it vanished)."""
    for dirname in reversed(_recorded(record_path(record_dir, server_index))):
        if persist.committed(dirname) and store_for(dirname).is_dir(shard_dir(dirname, server_index)):
            return dirname
    return None


def _recorded(path: str) -> list[str]:
    try:
        with open(path) as handle:
            return [line.strip() for line in handle if line.strip()]
    except FileNotFoundError:
        return []


def load_shards(dirname: str, server_index: int) -> list[tuple[int, str, dict[str, Any], list[dict[str, Any]]]]:
    """(table id, kind, config, states) for every shard file this server saved, every file read and checked.

    ``states`` is the base first, then each delta up to the one in ``dirname``. Raises
    ``ValueError`` naming the file at fault (missing, damaged, changed since it was saved, a
    delta whose parent is gone, a parent chain that loops) before anything is returned.
    """
    dirname = persist.resolve(dirname)
    source = shard_dir(dirname, server_index)
    if not store_for(source).is_dir(source):
        raise ValueError(f"LOAD: {source} does not exist (was the checkpoint saved with this many servers?)")
    folder = basename(source)
    names = [n for n in checksums.walk(source) if _NAME.match(n)]
    sums = layout.Save(dirname, layout.SAVES).checksums()
    if sums is not None:  # a file the save lists must be there: one that went missing is not "no table"
        listed = sorted(rel.split("/", 1)[1] for rel in sums if rel.startswith(f"{folder}/"))
        for name in sorted(set(listed) - set(names)):
            raise ValueError(f"LOAD: {join(source, name)} is missing (the save's checksums.json lists it)")
    out = []
    for name in names:
        chain = _chain(dirname, name, server_index)
        chain.reverse()
        kind, config = chain[-1]["kind"], chain[-1]["config"]
        try:
            config = json.loads(config)
            if not isinstance(config, dict):
                raise ValueError("not a JSON object")
        except (TypeError, ValueError) as error:
            raise ValueError(f"LOAD: {join(source, name)} holds a damaged table config ({error})") from None
        if any(c["kind"] != kind for c in chain):
            raise ValueError(f"LOAD: {join(source, name)} is a {kind} table but a save it builds on is not")
        out.append((int(_NAME.match(name).group(1)), kind, config, [c["state"] for c in chain]))
    return out


def _chain(dirname: str, name: str, server_index: int) -> list[dict[str, Any]]:
    """Shard file ``name`` of the save in ``dirname`` and every one it is a delta on, back to its base
    (newest first), each read and checked against its save's checksums."""
    records: dict[str, dict[str, Any]] = {}
    rel = f"ps-server-{server_index}/{name}"

    def read(save: str) -> dict[str, Any]:
        if save not in records:
            try:
                data = layout.Save(save, layout.SAVES).load(rel)
            except layout.LayoutError as error:
                raise ValueError(f"LOAD: {error}") from None
            if not isinstance(data, dict) or data.get("kind") not in ("dense", "sparse") or "state" not in data:
                raise ValueError(f"LOAD: {join(save, rel)} is not a parameter-server shard file")
            records[save] = data
        return records[save]

    def parent_of(save: str) -> str | None:
        parent = read(save).get("parent")
        if not parent:
            return None
        if not isinstance(parent, str) or not _is_file(join(parent, rel)):
            raise ValueError(
                f"LOAD: {join(save, rel)} is a delta on the save in {parent}, but {join(parent, rel)} "
                "does not exist: a delta loads only with the saves before it back to a base"
            )
        return absolute(parent)

    try:
        saves = layout.follow(absolute(dirname), parent_of, what="save")
    except layout.LayoutError as error:
        raise ValueError(f"LOAD: {error}: a delta loads only with the saves before it back to a base") from None
    return [read(save) for save in saves]


def _is_file(path: str) -> bool:
    """Whether ``path`` is a file (a link to one counts); False for a name no store can reach."""
    try:
        entry = store_for(path).entry(path, follow_links=True)
    except StorageError:
        return False
    return entry is not None and entry.kind == "file"
