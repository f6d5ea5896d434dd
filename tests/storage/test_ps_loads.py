"""Parameter-server saves and loads under damage (issue 26, findings 1 and 2): a LOAD changes every table on
every server or none, a damaged save is named (server and file), a save or load interrupted at any file leaves
the previous save loadable and the tables as they were, and a parent chain that loops never hangs a save.

In-process: servers in threads of the test process, worker 0's side of save_persistables / load_persistables
(fleet.ps.worker.persistables) called directly.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from fleet.errors import FleetError
from fleet.ps.client.client import PSClient
from fleet.ps.protocol.errors import PSRemoteError
from fleet.ps.server import shard_io
from fleet.ps.worker.persistables import WORKER_FILE, load_servers, save_servers
from fleet.storage import atomic, checksums, persist
from fleet.storage.layout import MANIFEST, SAVES, Layout, Save
from ps_servers import SGD, client, servers

DENSE, SPARSE = 0, 1
IDS = torch.arange(-8, 8)


@contextmanager
def job(n_servers: int = 2) -> Iterator[PSClient]:
    """``n_servers`` servers with a dense and a sparse table, and worker 0's client."""
    with servers(n_servers, 1) as srvs, client(srvs, 0) as c:
        c.create_dense(DENSE, torch.arange(6.0), {"optimizer": SGD, "update": "async"}).result()
        c.create_sparse(SPARSE, {"dim": 4, "optimizer": SGD, "update": "async", "seed": 3}).result()
        c.pull_sparse(SPARSE, IDS).result()  # the rows exist
        yield c


def train(c: PSClient, scale: float) -> None:
    c.push_dense_grad(DENSE, torch.full((6,), scale), 0, 1.0).result()
    c.push_sparse_grad(SPARSE, IDS, torch.full((IDS.numel(), 4), scale), 0, 1.0).result()


def tables(c: PSClient) -> tuple[torch.Tensor, torch.Tensor]:
    return c.pull_dense(DENSE).result().clone(), c.pull_sparse(SPARSE, IDS).result().clone()


def same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def save(c: PSClient, dirname: Path, parent: str | None = None) -> str:
    return save_servers(c, str(dirname), {"optimizers": []}, parent is not None, parent)


def rewrite(save_dir: str, rel: str, record: object) -> None:
    """Replace a file of a committed save and its checksum: damage the checksums cannot see."""
    path = Save(save_dir, SAVES).file(rel)
    torch.save(record, path)
    sums = checksums.read_manifest(save_dir)
    sums[rel] = checksums.file_sum(path)
    checksums.write_manifest(save_dir, sums)


def test_a_load_whose_second_file_is_garbage_changes_no_table(tmp_path: Path) -> None:
    """Finding 2: the dense table (first file) was replaced before the second file failed."""
    with job(n_servers=1) as c:
        train(c, 1.0)
        source = save(c, tmp_path)
        train(c, 0.5)
        before = tables(c)
        table1 = Path(shard_io.shard_dir(source, 0), f"table-{SPARSE}.pt")
        table1.write_bytes(b"garbage" * 50)
        for checked in (True, False):  # with checksums, and a save from before them (checked by loading aside)
            if not checked:
                os.unlink(os.path.join(source, checksums.CHECKSUMS))
            with pytest.raises(PSRemoteError) as caught:
                c.load(source).result()  # one server, one phase: all of its tables or none
            said = str(caught.value)
            assert "parameter server 0" in said and str(table1) in said and "No table changed" in said, said
            assert same(tables(c), before)


