"""The parameter-server transport's bounds: before authentication, per request, and while another worker waits.

- A stranger's ZMTP handshake declaring a 200 MiB frame is cut off at the header, so 8 of them
  barely move the server's memory (its RSS, read from /proc), and real workers are served after.
- A request over the limits gets an error naming the limit and the setting; the client splits
  big sparse batches so that it never sends one, and the tables end exactly as with one request
  (async, sync, geo; clicks, admission counts, versions and stale counts once per push).
- One worker's huge pull does not starve another's small requests.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time

import pytest
import torch
import zmq

from fleet.ps.client.client import PSClient
from fleet.ps.protocol.errors import PSRemoteError, PSServerUnavailable
from fleet.ps.protocol.limits import RequestLimits
from fleet.ps.protocol.wire import FRAME_BYTES, MAX_WIRE_FRAME, Message, Op, Status, encode
from fleet.ps.server import aggregator as agg
from fleet.ps.server.loop import ParameterServer
from ps_servers import SECRET, ask, raw_socket, server_process, servers

MiB = 1 << 20
ADAGRAD = {"kind": "adagrad", "lr": 0.1}


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")


#: ZMTP 3.0 greeting of a client asking for PLAIN: signature, version 3.0, mechanism, as-server 0, filler
GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"PLAIN".ljust(20, b"\0") + b"\0" + bytes(31)


def declare_and_stream(endpoint: str, declared: int, send: int) -> int:
    """A stranger: greeting, a long command frame declaring ``declared`` bytes, then filler; bytes sent."""
    host, _, port = endpoint.rpartition(":")
    sent = 0
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        try:
            sock.sendall(GREETING + bytes([0x06]) + declared.to_bytes(8, "big"))  # 0x06: long command frame
            chunk = bytes(1 << 20)
            while sent < send:
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError:  # the server cut the connection: what it should do
            pass
    return sent


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_strangers_declaring_huge_frames_cannot_grow_the_server() -> None:
    with server_process("--workers", "1", "--timeout", "10") as (proc, endpoint):
        with PSClient([endpoint], SECRET, 0, timeout_s=10.0) as warm:  # its own memory in use first
            warm.create_sparse(1, {"dim": 8, "optimizer": ADAGRAD}).result()
            warm.pull_sparse(1, torch.arange(1000)).result()
            time.sleep(0.3)
            before = rss_mib(proc.pid)
            peak = [before]
            done = threading.Event()

            def sample() -> None:
                while not done.is_set():
                    peak[0] = max(peak[0], rss_mib(proc.pid))
                    time.sleep(0.02)

            sampler = threading.Thread(target=sample)
            sampler.start()
            sent = [0] * 8
            # 24 MiB each: 192 MiB would reach a server that took the declared size at its word
            attackers = [
                threading.Thread(
                    target=lambda i=i: sent.__setitem__(i, declare_and_stream(endpoint, 200 * MiB, 24 * MiB))
                )
                for i in range(8)
            ]
            for t in attackers:
                t.start()
            for t in attackers:
                t.join(30)
            time.sleep(0.5)
            done.set()
            sampler.join()
            growth = peak[0] - before
            assert growth < 64, f"8 strangers grew the server by {growth:.1f} MiB (sent {sum(sent) / MiB:.0f} MiB)"
            assert sum(sent) < 8 * 24 * MiB  # the server hung up on them
            rows = warm.pull_sparse(1, torch.arange(500, 1500)).result()  # and still serves the worker
            assert rows.shape == (1000, 8)


@pytest.mark.timeout(60)
def test_requests_over_the_limits_get_an_error_naming_them() -> None:
    limits = RequestLimits(max_ids=100, max_bytes=64 * 1024)
    ctx = zmq.Context()
    with servers(1, 1, 5.0, limits) as srvs, PSClient([srvs[0].endpoint], SECRET, 0, 5.0, limits=limits) as good:
        good.create_sparse(2, {"dim": 4, "optimizer": ADAGRAD}).result()
        raw = raw_socket(ctx, srvs[0].endpoint)
        cases = [
            (Message(Op.PULL_SPARSE, table=2, request_id=1, tensors=[torch.arange(101)]), "carries 101 ids"),
            (Message(Op.PUSH_SPARSE_GRAD, table=2, request_id=2, tensors=[torch.arange(101), torch.ones(101, 4)]), "at most 100"),
            (Message(Op.ALL_REDUCE, request_id=3, tensors=[torch.ones(20000, dtype=torch.float64)]), "carries 160,000 bytes"),
        ]  # fmt: skip
        for msg, needle in cases:
            reply = ask(raw, encode(msg))
            assert reply.status == Status.ERROR and needle in reply.text(), reply.text()
            assert "max_request_ids = 100" in reply.text() and "max_request_mb" in reply.text()
        # A frame over the cap (MAX_WIRE_FRAME) from an authenticated peer: ZeroMQ drops the connection, nothing else.
        raw.send_multipart(encode(Message(Op.HELLO, request_id=4)) + [bytes(MAX_WIRE_FRAME + 1)])
        assert not raw.poll(500)
        # The client splits: 1000 ids (a call over the limit) go in pieces of 100 // 16 = 6 ids, and the
        # server only ever saw requests under the limit.
        assert limits.piece_ids(4) == 6
        assert good.pull_sparse(2, torch.arange(1000)).result().shape == (1000, 4)
        stats = good.stats().result()[0]
        assert stats["over_limit"] == 1 and stats["table_ops"]["2"]["PULL_SPARSE"] == 1 + 167
        raw.close()
        # A server with smaller limits than the client's: the error says which setting to align.
        with PSClient([srvs[0].endpoint], SECRET, 0, 5.0) as default_limits:
            default_limits._sparse[2] = (4, "async")
            with pytest.raises(PSRemoteError, match=r"carries 1,000 ids .* run servers and workers with the same"):
                default_limits.pull_sparse(2, torch.arange(1000)).result()
            default_limits.close(stop_servers_for_me=False)
    ctx.term()


def _table_states(srvs: list[ParameterServer], table: int) -> list[dict]:
    return [{k: v for k, v in s._shards[table].table.state_dict().items()} for s in srvs]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _run(limits: RequestLimits, body) -> tuple[list, list, list]:
    """``body(clients)`` on two fresh servers with two workers using ``limits``; (tables, stats, stale counts)."""
    with servers(2, 2, 5.0, limits) as srvs:
        clients = [PSClient([s.endpoint for s in srvs], SECRET, w, 5.0, limits=limits) for w in range(2)]
        try:
            body(clients)
            stats = clients[0].stats().result()
            stale = [c.stale_pushes for c in clients]
            tables = {t: _table_states(srvs, t) for t in sorted(srvs[0]._shards)}
        finally:
            for c in clients:
                c.close()
    return tables, [{k: s[k] for k in ("tables", "stale_dropped")} for s in stats], stale


def _batch(step: int, worker: int, n: int = 90) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + worker)
    ids = torch.randint(0, 60, (n,), generator=g) * 7919 - 300  # repeats within a push, negative ids too
    return ids, torch.randn(n, 4, generator=g), torch.rand(n, generator=g)


def _workload(clients: list[PSClient]) -> None:
    life = {"entry": {"kind": "count", "min_count": 2, "sketch_width": 1024}, "ttl_steps": 3}
    a, b = clients
    for c in clients:
        c.create_sparse(1, {"dim": 4, "optimizer": ADAGRAD, "update": "async", "seed": 5, **life}).result()
        c.create_sparse(2, {"dim": 4, "optimizer": {"kind": "adam", "lr": 0.01}, "update": "sync"}).result()
        c.create_sparse(3, {"dim": 4, "optimizer": ADAGRAD, "update": "geo"}).result()
        c.create_sparse(4, {"dim": 4, "optimizer": ADAGRAD, "update": "async"}).result()
    for step in range(1, 4):  # async with a life cycle: admission, clicks, TTL
        ids, grads, clicks = _batch(step, 0)
        a.pull_sparse(1, torch.unique(ids)).result()
        a.push_sparse_grad(1, ids, grads, step, 0.1, clicks).result()
    for step in range(3):  # sync: both workers' pieces make one step each
        futures = []
        for w, c in enumerate(clients):
            c.pull_sparse(2, torch.unique(_batch(step, w)[0]), min_version=step).result()
            ids, grads, _ = _batch(step, w)
            futures.append(c.push_sparse_grad(2, ids, grads, step, 0.1))
        for f in futures:
            f.result()
    b.pull_sparse(2, torch.arange(50), min_version=3).result()
    a.push_sparse_grad(2, *_batch(0, 0)[:2], 0, 0.1).result()  # a late push: stale, counted once
    ids, deltas, _ = _batch(7, 1)
    b.push_sparse_delta(3, torch.unique(ids), deltas[: torch.unique(ids).numel()], 4).result()
    heavy = torch.cat([torch.full((30,), 11), torch.arange(40)])  # one id more often than a piece holds
    b.push_sparse_grad(4, heavy, torch.randn(70, 4, generator=torch.Generator().manual_seed(9)), 5, 0.1).result()


@pytest.mark.timeout(120)
def test_split_requests_leave_the_tables_exactly_as_whole_ones() -> None:
    whole = _run(RequestLimits(), _workload)
    # 7: pieces of one id (a huge batch's pieces are 1/16 of the limit), an id repeated up to 7 times in a
    # piece of its own, more often summed here first; 40: pieces of 2, the 30-fold id whole in one piece
    for most in (7, 40):
        split = _run(RequestLimits(max_ids=most), _workload)
        assert _same(split[0], whole[0])  # every table on every server: rows, optimizer state, statistics, sketch
        assert split[1] == whole[1]  # versions, row counts, dropped gradients, evictions, stale counts
        assert split[2] == whole[2] == [2, 0]  # the late push, stale on each of the 2 servers
    assert whole[1][0]["tables"]["1"]["dropped_gradients"] > 0 and whole[1][0]["tables"]["1"]["version"] == 3


def test_a_sync_step_closed_by_backup_workers_keeps_none_of_a_late_split_push() -> None:
    config = {"dim": 2, "optimizer": {"kind": "sgd", "lr": 1.0}, "update": "sync", "backup_workers": 1}
    shard = agg.SparseShard(0, config, 2)
    shard.pull(torch.arange(4))
    before = shard.pull(torch.arange(4)).clone()
    assert shard.push_grad(0, 0, torch.tensor([0, 1]), torch.ones(2, 2), 1.0, more=True)  # worker 0: first piece
    assert shard.push_grad(1, 0, torch.tensor([2]), torch.ones(1, 2), 1.0)  # worker 1 completes the step alone
    assert shard.maybe_step({0, 1}, set()) and shard.version == 1
    after = shard.pull(torch.arange(4))
    assert (
        torch.equal(after[:2], before[:2]) and torch.equal(after[2], before[2] - 1) and torch.equal(after[3], before[3])
    )
    assert not shard.push_grad(0, 0, torch.tensor([3]), torch.ones(1, 2), 1.0)  # its last piece: stale
    assert shard.stale_dropped == {0: 1} and torch.equal(shard.pull(torch.arange(4)), after)


def test_a_sync_sparse_step_does_not_depend_on_the_order_in_which_pushes_arrive() -> None:
    """Workers' pushes are summed in worker order: several terms per id are not associative in float32."""
    config = {"dim": 3, "optimizer": {"kind": "sgd", "lr": 1.0}, "update": "sync"}
    g = torch.Generator().manual_seed(3)
    pushes = [(torch.randint(0, 5, (40,), generator=g), torch.randn(40, 3, generator=g) * 1e4**w) for w in range(3)]
    results = []
    for order in ((0, 1, 2), (2, 0, 1), (1, 2, 0)):
        shard = agg.SparseShard(0, config, 3)
        shard.pull(torch.arange(5))
        for w in order:
            assert shard.push_grad(w, 0, *pushes[w], 1.0)
        assert shard.maybe_step({0, 1, 2}, set())
        results.append(shard.pull(torch.arange(5)))
    assert all(torch.equal(r, results[0]) for r in results[1:])


