"""Checkpoints on an object store (issue 37): every save and load of fleet through s3:// against a real S3 API
(moto's standalone server on 127.0.0.1, s3fs as the client: tests/s3_server.py), and a URL no store can write
refused instead of becoming a local folder named ``s3:``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import fleet
import fleet.api
from fleet.errors import FleetError
from fleet.ps.worker.persistables import load_servers, save_servers
from fleet.storage import atomic, persist
from fleet.storage.layout import STEPS, Layout, LayoutError, Save
from fleet.storage.paths import store_for
from fleet.storage.store import StorageError
from one_process_job import same, snapshot, step
from ps_servers import SGD, client, servers

IDS = torch.arange(-8, 8)


def objects(url: str) -> list[str]:
    """Every object under ``url``, relative to it."""
    import fsspec

    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    root = url.removeprefix("s3://").rstrip("/") + "/"
    return sorted(name.removeprefix(root) for name in fs.find(url))


def test_a_checkpoint_an_export_and_a_fleet_save_go_to_the_bucket_and_load_back(bucket: str, trained, tmp_path) -> None:
    model, opt = trained
    run = f"{bucket}/run"
    os.chdir(tmp_path)  # nothing may land in a local folder named after the URL
    saved = {}
    for number in (1, 2, 3):
        fleet.save_checkpoint(run, model, opt, number, note=f"step {number}")
        saved[number] = snapshot(model, opt)
        step(model, opt)
    assert objects(run) == ["latest"] + [
        f"step-00000000{n}/{name}" for n in (2, 3) for name in ("checksums.json", "meta.pt", "state.pt", "worker-0.pt")
    ]  # the newest two kept, as on a local disk
    assert fleet.load_checkpoint(run, model, opt) == (3, {"note": "step 3"})
    assert same(snapshot(model, opt), saved[3])
    fleet.save({"weight": model.weight.detach()}, f"{bucket}/saved.pt")
    exported = fleet.export_for_inference(f"{bucket}/serving", model)
    assert exported == f"{bucket}/serving/inference.pt"
    served = fleet.load_for_inference(f"{bucket}/serving", torch.nn.Linear(3, 2))
    assert torch.equal(served.weight, model.weight)
    assert objects(bucket) == sorted(["saved.pt", "serving/inference.pt", *(f"run/{o}" for o in objects(run))])
    assert os.listdir(tmp_path) == []


def test_a_url_no_store_can_write_is_an_error_never_a_local_folder(trained, tmp_path, monkeypatch) -> None:
    """Before: save_checkpoint("s3://bucket/run") wrote a local folder named s3: and loaded it back."""
    model, opt = trained
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StorageError, match=r"nosuch://bucket/run: no store knows the scheme nosuch://"):
        fleet.save_checkpoint("nosuch://bucket/run", model, opt, 1)
    monkeypatch.setitem(sys.modules, "fsspec", None)  # fsspec not installed
    for call in (
        lambda: fleet.save_checkpoint("s3://bucket/run", model, opt, 1),
        lambda: fleet.load_checkpoint("s3://bucket/run", model, opt),
        lambda: fleet.save(model.state_dict(), "s3://bucket/model.pt"),
        lambda: fleet.export_for_inference("s3://bucket/serving", model),
        lambda: fleet.file_shard(["s3://bucket/part-00000"]),
    ):
        with pytest.raises(StorageError, match=r"s3://bucket/\S+: .*fsspec, which is not installed.*fleet\[s3\]"):
            call()
    assert os.listdir(tmp_path) == []


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_save_killed_half_way_is_never_seen_and_every_interrupted_save_leaves_the_last_one(
    bucket: str, trained, s3_endpoint: str
) -> None:
    model, opt = trained
    run = f"{bucket}/run"
    fleet.save_checkpoint(run, model, opt, 1)
    first = snapshot(model, opt)
    # A process killed (SIGKILL) right after the save's third object, before checksums.json and latest.
    script = textwrap.dedent(
        f"""
        import os, signal, sys, torch
        sys.path.insert(0, {str(Path(__file__).parents[1])!r})
        import fleet
        from fleet.storage import atomic
        from s3_server import configure
        configure({s3_endpoint!r})
        fleet.init()
        model = torch.nn.Linear(3, 2)
        opt = fleet.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=0.1))
        real, calls = atomic.write_atomic, []
        def write(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)
        atomic.write_atomic = write
        fleet.save_checkpoint({run!r}, model, opt, 2)
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEET_", "RANK", "WORLD_SIZE"))}
    killed = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=200)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    assert "step-000000002/state.pt" in objects(run) and "step-000000002/checksums.json" not in objects(run)
    step(model, opt)
    assert fleet.load_checkpoint(run, model, opt).step == 1  # the half save is not seen
    assert same(snapshot(model, opt), first)
    # Failing after every number of objects: the save before still loads, whole.
    real = atomic.write_atomic
    for k in range(4):
        atomic.write_atomic = failing_after(real, k)
        try:
            with pytest.raises(OSError, match="injected"):
                fleet.save_checkpoint(run, model, opt, 3)
        finally:
            atomic.write_atomic = real
        assert Layout(run, STEPS).resolve().number == 1, k
    fleet.save_checkpoint(run, model, opt, 4)  # the unfinished saves are no obstacle to the next one
    assert Layout(run, STEPS).resolve().number == 4