def test_a_load_on_two_servers_changes_nothing_when_one_refuses(tmp_path: Path) -> None:
    """Server 0's part is valid, server 1's damaged: server 0 must not apply its part."""
    with job() as c:
        train(c, 1.0)
        saved = tables(c)
        source = save(c, tmp_path)
        train(c, 0.5)
        before = tables(c)
        bad = Path(shard_io.shard_dir(source, 1), f"table-{DENSE}.pt")
        data = bytearray(bad.read_bytes())
        data[len(data) // 2] ^= 0x10  # one bit flipped after the save
        bad.write_bytes(bytes(data))
        with pytest.raises(FleetError, match="does not match its checksum") as caught:
            load_servers(c, source)
        said = str(caught.value)
        assert "parameter server 1" in said and str(bad) in said and "No table changed on any parameter server" in said
        assert same(tables(c), before)
        bad.write_bytes(bytes(data[:-7]))  # truncated: refused by its size before it is read
        with pytest.raises(FleetError, match="truncated or changed since"):
            load_servers(c, source)
        assert same(tables(c), before)
        data[len(data) // 2] ^= 0x10
        bad.write_bytes(bytes(data))  # repaired: the save loads, on both servers
        load_servers(c, source)
        assert same(tables(c), saved)


def test_a_load_failing_on_a_delta_changes_no_table(tmp_path: Path) -> None:
    """Finding 2: a delta whose parent chain loops (or whose optimizer does not match) changed the dense table."""
    with job(n_servers=1) as c:
        train(c, 1.0)
        base = save(c, tmp_path)
        train(c, 0.5)
        delta = save(c, tmp_path, parent=base)
        train(c, 0.25)
        before = tables(c)
        rel = f"ps-server-0/table-{SPARSE}.pt"
        record = torch.load(Save(delta, SAVES).file(rel), weights_only=True)
        assert record["parent"] == base
        rewrite(delta, rel, {**record, "parent": delta})  # a delta on itself
        with pytest.raises(FleetError, match="a cycle") as caught:
            load_servers(c, delta)
        assert "No table changed" in str(caught.value)
        assert same(tables(c), before)
        state = record["state"]["table"]
        wrong = {**record, "state": {**record["state"], "table": {**state, "optimizer": '{"kind": "adam"}'}}}
        rewrite(delta, rel, wrong)
        with pytest.raises(FleetError, match="No table changed"):
            load_servers(c, delta)
        assert same(tables(c), before)
        rewrite(delta, rel, record)
        load_servers(c, delta)
        assert not same(tables(c), before)


def test_a_loop_in_the_saves_parents_never_hangs_a_save(tmp_path: Path) -> None:
    """Finding 1: pruning followed save.json's parents without remembering them: a descendant or the save
    itself as parent spun forever. Now the chain is refused and nothing is pruned."""
    with job(n_servers=1) as c:
        train(c, 1.0)
        base = save(c, tmp_path)
        delta = save(c, tmp_path, parent=base)
        Path(base, MANIFEST).write_text(json.dumps({"parent": delta}))  # the base names its descendant
        done = threading.Event()
        result: list[object] = []

        def saving() -> None:
            try:
                result.append(save(c, tmp_path, parent=delta))
            except BaseException as error:  # noqa: BLE001 - the test reports it
                result.append(error)
            done.set()

        threading.Thread(target=saving, daemon=True).start()
        assert done.wait(20), "save_persistables hung on a loop in the parents"
        assert isinstance(result[0], str), result
        assert persist.resolve(str(tmp_path)) == result[0]
        assert os.path.isdir(base) and os.path.isdir(delta)  # a chain that loops prunes nothing
    for loop in ("self", "two"):  # persist.commit directly: a self-parent and a 2-cycle
        where = tmp_path / loop
        first = persist.begin(str(where))
        persist.commit(str(where), first, None)
        second = persist.begin(str(where))
        persist.commit(str(where), second, second if loop == "self" else first)
        if loop == "two":
            Path(first, MANIFEST).write_text(json.dumps({"parent": second}))
            persist.commit(str(where), persist.begin(str(where)), second)
        assert len(Layout(str(where), SAVES).numbers()) >= 2


class _Fail(Exception):
    pass


@contextmanager
def fail_after(module: object, name: str, k: int) -> Iterator[list[int]]:
    """``module.name`` raises on its call number ``k`` (counted over every thread); the calls made."""
    real = getattr(module, name)
    calls = [0]
    lock = threading.Lock()

    def wrapped(*args, **kwargs):
        with lock:
            calls[0] += 1
            mine = calls[0]
        if mine > k:
            raise _Fail(f"injected after {k} files")
        return real(*args, **kwargs)

    setattr(module, name, wrapped)
    try:
        yield calls
    finally:
        setattr(module, name, real)


def test_a_save_or_load_interrupted_at_any_file_leaves_the_previous_save_and_the_tables(tmp_path: Path) -> None:
    """Fault injection: an exception after k files written (every k), then after k files read (every k)."""
    with job() as c:
        train(c, 1.0)
        saved = tables(c)
        first = save(c, tmp_path)
        train(c, 0.5)
        trained = tables(c)
        with fail_after(atomic, "write_atomic", 1 << 30) as calls:  # how many files one save writes
            save(c, tmp_path / "count")
        writes = calls[0]
        assert writes >= 2 * 2 + 3  # 2 servers x 2 tables, worker 0's file, checksums.json, save.json, latest
        for k in range(writes):
            with fail_after(atomic, "write_atomic", k), pytest.raises((_Fail, FleetError)):
                save(c, tmp_path)
            assert persist.resolve(str(tmp_path)) == first, k
            assert Layout(str(tmp_path), SAVES).numbers() == [SAVES.number(os.path.basename(first))], k
            assert same(tables(c), trained), k
        with fail_after(checksums, "read_verified", 1 << 30) as calls:  # how many files one load reads
            load_servers(c, first)
        reads = calls[0]
        assert reads >= 4 and same(tables(c), saved)
        train(c, 0.5)
        trained = tables(c)
        for k in range(reads):
            with fail_after(checksums, "read_verified", k), pytest.raises(FleetError) as caught:
                load_servers(c, first)
            assert "No table changed on any parameter server" in str(caught.value), (k, caught.value)
            assert same(tables(c), trained), k
        load_servers(c, first)  # the previous save still loads whole
        assert same(tables(c), saved)
        assert Save(first, SAVES).load(WORKER_FILE) == {"optimizers": []}
