"""Saving and loading a server's table shards to local files.

Layout: ``<dirname>/ps-server-<index>/table-<id>.pt``, one file per table,
holding the shard's kind, its config (canonical JSON text) and its state
(version + the table's ``state_dict``). A delta save (``delta=True``) writes, for
each sparse table saved before, only the rows changed since that save and the ids
evicted since, with the path of that save as ``parent``; loading follows the parents
back to a base and replays the deltas forward. Each file is written to a temporary
name and moved into place with :func:`os.replace`, so a crash mid-save never
leaves a half-written checkpoint under the real name. Files are read back
with ``torch.load(weights_only=True)``: these are our own local files, and
even so nothing in them is allowed to be code.

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
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from fleet.storage import layout, persist
from fleet.storage.atomic import make_dirs, save_atomic, write_text_atomic

_NAME = re.compile(r"^table-(\d+)\.pt$")
RECORDS = 8  # saves a server's restart record remembers (newest last)


def shard_dir(dirname: str, server_index: int) -> str:
    """Server ``server_index``'s part of the save in ``dirname`` (its table files are this module's format)."""
    return layout.Save(dirname, layout.SAVES).part(f"ps-server-{server_index}")


def save_shards(dirname: str, server_index: int, shards: Mapping[int, Any], parent: str | None = None) -> list[str]:
    """Write every shard (a delta of each sparse one saved before when ``parent``, the previous save, is given).

    Returns the file paths. Pending sync accumulations are not saved.
    """
    if not dirname:
        raise ValueError("SAVE needs a directory path")
    target = shard_dir(dirname, server_index)
    make_dirs(target)
    parent = persist.resolve(parent) if parent is not None else None
    written = []
    for table, shard in sorted(shards.items()):
        path = os.path.join(target, f"table-{table}.pt")
        delta = parent is not None and shard.kind == "sparse" and shard.table.saved
        record = {"kind": shard.kind, "config": shard.key, "state": shard.state(delta=delta)}
        if delta:
            record["parent"] = os.path.abspath(parent)
        save_atomic(record, path)
        written.append(path)
    for shard in shards.values():
        shard.saved()
    return written


def record_path(record_dir: str, server_index: int) -> str:
    return os.path.join(record_dir, f"ps-server-{server_index}.checkpoint")


def record_checkpoint(record_dir: str, server_index: int, dirname: str) -> str:
    """Remember ``dirname`` as this server's newest save (atomic: temporary name, then rename)."""
    make_dirs(record_dir)
    path = record_path(record_dir, server_index)
    history = [d for d in _recorded(path) if d != os.path.abspath(dirname)][-(RECORDS - 1) :]
    write_text_atomic(path, "\n".join([*history, os.path.abspath(dirname)]))
    return path


def last_checkpoint(record_dir: str, server_index: int) -> str | None:
    """The newest recorded save of this server that is complete, or None when there is none (or it vanished)."""
    for dirname in reversed(_recorded(record_path(record_dir, server_index))):
        if persist.committed(dirname) and os.path.isdir(shard_dir(dirname, server_index)):
            return dirname
    return None


def _recorded(path: str) -> list[str]:
    try:
        with open(path) as handle:
            return [line.strip() for line in handle if line.strip()]
    except FileNotFoundError:
        return []


def _read(path: str) -> dict[str, Any]:
    data = torch.load(path, weights_only=True)
    if not isinstance(data, dict) or data.get("kind") not in ("dense", "sparse"):
        raise ValueError(f"LOAD: {path} is not a parameter-server shard file")
    return data


def load_shards(dirname: str, server_index: int) -> Iterator[tuple[int, str, dict[str, Any], list[dict[str, Any]]]]:
    """Yield (table id, kind, config, states) for every shard file this server saved.

    ``states`` is the base first, then each delta up to the one in ``dirname``.
    """
    dirname = persist.resolve(dirname)
    source = shard_dir(dirname, server_index)
    if not os.path.isdir(source):
        raise ValueError(f"LOAD: {source} does not exist (was the checkpoint saved with this many servers?)")
    for name in sorted(os.listdir(source)):
        match = _NAME.match(name)
        if not match:
            continue
        chain = _chain(os.path.join(source, name), server_index)
        chain.reverse()
        yield int(match.group(1)), chain[-1]["kind"], json.loads(chain[-1]["config"]), [c["state"] for c in chain]


def _chain(path: str, server_index: int) -> list[dict[str, Any]]:
    """The shard file at ``path`` and every one it is a delta on, back to its base (newest first)."""
    records: dict[str, dict[str, Any]] = {}

    def read(path: str) -> dict[str, Any]:
        if path not in records:
            records[path] = _read(path)
        return records[path]

    def parent_of(path: str) -> str | None:
        parent = read(path).get("parent")
        if not parent:
            return None
        before = os.path.join(shard_dir(parent, server_index), os.path.basename(path))
        if not os.path.isfile(before):
            raise ValueError(
                f"LOAD: {path} is a delta on the save in {parent}, but {before} does not exist: "
                "a delta loads only with the saves before it back to a base"
            )
        return before

    try:
        files = layout.follow(path, parent_of, what="shard file")
    except layout.LayoutError as error:
        raise ValueError(f"LOAD: {error}: a delta loads only with the saves before it back to a base") from None
    return [read(file) for file in files]
