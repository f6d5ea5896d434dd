"""The server's quick way for small pulls on the direct socket (fleet.ps.protocol.quick_pulls), and the client's
blocking direct calls.

Checked here: every request sent on the direct socket -- well-formed pulls and every kind of malformed or
refused one -- gets exactly the answer the same frames get through ZeroMQ (the quick way serves only what
the usual way would serve the same, and leaves the rest to it); a pull inside ``direct()`` never overtakes
this client's queued pushes; a stopped server is named at the call's deadline and its late answer is never
read as the next call's; a server killed under a waiting pull is named at once.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import zmq

from fleet.ps.client.client import PSClient
from fleet.ps.client.direct import Settled
from fleet.ps.protocol import small, unix
from fleet.ps.protocol.errors import PSError, PSServerUnavailable
from fleet.ps.protocol.limits import RequestLimits
from fleet.ps.protocol.wire import HEADER, Message, Op, Status, decode, encode
from ps_servers import SECRET, client, direct_unix_socket, raw_socket, server_process, servers

SGD = {"kind": "sgd", "lr": 1.0}


def on_ipc(c: PSClient) -> None:
    deadline = time.monotonic() + 10
    while c.transports != ["ipc"] and time.monotonic() < deadline:
        c.hello().result()
        time.sleep(0.02)
    assert c.transports == ["ipc"]


def patched(frames: list, at: int, value: bytes) -> list:
    """``frames`` with the header's bytes at ``at`` replaced by ``value``."""
    head = bytearray(bytes(frames[0]))
    head[at : at + len(value)] = value
    return [bytes(head), *frames[1:]]


def same_answer(a: Message, b: Message) -> bool:
    fields = ("op", "table", "peer", "request_id", "step", "arg", "status")
    if any(getattr(a, f) != getattr(b, f) for f in fields) or bytes(a.blob) != bytes(b.blob):
        return False
    return len(a.tensors) == len(b.tensors) and all(
        torch.equal(x, y) for x, y in zip(a.tensors, b.tensors, strict=True)
    )


