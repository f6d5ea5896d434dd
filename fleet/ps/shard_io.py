"""Saving and loading a server's table shards to local files.

Layout: ``<dirname>/ps-server-<index>/table-<id>.pt``, one file per table,
holding the shard's kind, its config (canonical JSON text) and its state
(version + the table's ``state_dict``). Each file is written to a temporary
name and moved into place with :func:`os.replace`, so a crash mid-save never
leaves a half-written checkpoint under the real name. Files are read back
with ``torch.load(weights_only=True)``: these are our own local files, and
even so nothing in them is allowed to be code.

Server restarts (``fleetrun --max-restarts K``): after every successful SAVE a
server records the checkpoint directory in ``<record dir>/ps-server-<i>.checkpoint``
(:func:`record_checkpoint`, written atomically; the record dir is the job's log
directory, :data:`fleet.env.FLEET_LOG_DIR`). A restarted server reads it back
(:func:`last_checkpoint`) and loads its shards from there before serving.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from fleet.atomic import save_atomic, write_text_atomic

_NAME = re.compile(r"^table-(\d+)\.pt$")


def shard_dir(dirname: str, server_index: int) -> str:
    return os.path.join(dirname, f"ps-server-{server_index}")


def save_shards(dirname: str, server_index: int, shards: Mapping[int, Any]) -> list[str]:
    """Write every shard; return the file paths. Pending sync accumulations are not saved."""
    if not dirname:
        raise ValueError("SAVE needs a directory path")
    target = shard_dir(dirname, server_index)
    os.makedirs(target, exist_ok=True)
    written = []
    for table, shard in sorted(shards.items()):
        path = os.path.join(target, f"table-{table}.pt")
        save_atomic({"kind": shard.kind, "config": shard.key, "state": shard.state()}, path)
        written.append(path)
    return written


def record_path(record_dir: str, server_index: int) -> str:
    return os.path.join(record_dir, f"ps-server-{server_index}.checkpoint")


def record_checkpoint(record_dir: str, server_index: int, dirname: str) -> str:
    """Remember ``dirname`` as this server's last complete checkpoint (atomic: temporary name, then rename)."""
    os.makedirs(record_dir, exist_ok=True)
    path = record_path(record_dir, server_index)
    write_text_atomic(path, os.path.abspath(dirname))
    return path


def last_checkpoint(record_dir: str, server_index: int) -> str | None:
    """The directory of this server's last recorded SAVE, or None when there is none (or it vanished)."""
    try:
        with open(record_path(record_dir, server_index)) as handle:
            dirname = handle.read().strip()
    except FileNotFoundError:
        return None
    return dirname if dirname and os.path.isdir(shard_dir(dirname, server_index)) else None


def load_shards(dirname: str, server_index: int) -> Iterator[tuple[int, str, dict[str, Any], dict[str, Any]]]:
    """Yield (table id, kind, config, state) for every shard file this server saved."""
    source = shard_dir(dirname, server_index)
    if not os.path.isdir(source):
        raise ValueError(f"LOAD: {source} does not exist (was the checkpoint saved with this many servers?)")
    for name in sorted(os.listdir(source)):
        match = _NAME.match(name)
        if not match:
            continue
        data = torch.load(os.path.join(source, name), weights_only=True)
        if not isinstance(data, dict) or data.get("kind") not in ("dense", "sparse"):
            raise ValueError(f"LOAD: {name} in {source} is not a parameter-server shard file")
        yield int(match.group(1)), data["kind"], json.loads(data["config"]), data["state"]
