"""Parameter server + client: update modes, sharding, bad input, auth, failures, checkpoints.

Servers run in threads (or, for the kill tests, a subprocess) on 127.0.0.1
with ephemeral ports; simulated workers are PSClients in threads.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time

import pytest
import torch
import zmq

from fleet.ps.client.client import PSClient, shard_ranges, sparse_owner
from fleet.ps.protocol.errors import PSAuthError, PSRemoteError, PSServerUnavailable
from fleet.ps.protocol.wire import Message, Op, Status, encode
from ps_servers import SECRET, SGD, ask, client, raw_socket, run_workers, server_process, servers


@pytest.mark.timeout(60)
def test_helpers_shard_evenly_and_own_negative_ids() -> None:
    assert shard_ranges(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert shard_ranges(2, 3) == [(0, 1), (1, 2), (2, 2)]
    assert sparse_owner(torch.tensor([-1, -4, 5, 6]), 3).tolist() == [2, 2, 2, 0]


@pytest.mark.timeout(60)
def test_async_applies_each_push_on_arrival() -> None:
    with servers(1, 1) as srvs, client(srvs, 0) as c:
        c.create_dense(1, torch.zeros(4), {"optimizer": SGD, "update": "async"}).result()
        for step in range(3):
            c.push_dense_grad(1, torch.ones(4), step, 0.5).result()
            got = c.pull_dense(1).result()
            assert torch.allclose(got, torch.full((4,), -0.5 * (step + 1))) and got.ps_version == step + 1
        stats = c.stats().result()[0]
        assert stats["ops"]["PUSH_DENSE_GRAD"] == 3 and stats["tables"]["1"]["version"] == 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [2, 3])
def test_sync_applies_the_average_once_and_answers_deferred_pulls(num_workers: int) -> None:
    with servers(1, num_workers) as srvs:
        config = {"optimizer": SGD, "update": "sync", "backup_workers": 0, "size": 3}

        def worker(w: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, dict]:
            with client(srvs, w) as c:
                c.create_dense(7, torch.zeros(3) if w == 0 else None, config).result()
                c.create_sparse(8, {"dim": 2, "optimizer": SGD, "update": "sync"}).result()
                seen, rows = [], []
                for step in range(2):
                    seen.append(c.pull_dense(7, min_version=step).result())
                    rows.append(c.pull_sparse(8, torch.tensor([5]), min_version=step).result())
                    c.push_dense_grad(7, torch.full((3,), float(w + 1)), step, 1.0).result()
                    ids = torch.tensor([5, 5]) if w == 0 else torch.tensor([5])
                    c.push_sparse_grad(8, ids, torch.ones(ids.numel(), 2), step, 1.0).result()
                seen.append(c.pull_dense(7, min_version=2).result())
                last = c.pull_sparse(8, torch.tensor([5]), min_version=2).result()
                c.barrier().result()
                return seen, rows[0], last, c.stats().result()[0]

        results = run_workers(worker, num_workers)
        mean = sum(range(1, num_workers + 1)) / num_workers
        for seen, _, _, _ in results:  # every worker saw the same versions: 0, one averaged step, two
            assert [t.ps_version for t in seen] == [0, 1, 2]
            assert torch.allclose(seen[1], torch.full((3,), -mean))
            assert torch.allclose(seen[2], torch.full((3,), -2 * mean))
        _, first, last, stats = results[0]
        # row 5, per step: worker 0 sent it twice, the others once -> summed, divided by the N pushes
        assert torch.allclose(last, first - 2 * (num_workers + 1) / num_workers)
        assert stats["tables"]["8"]["version"] == 2 and stats["tables"]["7"]["version"] == 2
        assert stats["ops"]["PUSH_DENSE_GRAD"] == 2 * num_workers
        assert stats["table_ops"]["8"]["PUSH_SPARSE_GRAD"] == 2 * num_workers


@pytest.mark.timeout(60)
def test_backup_worker_drops_the_late_push_and_counts_it() -> None:
    with servers(1, 2) as srvs, client(srvs, 0) as fast, client(srvs, 1) as slow:
        config = {"optimizer": SGD, "update": "sync", "backup_workers": 1, "size": 2}
        fast.create_dense(1, torch.zeros(2), config).result()
        slow.create_dense(1, None, config).result()
        fast.push_dense_grad(1, torch.ones(2), 0, 1.0).result()  # N - b = 1 push closes step 0
        assert fast.pull_dense(1, min_version=1).result().ps_version == 1
        slow.push_dense_grad(1, torch.full((2,), 100.0), 0, 1.0).result()  # late for step 0: dropped
        assert slow.stale_pushes == 1
        got = slow.pull_dense(1).result()
        assert torch.allclose(got, torch.full((2,), -1.0)) and got.ps_version == 1
        stats = fast.stats().result()[0]
        assert stats["stale_dropped"] == {"1": 1} and stats["tables"]["1"]["stale_dropped"] == {"1": 1}
        with pytest.raises(PSRemoteError, match="step 5 but the shard is at version 1"):
            slow.push_dense_grad(1, torch.ones(2), 5, 1.0).result()


@pytest.mark.timeout(60)
def test_sync_pull_times_out_naming_the_missing_worker() -> None:
    with servers(1, 2) as srvs, client(srvs, 0, timeout_s=1.0) as c:
        c.create_dense(1, torch.zeros(2), {"optimizer": SGD, "update": "sync", "size": 2}).result()
        c.push_dense_grad(1, torch.ones(2), 0, 1.0).result()
        t0 = time.monotonic()
        with pytest.raises(PSRemoteError, match=r"missing pushes for step 0 from workers \[1\]"):
            c.pull_dense(1, min_version=1).result()
        assert (
            time.monotonic() - t0 < 2.0
        )  # the server's answer, not the client's deadline (that would be PSServerUnavailable)


@pytest.mark.timeout(60)
def test_geo_adds_deltas_and_counts_pushes() -> None:
    with servers(1, 2) as srvs, client(srvs, 0) as a, client(srvs, 1) as b:
        a.create_dense(1, torch.ones(3), {"optimizer": SGD, "update": "geo"}).result()
        a.create_sparse(2, {"dim": 2, "optimizer": SGD, "update": "geo"}).result()
        b.create_sparse(2, {"dim": 2, "optimizer": SGD, "update": "geo"}).result()
        b.create_dense(1, None, {"optimizer": SGD, "update": "geo", "size": 3}).result()
        base = a.pull_sparse(2, torch.tensor([3, 4])).result().clone()
        futures = [w.push_dense_delta(1, torch.full((3,), 0.5)) for w in (a, b)]
        futures += [a.push_sparse_delta(2, torch.tensor([3, 4]), torch.ones(2, 2))]
        for f in futures:
            f.result()
        assert torch.allclose(a.pull_dense(1).result(), torch.full((3,), 2.0))
        assert torch.allclose(b.pull_sparse(2, torch.tensor([4, 3])).result(), base.flip(0) + 1)
        with pytest.raises(PSRemoteError, match="geo mode: push deltas"):
            a.push_dense_grad(1, torch.ones(3), 0, 0.1).result()
        stats = a.stats().result()[0]
        assert stats["table_ops"]["1"]["PUSH_DENSE_DELTA"] == 2 and stats["table_ops"]["2"]["PUSH_SPARSE_DELTA"] == 1


@pytest.mark.timeout(60)
def test_two_servers_shard_dense_and_sparse_and_reassemble() -> None:
    with servers(2, 1) as srvs, client(srvs, 0) as c:
        init = torch.arange(11, dtype=torch.float32)
        c.create_dense(1, init, {"optimizer": SGD, "update": "async"}).result()
        c.create_sparse(2, {"dim": 3, "optimizer": SGD, "update": "async"}).result()
        assert torch.equal(c.pull_dense(1).result(), init)
        c.push_dense_grad(1, torch.arange(11, dtype=torch.float32), 0, 1.0).result()
        assert torch.equal(c.pull_dense(1).result(), torch.zeros(11))
        ids = torch.tensor([10, -3, 7, 2, 4, 1_000_001])
        rows = c.pull_sparse(2, ids).result()
        c.push_sparse_grad(2, ids, torch.arange(18, dtype=torch.float32).view(6, 3), 0, 1.0).result()
        order = torch.tensor([3, 0, 5, 1])
        after = c.pull_sparse(2, ids[order]).result()
        assert torch.allclose(after, rows[order] - torch.arange(18, dtype=torch.float32).view(6, 3)[order])
        stats = c.stats().result()
        assert [s["tables"]["1"]["size"] for s in stats] == [6, 5]
        assert [s["tables"]["2"]["rows"] for s in stats] == [3, 3]  # even ids on server 0, odd on 1


@pytest.mark.timeout(60)
def test_malformed_and_wrong_requests_get_errors_and_the_server_keeps_serving() -> None:
    ctx = zmq.Context()
    with servers(1, 2) as srvs, client(srvs, 1) as good:
        good.create_dense(1, torch.zeros(4), {"optimizer": SGD, "update": "async"}).result()
        good.create_sparse(2, {"dim": 2, "optimizer": SGD, "update": "async"}).result()
        raw = raw_socket(ctx, srvs[0].endpoint)
        ok_push = encode(Message(Op.PUSH_DENSE_GRAD, table=1, request_id=5, tensors=[torch.ones(4)], lr=0.1))
        cases = [
            ([b"garbage"], "truncated header"),
            ([b"JUNK" + bytes(ok_push[0])[4:], b"", b"x"], "bad magic"),
            ([ok_push[0], ok_push[1], b"\0" * 15], "15 data bytes"),
            ([bytes(ok_push[0])[:5] + b"\x63" + bytes(ok_push[0])[6:], *ok_push[1:]], "unknown op 99"),
            (encode(Message(Op.PULL_DENSE, table=9, request_id=6)), "unknown table 9"),
            (encode(Message(Op.PUSH_DENSE_GRAD, table=1, request_id=7, tensors=[torch.ones(5)])), "shape [5]"),
            (encode(Message(Op.PUSH_DENSE_GRAD, table=1, tensors=[torch.ones(4, dtype=torch.float64)])), "float64"),
            (encode(Message(Op.PULL_SPARSE, table=2, tensors=[torch.ones(2, dtype=torch.int32)])), "int32"),
            (encode(Message(Op.PULL_SPARSE, table=1, tensors=[torch.ones(2, dtype=torch.int64)])), "is dense"),
            (encode(Message(Op.PUSH_SPARSE_GRAD, table=2, tensors=[torch.arange(2), torch.ones(2, 3)])), "expected"),
            (encode(Message(Op.HELLO, peer=7)), "worker index 7"),
            (encode(Message(Op.CREATE_DENSE, table=3, blob=b"{not json")), "not UTF-8 JSON"),
            (encode(Message(Op.CREATE_DENSE, table=1, blob=b'{"size": 4}', tensors=[torch.ones(4)])), "conflicting"),
        ]
        for frames, needle in cases:
            reply = ask(raw, frames)
            assert reply.status == Status.ERROR and needle in reply.text(), (needle, reply.text())
            good.push_dense_grad(1, torch.ones(4), 0, 1.0).result()  # the other client is still served
        assert "truncated header: 0 bytes" in ask(raw, [b""]).text()  # answered with request id 0
        assert torch.allclose(good.pull_dense(1).result(), torch.full((4,), -float(len(cases))))
        stats = good.stats().result()[0]
        assert stats["malformed"] == 5 and stats["errors"] >= len(cases)
        raw.close()
    ctx.term()


@pytest.mark.timeout(60)
def test_wrong_secret_is_refused_and_others_are_served() -> None:
    with servers(1, 2) as srvs, client(srvs, 0) as good:
        good.create_dense(1, torch.zeros(2), {"optimizer": SGD, "update": "async"}).result()
        with client(srvs, 1, secret=b"not-the-secret") as bad:
            t0 = time.monotonic()
            with pytest.raises(PSAuthError, match=r"parameter server 0 at 127\.0\.0\.1:\d+ refused"):
                bad.hello().result()
            assert time.monotonic() - t0 < 2.5  # from the handshake, not from the 3 s deadline
            bad.close(stop_servers_for_me=False)
        assert good.pull_dense(1).result().shape == (2,)
        assert good.stats().result()[0]["auth_rejected"] >= 1


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["kill", "freeze"])
def test_a_dead_or_frozen_server_becomes_an_error_naming_it(how: str) -> None:
    with servers(1, 1) as srvs, server_process("--workers", "1", "--timeout", "5", index=1) as (proc, endpoint):
        c = PSClient([srvs[0].endpoint, endpoint], SECRET, 0, timeout_s=2.0)
        c.create_dense(1, torch.zeros(10), {"optimizer": SGD, "update": "async"}).result()
        os.kill(proc.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(PSServerUnavailable) as info:
            c.pull_dense(1).result()
        elapsed = time.monotonic() - t0
        assert info.value.server_index == 1 and info.value.endpoint == endpoint
        assert f"parameter server 1 at {endpoint}" in str(info.value) and "PULL_DENSE" in str(info.value)
        # the 2 s deadline (or sooner when the connection drop is seen), with the margin of a loaded machine: a
        # clean-clone run measured 3.003 s against a bound of 3.0 (the message below names the deadline itself)
        assert elapsed < 6.0
        if how == "freeze":
            assert "did not answer PULL_DENSE within 2.0 s" in str(info.value)
            os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        c.close()  # bounded even though a server is gone
        assert time.monotonic() - t0 < 4.0


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_server_process_exits_after_every_worker_stopped() -> None:
    with server_process("--workers", "2", "--timeout", "5") as (proc, endpoint):
        clients = [PSClient([endpoint], SECRET, w, timeout_s=3.0) for w in range(2)]
        clients[0].create_sparse(1, {"dim": 4, "optimizer": SGD}).result()
        clients[0].close()
        assert proc.poll() is None
        clients[1].close()
        assert proc.wait(30) == 0  # an exit within seconds; 30 s bounds it on a loaded 2-core machine


@pytest.mark.timeout(60)
def test_create_waits_for_the_creator_and_barrier_releases_everyone() -> None:
    with servers(2, 2) as srvs, client(srvs, 0) as w0, client(srvs, 1) as w1:
        config = {"optimizer": SGD, "update": "async", "size": 5}
        waiting = w1.create_dense(1, None, config)  # worker 1 arrives first
        time.sleep(0.2)
        assert not waiting.done()
        w0.create_dense(1, torch.arange(5.0), config).result()
        waiting.result()
        assert torch.equal(w1.pull_dense(1).result(), torch.arange(5.0))
        first = w0.barrier()
        time.sleep(0.2)
        assert not first.done()
        w1.barrier().result()
        first.result()


@pytest.mark.timeout(60)
def test_save_and_load_round_trip(tmp_path) -> None:
    dense_cfg = {"optimizer": {"kind": "adam", "lr": 0.01}, "update": "async"}
    sparse_cfg = {"dim": 4, "optimizer": SGD, "update": "async", "seed": 3}
    ids = torch.tensor([1, 2, 3, 40, -5])
    with servers(2, 1) as srvs, client(srvs, 0) as c:
        c.create_dense(1, torch.randn(9), dense_cfg).result()
        c.create_sparse(2, sparse_cfg).result()
        c.push_dense_grad(1, torch.randn(9), 0, 0.01).result()
        c.push_sparse_grad(2, ids, torch.randn(5, 4), 0, 0.5).result()
        dense, rows = c.pull_dense(1).result().clone(), c.pull_sparse(2, ids).result().clone()
        c.save(str(tmp_path)).result()
    assert sorted(os.listdir(tmp_path)) == ["ps-server-0", "ps-server-1"]
    with servers(2, 1) as srvs, client(srvs, 0) as c:
        c.load(str(tmp_path)).result()
        c.create_dense(1, None, {**dense_cfg, "size": 9}).result()  # load created it; learn the layout
        c.create_sparse(2, sparse_cfg).result()
        assert torch.equal(c.pull_dense(1).result(), dense)
        assert torch.equal(c.pull_sparse(2, ids).result(), rows)
        assert c.stats().result()[0]["tables"]["1"]["version"] == 1
        with pytest.raises(PSRemoteError, match="does not exist"):
            c.load(str(tmp_path / "nowhere")).result()


def test_a_save_on_a_full_disk_is_said_in_one_line_without_a_traceback(tmp_path, monkeypatch, caplog) -> None:
    from fleet.errors import DiskFullError
    from fleet.ps.server import shard_io

    def full(dirname, *args, **kwargs):
        raise DiskFullError(os.path.join(dirname, "ps-server-0", "table-1.pt"))

    monkeypatch.setattr(shard_io, "save_shards", full)
    caplog.set_level(logging.ERROR, logger="fleet")
    with servers(1, 1) as srvs, client(srvs, 0) as c:
        c.create_dense(1, torch.randn(4), {"optimizer": SGD, "update": "async"}).result()
        with pytest.raises(PSRemoteError, match="No space left on device") as raised:
            c.save(str(tmp_path)).result()
        assert str(tmp_path / "ps-server-0" / "table-1.pt") in str(raised.value)
        assert torch.equal(c.pull_dense(1).result(), c.pull_dense(1).result())  # still serving
        counts = c.stats().result()[0]
    said = [r.getMessage() for r in caplog.records]
    assert any("No space left on device" in m for m in said), said
    assert not any("Traceback" in m or r.exc_info for m, r in zip(said, caplog.records, strict=True)), said
    assert "disk_full" in json.dumps(counts), counts


@pytest.mark.timeout(60)
def test_sync_sparse_on_two_servers_when_a_worker_leaves_a_shard_untouched() -> None:
    """Pushes (and versioned pulls) reach every shard, so versions line up even for shards a worker skips."""
    with servers(2, 2) as srvs:
        cfg = {"dim": 2, "optimizer": SGD, "update": "sync"}

        def worker(w: int) -> list[dict]:
            with client(srvs, w) as c:
                c.create_sparse(1, cfg).result()
                ids = torch.tensor([0, 2, 4]) if w == 0 else torch.tensor([1, 3])  # server 0 only / server 1 only
                for step in range(3):
                    c.pull_sparse(1, ids, min_version=step).result()
                    c.push_sparse_grad(1, ids, torch.ones(ids.numel(), 2), step, 0.1).result()
                c.barrier().result()
                return c.stats().result()

        stats = run_workers(worker, 2)[0]
        assert [s["tables"]["1"]["version"] for s in stats] == [3, 3]
        assert [s["table_ops"]["1"]["PUSH_SPARSE_GRAD"] for s in stats] == [6, 6]


@pytest.mark.timeout(60)
def test_many_requests_in_flight_and_backpressure() -> None:
    with servers(2, 1) as srvs, PSClient([s.endpoint for s in srvs], SECRET, 0, 3.0, max_in_flight=2) as c:
        c.create_dense(1, torch.zeros(1000), {"optimizer": SGD, "update": "async"}).result()
        futures = [c.push_dense_grad(1, torch.ones(1000), 0, 1.0) for _ in range(50)]
        pulls = [c.pull_dense(1) for _ in range(5)]
        for f in futures + pulls:
            f.result()
        assert torch.allclose(c.pull_dense(1).result(), torch.full((1000,), -50.0))
        assert [s["ops"]["PUSH_DENSE_GRAD"] for s in c.stats().result()] == [50, 50]


@pytest.mark.timeout(60)
def test_sync_step_does_not_wait_for_a_worker_parked_at_the_barrier() -> None:
    """Uneven data: worker 0 runs out after one step; worker 1's second step applies without it."""
    with servers(1, 2) as srvs, client(srvs, 0) as w0, client(srvs, 1) as w1:
        config = {"optimizer": SGD, "update": "sync", "size": 2}
        w0.create_dense(1, torch.zeros(2), config).result()
        w1.create_dense(1, None, config).result()
        for w in (w0, w1):
            w.push_dense_grad(1, torch.ones(2), 0, 1.0).result()
        done = w0.barrier()  # worker 0 is finished
        w1.pull_dense(1, min_version=1).result()
        w1.push_dense_grad(1, torch.full((2,), 3.0), 1, 1.0).result()
        got = w1.pull_dense(1, min_version=2).result()
        assert got.ps_version == 2 and torch.allclose(got, torch.full((2,), -4.0))  # -1 (average), then -3 alone
        w1.barrier().result()
        done.result()