@pytest.mark.timeout(60)
def test_the_direct_socket_answers_every_request_as_zeromq_does() -> None:
    limits = RequestLimits(max_ids=8, max_bytes=1024)  # budget: 1 KiB + 64 KiB of blob room
    ctx = zmq.Context()
    with servers(1, 2, limits=limits) as srvs, client(srvs, 1) as c:
        c.create_dense(1, torch.arange(4.0), {"optimizer": SGD, "update": "async"}).result()
        c.create_sparse(2, {"dim": 3, "optimizer": SGD, "update": "async"}).result()
        c.push_dense_grad(1, torch.ones(4), 0, 1.0).result()  # version 1
        srv = srvs[0]
        zsock = raw_socket(ctx, srv.endpoint)
        dsock = direct_unix_socket(srv.ipc_path.removesuffix(".sock") + unix.SUFFIX)
        pull = encode(Message(Op.PULL_DENSE, table=1, peer=0, request_id=11))
        ids = torch.tensor([5, 9, 5])
        sparse = encode(Message(Op.PULL_SPARSE, table=2, peer=1, request_id=12, tensors=[ids]))
        well_formed = [
            pull,
            sparse,
            encode(Message(Op.PULL_SPARSE, table=2, peer=0, request_id=13, tensors=[torch.arange(8)])),
            encode(Message(Op.PULL_SPARSE, table=2, request_id=14, tensors=[torch.empty(0, dtype=torch.int64)])),
            encode(Message(Op.PULL_DENSE, table=1, request_id=15, arg=1)),  # min_version reached
        ]
        refused = [  # (frames, what the error says): each answered by the usual way
            ([b"garbage"], "truncated header"),
            (patched(pull, 0, b"JUNK"), "bad magic"),
            (patched(pull, 4, b"\x07"), "protocol version 7"),
            (patched(pull, 5, b"\x63"), "unknown op 99"),
            (patched(pull, 6, b"\x01"), "reply status"),
            (patched(pull, 7, b"\x01"), "header is"),
            (encode(Message(Op.PULL_DENSE, table=9, request_id=16)), "unknown table 9"),
            (encode(Message(Op.PULL_DENSE, table=2, request_id=17)), "is sparse"),
            (encode(Message(Op.PULL_DENSE, table=1, peer=7, request_id=18)), "worker index 7"),
            (encode(Message(Op.PULL_DENSE, table=1, request_id=19, tensors=[ids])), "carries 1 tensors"),
            (encode(Message(Op.PULL_SPARSE, table=1, request_id=20, tensors=[ids])), "is dense"),
            (encode(Message(Op.PULL_SPARSE, table=2, request_id=21, tensors=[ids.int()])), "int32"),
            (encode(Message(Op.PULL_SPARSE, table=2, request_id=22, tensors=[ids.view(3, 1)])), "expected [n]"),
            (encode(Message(Op.PULL_SPARSE, table=2, request_id=23, tensors=[torch.arange(9)])), "carries 9 ids"),
            (encode(Message(Op.PULL_SPARSE, table=2, request_id=24, tensors=[torch.arange(9000)])), "over the limit"),
            ([sparse[0], sparse[1], b"\0" * 20], "20 data bytes"),
            ([*sparse, b""], "frames, expected 3"),
            (encode(Message(Op.PULL_SPARSE, table=2, request_id=25)), "carries 0 tensors"),
        ]
        # a blob on a pull is not the quick way's to judge either: the usual way serves it (and ignores it)
        with_blob = encode(Message(Op.PULL_DENSE, table=1, request_id=26, blob=b"x"))
        before = srv.stats()
        for frames in [*well_formed, *[f for f, _ in refused], with_blob]:
            via_zmq = decode(zsock_ask(zsock, frames))
            unix.send_all(dsock, frames)
            via_direct = decode(unix.recv_message(dsock))
            assert same_answer(via_zmq, via_direct), (frames[:1], via_zmq, via_direct)
        for frames, needle in refused:
            unix.send_all(dsock, frames)
            reply = decode(unix.recv_message(dsock))
            assert reply.status == Status.ERROR and needle in reply.text(), (needle, reply.text())
        after = srv.stats()
        # The quick way takes each well-formed plain pull, whatever its handler then answers (the 5 above, and
        # the unknown table, the wrong kinds of table, the worker index and the 9 ids below, sent twice).
        assert after["direct_quick"] - before["direct_quick"] == len(well_formed) + 2 * 5
        malformed = 7  # garbage, magic, version, op, header size, data bytes, frame count: counted alike
        assert after["malformed"] - before["malformed"] == 3 * malformed
        assert after["over_limit"] - before["over_limit"] == 3
        assert after["direct_rejected"] == before["direct_rejected"]  # an error reply, not a cut connection
        rows = c.pull_sparse(2, ids).result()
        with c.direct():
            assert torch.equal(c.pull_sparse(2, ids).result(), rows)
            assert torch.equal(c.pull_dense(1).result(), torch.arange(4.0) - 1)
        dsock.close()
        zsock.close()
    ctx.term()


def zsock_ask(sock: zmq.Socket, frames: list) -> list:
    sock.send_multipart(frames, copy=False)
    assert sock.poll(3000), "the server did not answer"
    return sock.recv_multipart()