@pytest.mark.timeout(60)
def test_dense_tables_larger_than_a_frame_round_trip() -> None:
    values = torch.randn(FRAME_BYTES // 4 * 2 + 123)  # three frames each way
    with servers(1, 1, 5.0) as srvs, PSClient([srvs[0].endpoint], SECRET, 0, 5.0) as c:
        c.create_dense(1, values, {"optimizer": {"kind": "sgd", "lr": 0.5}, "update": "async"}).result()
        grad = torch.randn(values.numel())
        c.push_dense_grad(1, grad, 0, 0.5).result()
        assert torch.equal(c.pull_dense(1).result(), values - 0.5 * grad)


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_one_workers_huge_pull_does_not_starve_another() -> None:
    """B's small requests while A pulls 400k fresh ids, a huge batch going in 256-id pieces: B keeps its pace."""
    with server_process("--workers", "2", "--max-request-ids", "4096") as (_, endpoint):
        limits = RequestLimits(max_ids=4096)
        a = PSClient([endpoint], SECRET, 0, 60.0, limits=limits)
        b = PSClient([endpoint], SECRET, 1, 60.0, limits=limits)
        try:
            for c in (a, b):
                c.create_sparse(1, {"dim": 8, "optimizer": ADAGRAD}).result()
            small = torch.arange(200)
            b.pull_sparse(1, small).result()
            span: list[float] = []
            latencies: list[tuple[float, float]] = []

            def huge() -> None:
                span.append(time.monotonic())
                a.pull_sparse(1, torch.arange(10**6, 10**6 + 400_000)).result()
                span.append(time.monotonic())

            puller = threading.Thread(target=huge)
            puller.start()
            while puller.is_alive() or not latencies:
                t0 = time.monotonic()
                b.pull_sparse(1, small).result()
                latencies.append((t0, time.monotonic() - t0))
            puller.join()
            during = [lat for t0, lat in latencies if span[0] <= t0 and t0 + lat <= span[1]]
            pull_s = span[1] - span[0]
            # Unsplit, B's one request would wait for the whole pull; split, most wait for a piece or two.
            # (A few wait longer: a piece that doubles the table's storage copies all of it.)
            assert len(during) >= 20, (len(during), pull_s)
            assert statistics.median(during) < pull_s / 20, (statistics.median(during), pull_s)
        finally:
            a.close()
            b.close()


def test_a_failed_allocation_in_a_server_is_an_error_naming_it_and_the_table_stays(monkeypatch) -> None:
    from fleet.sparse import table as sparse_table

    with servers(1, 1, 5.0) as srvs, PSClient([srvs[0].endpoint], SECRET, 0, 5.0) as c:
        c.create_sparse(4, {"dim": 4, "optimizer": ADAGRAD}).result()
        old = c.pull_sparse(4, torch.arange(1000)).result()
        real = sparse_table.grow

        def refuse(t, rows, used):
            if rows > 1024:
                raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")
            return real(t, rows, used)

        monkeypatch.setattr(sparse_table, "grow", refuse)
        with pytest.raises(PSRemoteError, match=r"parameter server 0 ran out of memory in PULL_SPARSE of table 4"):
            c.pull_sparse(4, torch.arange(500, 3000)).result()
        assert torch.equal(c.pull_sparse(4, torch.arange(1000)).result(), old)
        monkeypatch.undo()
        assert c.pull_sparse(4, torch.arange(500, 3000)).result().shape == (2500, 4)
        assert c.stats().result()[0]["out_of_memory"] == 1


@pytest.mark.timeout(60)
def test_a_reply_frame_over_the_cap_is_refused_by_the_client() -> None:
    """The client's sockets cap frames too (a server never sends larger ones): a bigger one drops the connection."""
    from fleet.ps.protocol import auth

    ctx = zmq.Context()
    zap = auth.ZapHandler(ctx, SECRET)  # bound before the authenticated socket, as the server does
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    auth.configure_server(router)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        with PSClient([f"127.0.0.1:{port}"], SECRET, 0, 3.0) as c:
            future = c.stats()
            deadline = time.monotonic() + 5
            while not router.poll(50):
                zap.serve()
                assert time.monotonic() < deadline, "the client's request never arrived"
            ident, *frames = router.recv_multipart()
            router.send_multipart([ident, frames[0], bytes(MAX_WIRE_FRAME + 1)])
            with pytest.raises(PSServerUnavailable, match="closed the connection"):
                future.result()
            c.close(stop_servers_for_me=False)
    finally:
        router.close(0)
        zap.close()
        ctx.term()
