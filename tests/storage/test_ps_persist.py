"""save_persistables' directories: a new save each time, a pointer, pruning that keeps delta chains,
and a restarted server that loads the newest save the pointer committed (files only, no processes)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fleet.errors import FleetError
from fleet.ps.server import shard_io
from fleet.storage import persist


def make_save(dirname: Path, parent: str | None = None, servers: int = 1, commit: bool = True) -> str:
    path = persist.begin(str(dirname))
    for server in range(servers):
        os.makedirs(shard_io.shard_dir(path, server))
    if commit:
        persist.commit(str(dirname), path, parent)
    return path


def test_loading_follows_the_pointer_and_an_unfinished_save_is_not_seen(tmp_path: Path) -> None:
    first = make_save(tmp_path)
    assert persist.resolve(str(tmp_path)) == first
    unfinished = make_save(tmp_path, commit=False)  # its servers wrote, worker 0 never committed
    assert persist.resolve(str(tmp_path)) == first
    assert persist.committed(first) and not persist.committed(unfinished)
    persist.abandon(unfinished)
    assert sorted(os.listdir(tmp_path)) == ["latest", os.path.basename(first)]
    legacy = tmp_path / "old"  # a directory written before versions: loads as itself
    legacy.mkdir()
    assert persist.resolve(str(legacy)) == str(legacy)
    (tmp_path / "latest").write_text("../etc")
    with pytest.raises(FleetError, match="not a save"):
        persist.resolve(str(tmp_path))


def test_pruning_keeps_the_newest_two_and_what_the_newest_builds_on(tmp_path: Path) -> None:
    base = make_save(tmp_path)
    delta1 = make_save(tmp_path, parent=base)
    delta2 = make_save(tmp_path, parent=delta1)
    delta3 = make_save(tmp_path, parent=delta2)
    kept = sorted(os.listdir(tmp_path))
    assert kept == sorted(["latest", *(os.path.basename(p) for p in (base, delta1, delta2, delta3))])
    rebase = make_save(tmp_path)  # a base: the chain before it is no longer needed
    assert sorted(os.listdir(tmp_path)) == sorted(["latest", os.path.basename(delta3), os.path.basename(rebase)])
    assert json.loads(Path(rebase, persist.MANIFEST).read_text()) == {"parent": None}


def test_a_restarted_server_loads_the_newest_committed_save(tmp_path: Path) -> None:
    logs, a, b = str(tmp_path / "logs"), tmp_path / "a", tmp_path / "b"
    a1 = make_save(a, servers=2)
    shard_io.record_checkpoint(logs, 0, a1)
    b1 = make_save(b, servers=2)
    shard_io.record_checkpoint(logs, 0, b1)
    a2 = make_save(a, servers=2, commit=False)  # server 0 saved it, another server failed: never committed
    shard_io.record_checkpoint(logs, 0, a2)
    assert shard_io.last_checkpoint(logs, 0) == b1
    persist.commit(str(a), a2, None)
    assert shard_io.last_checkpoint(logs, 0) == a2
    assert shard_io.last_checkpoint(logs, 1) is None  # server 1 recorded nothing