@pytest.mark.timeout(60)
def test_a_direct_pull_never_overtakes_queued_pushes() -> None:
    with servers(1, 1) as srvs, client(srvs, 0) as c:
        c.create_dense(1, torch.zeros(4), {"optimizer": SGD, "update": "async"}).result()
        c.create_sparse(2, {"dim": 2, "optimizer": SGD, "update": "async"}).result()
        on_ipc(c)
        ids = torch.tensor([3, 8])
        with c.direct():
            for round_ in range(1, 6):
                pushed = [c.push_dense_grad(1, torch.ones(4), 0, 1.0) for _ in range(10)]  # queued, not waited for
                pushed.append(c.push_sparse_grad(2, ids, torch.ones(2, 2), 0, 1.0))
                assert torch.equal(c.pull_dense(1).result(), torch.full((4,), -10.0 * round_))
                rows = c.pull_sparse(2, ids).result()
                for f in pushed:
                    f.result()
                assert torch.allclose(rows, c.pull_sparse(2, ids).result())
            quick = srvs[0].stats()["direct_quick"]
            for _ in range(5):  # nothing queued (but for a heartbeat, now and then): the quick way
                assert torch.equal(c.pull_dense(1).result(), torch.full((4,), -50.0))
        assert srvs[0].stats()["direct_quick"] > quick


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_stopped_or_killed_server_is_named_within_the_deadline() -> None:
    with server_process("--workers", "1", "--timeout", "30") as (proc, endpoint):
        c = PSClient([endpoint], SECRET, 0, timeout_s=2.0)
        try:
            c.create_dense(1, torch.arange(4.0), {"optimizer": SGD, "update": "sync"}).result()
            on_ipc(c)
            with c.direct():
                assert torch.equal(c.pull_dense(1).result(), torch.arange(4.0))  # connected
                os.kill(proc.pid, signal.SIGSTOP)
                try:
                    started = time.monotonic()
                    with pytest.raises(PSServerUnavailable, match="did not answer PULL_DENSE") as info:
                        c.pull_dense(1).result()
                    waited = time.monotonic() - started
                finally:
                    os.kill(proc.pid, signal.SIGCONT)
                assert 1.5 < waited < 5, waited
                assert "parameter server 0" in str(info.value)
                # the stopped server answers that pull late, on a connection the failed call closed
                assert torch.equal(c.pull_dense(1).result(), torch.arange(4.0))
                c.pull_dense(1).result()
                assert c.stats().result()[0]["direct_quick"] >= 2
                proc_killer = _kill_soon(proc.pid, 0.3)
                started = time.monotonic()
                with pytest.raises(PSServerUnavailable) as info:
                    c.pull_dense(1, min_version=5).result()  # parked: the pushes it waits for never come
                proc_killer.join()
            # the message tells the closed connection from the deadline ("did not answer"); the bound is loose
            # because a loaded 2-core machine has taken 2.1 s to run the kill and the reader's wake-up
            assert time.monotonic() - started < 10, "the failure waited far past the deadline"
            assert "parameter server 0" in str(info.value) and "closed the connection" in str(info.value)
        finally:
            c.close(stop_servers_for_me=False)


def _kill_soon(pid: int, after_s: float):
    import threading

    def kill() -> None:
        time.sleep(after_s)
        os.kill(pid, signal.SIGKILL)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def test_header_offsets_used_above() -> None:
    """The patched header bytes above: version at 4, op at 5, status at 6, tensor count at 7."""
    head = bytes(encode(Message(Op.PULL_DENSE, table=1, request_id=3))[0])
    magic, version, op, status, ntensors, *_ = HEADER.unpack_from(head)
    assert (head[4], head[5], head[6], head[7]) == (version, op, status, ntensors)


@pytest.mark.timeout(60)
def test_quick_dense_pulls_follow_every_change_of_the_table() -> None:
    """The quick way answers a small dense table from bytes it keeps per version: each push, each overwrite
    of the values and a table too large to keep them for give what the usual way (the IO thread) gives."""
    big = small.COPY_BYTES // 4 + 1
    with servers(1, 1) as srvs, client(srvs, 0) as c:
        c.create_dense(1, torch.arange(4.0), {"optimizer": SGD, "update": "async"}).result()
        c.create_dense(2, torch.ones(big), {"optimizer": SGD, "update": "async"}).result()
        on_ipc(c)
        for step in range(3):
            c.push_dense_grad(1, torch.full((4,), 0.5), 0, 1.0).result()
            c.push_dense_grad(2, torch.full((big,), 0.25), 0, 1.0).result()
            for table in (1, 2):
                usual = c.pull_dense(table).result()
                with c.direct():
                    quick = c.pull_dense(table).result()
                assert torch.equal(quick, usual) and quick.ps_version == usual.ps_version == step + 1
        c.set_dense_values(1, torch.full((4,), 9.0), version=3).result()  # the values change, not the version
        with c.direct():
            assert torch.equal(c.pull_dense(1).result(), torch.full((4,), 9.0))
        assert srvs[0].stats()["direct_quick"] >= 7


def test_a_settled_future_answers_as_a_finished_one() -> None:
    done = Settled(5)
    assert done.done() and not done.cancel() and done.result() == 5 and done.result(timeout=0) == 5
    failed = Settled(exception=PSError("gone"))
    with pytest.raises(PSError, match="gone"):
        failed.result()
    assert isinstance(failed.exception(), PSError)
