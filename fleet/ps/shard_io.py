"""Saving and loading a server's table shards to local files.

Layout: ``<dirname>/ps-server-<index>/table-<id>.pt``, one file per table,
holding the shard's kind, its config (canonical JSON text) and its state
(version + the table's ``state_dict``). Each file is written to a temporary
name and moved into place with :func:`os.replace`, so a crash mid-save never
leaves a half-written checkpoint under the real name. Files are read back
with ``torch.load(weights_only=True)``: these are our own local files, and
even so nothing in them is allowed to be code.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch

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
        tmp = f"{path}.tmp-{os.getpid()}"
        torch.save({"kind": shard.kind, "config": shard.key, "state": shard.state()}, tmp)
        os.replace(tmp, path)
        written.append(path)
    return written


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