def failing_after(real, k: int):
    """``real``, raising an OSError (a dropped connection) from its call number ``k + 1`` on."""
    calls = [0]

    def write(*args, **kwargs):
        calls[0] += 1
        if calls[0] > k:
            raise OSError("injected: the connection dropped")
        return real(*args, **kwargs)

    return write


def test_a_damaged_object_is_an_error_naming_it(bucket: str, trained) -> None:
    import fsspec

    model, opt = trained
    run = f"{bucket}/run"
    fleet.save_checkpoint(run, model, opt, 1)
    fs = fsspec.filesystem("s3")
    target = f"{run}/step-000000001/state.pt"
    original = fs.cat_file(target)
    data = bytearray(original)
    data[len(data) // 2] ^= 0xFF  # one bit flipped, same size
    fs.pipe_file(target, bytes(data))
    before = snapshot(model, opt)
    with pytest.raises(LayoutError, match="does not match its checksum") as caught:
        fleet.load_checkpoint(run, model, opt)
    assert target in str(caught.value)
    fs.pipe_file(target, bytes(data[:100]))  # truncated
    with pytest.raises(LayoutError, match="truncated") as caught:
        fleet.load_checkpoint(run, model, opt)
    assert target in str(caught.value)
    fs.pipe_file(target, original)
    fs.rm(f"{run}/step-000000001/meta.pt")
    with pytest.raises(LayoutError) as caught:
        fleet.load_checkpoint(run, model, opt)
    assert f"{run}/step-000000001/meta.pt" in str(caught.value)
    assert same(snapshot(model, opt), before)  # nothing was loaded from a damaged save


def test_a_sharding_checkpoint_with_table_rows_through_the_bucket(bucket: str, monkeypatch) -> None:
    """One process: torch.distributed.checkpoint's shards (FsspecWriter) and the tables' rows.pt in the bucket."""
    from ps_jobs import batch, make_model, make_optimizer

    for name in ("FLEET_ROLE", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)

    def trained(steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        fleet.api._reset_for_tests()
        fleet.init()
        torch.manual_seed(0)
        model = make_model("adam")
        opt = fleet.distributed_optimizer(
            make_optimizer("adam", model.parameters()), fleet.DistributedStrategy(mode="sharding")
        )
        for number in range(steps):
            ids, dense, label = batch(number, 0)
            opt.zero_grad()
            torch.nn.functional.binary_cross_entropy_with_logits(model(ids, dense), label).backward()
            opt.step()
        return model, opt

    def predictions(model: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            ids, dense, _ = batch(99, 0)
            return model(ids, dense)

    try:
        model, opt = trained(2)
        fleet.save_checkpoint(f"{bucket}/run", model, opt, 2)
        want = predictions(model)
        assert {"step-000000002/rows.pt", "step-000000002/sharded/.metadata"} <= set(objects(f"{bucket}/run"))
        model, opt = trained(0)
        assert fleet.load_checkpoint(f"{bucket}/run", model, opt).step == 2
        assert torch.equal(predictions(model), want)
    finally:
        fleet.api._reset_for_tests()


@pytest.fixture
def own_bucket(bucket: str) -> Iterator[str]:
    """A bucket on an S3 server of this test's own. On the server the other tests of this file used before, the
    two parameter servers' concurrent LOAD requests hung: moto's server itself stopped answering (a plain HTTP
    request to it timed out too), which it never did fresh; a server of its own sidesteps that test-server fault."""
    import fsspec.config

    from s3_server import configure, moto_server, new_bucket

    with moto_server() as endpoint:
        configure(endpoint)
        yield new_bucket()
    fsspec.config.conf.pop("s3", None)


def test_parameter_server_saves_with_a_delta_chain_in_the_bucket(own_bucket: str) -> None:
    """Base, delta, delta: the servers write their shards into the bucket, worker 0 commits; a load of the newest
    replays the chain; a damaged delta is named and changes no table."""
    import fsspec

    run = f"{own_bucket}/persist"
    with servers(2, 1, timeout_s=60.0) as srvs, client(srvs, 0, timeout_s=60.0) as c:  # a bucket is slower
        c.create_dense(0, torch.arange(6.0), {"optimizer": SGD, "update": "async"}).result()
        c.create_sparse(1, {"dim": 4, "optimizer": SGD, "update": "async", "seed": 3}).result()
        c.pull_sparse(1, IDS).result()

        def train(scale: float, ids: torch.Tensor = IDS) -> None:
            c.push_dense_grad(0, torch.full((6,), scale), 0, 1.0).result()
            c.push_sparse_grad(1, ids, torch.full((ids.numel(), 4), scale), 0, 1.0).result()

        def tables() -> tuple[torch.Tensor, torch.Tensor]:
            return c.pull_dense(0).result().clone(), c.pull_sparse(1, IDS).result().clone()

        train(1.0)
        base = save_servers(c, run, {"optimizers": []})
        train(0.5, IDS[:4])
        delta1 = save_servers(c, run, {"optimizers": []}, True, base)
        train(0.25, IDS[4:6])
        delta2 = save_servers(c, run, {"optimizers": []}, True, delta1)
        want = tables()
        assert base.startswith(f"{run}/save-") and persist.resolve(run) == delta2
        assert Save(delta2, persist.SAVES).parent() == delta1
        train(2.0)
        load_servers(c, run and persist.resolve(run))
        assert all(torch.equal(a, b) for a, b in zip(tables(), want, strict=True))

        fs = fsspec.filesystem("s3")
        target = f"{delta1}/ps-server-1/table-1.pt"
        data = bytearray(fs.cat_file(target))
        data[-20] ^= 0xFF
        fs.pipe_file(target, bytes(data))
        train(2.0)
        changed = tables()
        with pytest.raises(FleetError, match="No table changed on any parameter server") as caught:
            load_servers(c, delta2)
        assert target in str(caught.value)
        assert all(torch.equal(a, b) for a, b in zip(tables(), changed, strict=True))


def test_a_store_is_chosen_by_the_path(tmp_path) -> None:
    local = store_for(str(tmp_path))
    assert store_for(tmp_path) is local and store_for("relative/dir") is local
    assert local.join(str(tmp_path), "a") == os.path.join(str(tmp_path), "a")
    pytest.importorskip("fsspec")
    memory = store_for("memory://fleet-test/run")
    assert type(memory).__name__ == "FsspecStore"
    assert memory.join("memory://fleet-test/run", "latest") == "memory://fleet-test/run/latest"
    assert memory.split("memory://fleet-test/run/step-1") == ("memory://fleet-test/run", "step-1")


def test_a_checkpoint_on_an_fsspec_filesystem_with_folders_and_renames(trained) -> None:
    """memory:// (fsspec's, in this process): the path for stores that are not object stores (HDFS, mounts):
    uploads under a temporary name, then moved."""
    pytest.importorskip("fsspec")
    model, opt = trained
    run = "memory://fleet-test-checkpoint/run"
    store = store_for(run)
    try:
        fleet.save_checkpoint(run, model, opt, 1)
        saved = snapshot(model, opt)
        step(model, opt)
        assert fleet.load_checkpoint(run, model, opt).step == 1 and same(snapshot(model, opt), saved)
        assert sorted(store.list(run)) == ["latest", "step-000000001"]
        assert not [name for name, _ in store.walk(run) if ".tmp" in name]
    finally:
        store.delete("memory://fleet-test-checkpoint")


def test_a_url_that_pathlib_collapsed_is_refused(trained, tmp_path, monkeypatch) -> None:
    model, opt = trained
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StorageError, match=r"s3:/bucket/run looks like a s3:// URL whose '//' was lost"):
        fleet.save_checkpoint(str(Path("s3://bucket/run")), model, opt, 1)
    with pytest.raises(StorageError, match="pass the URL as a str"):
        fleet.save(model.state_dict(), Path("s3://bucket/model.pt"))
    assert os.listdir(tmp_path) == []
