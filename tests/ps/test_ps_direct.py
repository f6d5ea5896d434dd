"""The direct same-host path: a caller that waits at once sends small pulls on its own thread.

Checked here: a pull inside ``client.direct()`` goes over the server's direct socket and gives
what the IO thread gives; it never overtakes a push of the same client still unanswered; a peer
without the secret (or with a garbled message) is cut off before anything is served; the request
limits hold there; CURVE and ``ipc=False`` keep everything on ZeroMQ; a server that dies fails a
waiting direct pull at once, naming it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from fleet.ps.client.client import PSClient
from fleet.ps.protocol import unix
from fleet.ps.protocol.errors import PSRemoteError, PSServerUnavailable
from fleet.ps.protocol.limits import RequestLimits
from fleet.ps.protocol.wire import Message, Op, Status, decode, encode
from fleet.ps.server.loop import ParameterServer
from ps_servers import direct_unix_socket, on_ipc

SECRET = b"direct-path-secret-0123"
ASYNC_SGD = {"optimizer": {"kind": "sgd", "lr": 1.0}, "update": "async"}


@contextlib.contextmanager
def server(**options) -> Iterator[tuple[ParameterServer, threading.Thread]]:
    srv = ParameterServer("127.0.0.1:0", SECRET, 0, 2, 5.0, torch_threads=None, **options)
    thread = threading.Thread(target=srv.serve, daemon=True)
    thread.start()
    try:
        yield srv, thread
    finally:
        srv.shutdown()
        thread.join(5)
        assert not thread.is_alive()


def direct_socket(srv: ParameterServer) -> str:
    path = srv.ipc_path.removesuffix(".sock") + unix.SUFFIX
    assert os.path.exists(path)
    return path


def test_direct_pulls_match_the_io_thread_and_never_overtake_a_push() -> None:
    with server() as (srv, _):
        client = PSClient([srv.endpoint], SECRET, 0, timeout_s=5.0)
        try:
            client.create_dense(1, torch.zeros(4), ASYNC_SGD).result()
            for table in (2, 3):
                client.create_sparse(
                    table, {"dim": 3, "optimizer": {"kind": "sgd", "lr": 1.0}, "update": "async"}
                ).result()
            on_ipc(client)
            ids = torch.tensor([5, 9, 5000])
            queued_rows = client.pull_sparse(2, ids).result()
            with client.direct():
                rows = client.pull_sparse(2, ids).result()
                assert torch.equal(rows, queued_rows)
                for i in range(20):  # each push is sent and not waited for: the pull behind it must see it
                    pushed = client.push_dense_grad(1, torch.full((4,), 1.0), i, 1.0)
                    values = client.pull_dense(1).result()
                    pushed.result()
                    assert torch.equal(values, torch.full((4,), -(i + 1.0))), (i, values)
                assert torch.equal(client.pull_dense(1).result(), torch.full((4,), -20.0))
                many = client.pull_sparse_many([(2, ids, 0), (3, ids[:1], 0)]).result()
            assert torch.equal(many[0], queued_rows)
            assert torch.equal(many[1], client.pull_sparse(3, ids[:1]).result())
            client.create_sparse(4, {"dim": 64, "optimizer": {"kind": "sgd", "lr": 1.0}, "update": "async"}).result()
            wide = torch.arange(3000)  # a small request whose answer (768 KB) takes several reads
            queued_wide = client.pull_sparse(4, wide).result()
            with client.direct():
                assert torch.equal(client.pull_sparse(4, wide).result(), queued_wide)
            stats = srv.stats()
            assert stats["direct_admitted"] >= 1 and stats["direct_rejected"] == 0
            assert stats["ops"]["PULL_SPARSE"] >= 4
        finally:
            client.close()


def test_the_direct_socket_refuses_a_wrong_secret_and_garbled_messages() -> None:
    with server() as (srv, _):
        path = direct_socket(srv)
        assert stat_mode(path) == 0o600
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(5)
        sock.connect(path)
        challenge = bytes(unix.recv_exactly(sock, unix.CHALLENGE_BYTES))
        sock.sendall(unix.answer(b"not-the-secret", challenge))
        assert sock.recv(64) == b""  # closed, no incarnation
        sock.close()
        # a request sent before answering the challenge is never served
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(5)
        sock.connect(path)
        unix.recv_exactly(sock, unix.CHALLENGE_BYTES)
        unix.send_all(sock, encode(Message(op=Op.HELLO, peer=0, request_id=1)))
        assert sock.recv(64) == b""
        sock.close()
        sock = direct_unix_socket(path, SECRET)  # then a message of too many frames
        sock.sendall(unix.COUNT.pack(unix.MAX_FRAMES + 1))
        assert sock.recv(64) == b""
        sock.close()
        assert srv.stats()["direct_rejected"] == 2
        assert srv.stats()["ops"] == {}


def stat_mode(path: str) -> int:
    return os.stat(path).st_mode & 0o777


def test_the_request_limits_hold_on_the_direct_socket() -> None:
    with server(limits=RequestLimits(max_ids=8)) as (srv, _):
        client = PSClient([srv.endpoint], SECRET, 0, timeout_s=5.0)
        try:
            client.create_sparse(2, {"dim": 3, "optimizer": {"kind": "sgd", "lr": 1.0}, "update": "async"}).result()
            sock = direct_unix_socket(direct_socket(srv), SECRET)
            ids = torch.arange(9)
            unix.send_all(sock, encode(Message(op=Op.PULL_SPARSE, table=2, peer=0, request_id=7, tensors=[ids])))
            reply = decode(unix.recv_message(sock))
            assert reply.status == Status.ERROR and reply.request_id == 7
            assert "carries 9 ids" in reply.text() and "at most 8" in reply.text(), reply.text()
            unix.send_all(sock, encode(Message(op=Op.PULL_SPARSE, table=2, peer=5, request_id=8, tensors=[ids[:8]])))
            reply = decode(unix.recv_message(sock))
            assert reply.status == Status.ERROR and "worker index 5" in reply.text()
            sock.close()
        finally:
            client.close()


@pytest.mark.parametrize("how", ["curve", "no-ipc"])
def test_curve_and_ipc_off_keep_direct_calls_on_zeromq(how: str) -> None:
    options = {"encryption": "curve"} if how == "curve" else {}
    import zmq

    if how == "curve" and not zmq.has("curve"):
        pytest.skip("libzmq without CURVE")
    with server(**options) as (srv, _):
        if how == "curve":
            assert not os.path.exists(srv.ipc_path.removesuffix(".sock") + unix.SUFFIX)
        client = PSClient([srv.endpoint], SECRET, 0, timeout_s=5.0, ipc=how != "no-ipc", **options)
        try:
            client.create_dense(1, torch.arange(4.0), ASYNC_SGD).result()
            with client.direct():
                assert torch.equal(client.pull_dense(1).result(), torch.arange(4.0))
            assert srv.stats()["direct_admitted"] == 0
        finally:
            client.close()


def test_a_server_that_dies_fails_a_waiting_direct_pull_at_once() -> None:
    with server() as (srv, thread):
        client = PSClient([srv.endpoint], SECRET, 0, timeout_s=30.0)
        try:
            client.create_dense(1, torch.zeros(4), {**ASYNC_SGD, "update": "sync"}).result()
            on_ipc(client)
            with client.direct():
                client.pull_dense(1).result()  # connected
                threading.Timer(0.3, srv.shutdown).start()
                started = time.monotonic()
                with pytest.raises((PSServerUnavailable, PSRemoteError)) as info:
                    client.pull_dense(1, min_version=5).result()  # parked: waits for pushes that never come
            assert time.monotonic() - started < 10, "the failure waited for the timeout"
            assert "parameter server 0" in str(info.value)
        finally:
            client.close(stop_servers_for_me=False)


def test_the_quick_pull_sends_the_usual_bytes_and_checks_its_answer_as_call_does() -> None:
    """DirectCalls.pull (the blocking one-server pull_dense): the request's bytes are those of the general
    writer; a good answer is read; an error reply, an answer to another request, a peer that closes and one
    that never answers each raise the error call would, and the connection is dropped after a failure."""
    from fleet.ps.client.direct import DirectCalls, _Conn
    from fleet.ps.protocol import small
    from fleet.ps.protocol.errors import PSError

    def unavailable(server: int, msg: Message, why: str, cls: type) -> PSError:
        return cls(f"parameter server {server} {why} ({msg.op_name()})", server, "here", msg.op_name())

    def remote(server: int, op: int, text: str) -> PSError:
        return PSError(f"parameter server {server}: {text}")

    calls = DirectCalls(SECRET, unavailable, remote)
    fields = (int(Op.PULL_DENSE), 7, 1, 42, 0, 3, 0.0, 1500)
    request = small.pull_request(int(Op.PULL_DENSE), 7, 1, 42, 3, 1500)
    general = Message(Op.PULL_DENSE, 7, 1, 42, arg=3, timeout_ms=1500)
    assert request == b"".join(bytes(b) for b in unix.buffers(encode(general)))

    def answered(reply: Message | None, close: bool = False, timeout_s: float = 5.0) -> tuple[Any, bytes]:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        calls._local.conns = {0: _Conn("/nowhere", mine)}
        got = bytearray()

        def serve() -> None:
            got.extend(theirs.recv(1 << 16))
            if reply is not None:
                theirs.sendall(b"".join(bytes(b) for b in unix.buffers(encode(reply))))
            if close:
                theirs.close()

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            outcome: Any = calls.pull(0, "/nowhere", 1, request, fields, timeout_s)
        except PSError as exc:
            outcome = exc
        thread.join(5)
        theirs.close()
        return outcome, bytes(got)

    ok = Message(Op.PULL_DENSE, 7, 0, 42, arg=9, status=Status.OK, tensors=[torch.arange(4.0)])
    reply, sent = answered(ok)
    assert sent == request
    assert reply.arg == 9 and torch.equal(reply.tensors[0], torch.arange(4.0))
    assert 0 in calls._local.conns  # kept for the next call

    error = Message(Op.PULL_DENSE, 7, 0, 42, status=Status.ERROR, blob=b"table 7 is broken")
    exc, _ = answered(error)
    assert isinstance(exc, PSError) and "table 7 is broken" in str(exc)
    assert 0 not in calls._local.conns  # dropped: a late answer is never read as the next call's

    other = Message(Op.PULL_DENSE, 7, 0, 41, status=Status.OK, tensors=[torch.arange(4.0)])
    exc, _ = answered(other)
    assert "answered request 41 for 42" in str(exc)

    exc, _ = answered(None, close=True)
    assert isinstance(exc, PSServerUnavailable) and "PULL_DENSE" in str(exc) and "in flight" in str(exc)

    started = time.monotonic()
    exc, _ = answered(None, timeout_s=0.3)
    assert isinstance(exc, PSServerUnavailable) and "did not answer PULL_DENSE in time" in str(exc)
    assert time.monotonic() - started < 5
    calls.close()


def test_a_one_server_blocking_pull_dense_takes_the_quick_pull() -> None:
    with server() as (srv, _):
        client = PSClient([srv.endpoint], SECRET, 0, timeout_s=5.0)
        try:
            client.create_dense(1, torch.arange(4.0), ASYNC_SGD).result()
            on_ipc(client)
            quick = client._io._direct.pull
            taken = []
            client._io._direct.pull = lambda *args: taken.append(args[4]) or quick(*args)  # type: ignore[method-assign]
            with client.direct():
                for _ in range(3):  # the first connects (call), the others are read as they come
                    values = client.pull_dense(1).result()
                    assert torch.equal(values, torch.arange(4.0)) and values.ps_versions == (values.ps_version,)
            assert len(taken) == 3 and taken[0][0] == Op.PULL_DENSE and taken[0][1] == 1
            assert srv.stats()["direct_quick"] >= 3
        finally:
            client.close()


def test_the_answer_made_ready_for_a_quick_pull_gives_what_the_answer_says() -> None:
    """DirectCalls.pull makes ready the answer the last pull of a table got (small.Expected) while the server works:
    the answer's own version and values are read, and an answer of another size, dtype or kind takes the general
    reader, which says what it holds (or the error it carries)."""
    from fleet.ps.client.direct import DirectCalls, _Conn
    from fleet.ps.protocol import small
    from fleet.ps.protocol.errors import PSError

    def unavailable(server: int, msg: Message, why: str, cls: type) -> PSError:
        return cls(f"parameter server {server} {why}", server, "here", msg.op_name())

    calls = DirectCalls(SECRET, unavailable, lambda server, op, text: PSError(text))
    ends: list[socket.socket] = []

    def connect() -> _Conn:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ends[:] = [mine, theirs]
        return _Conn("/nowhere", mine)

    def pull(conn: _Conn, reply: Message) -> Any:
        calls._local.conns = {0: conn}
        rid = reply.request_id
        request = small.pull_request(int(Op.PULL_DENSE), 7, 1, rid, 0, 1500)
        theirs = ends[1]
        answer = b"".join(map(bytes, unix.buffers(encode(reply))))
        thread = threading.Thread(target=lambda: (theirs.recv(1 << 16), theirs.sendall(answer)), daemon=True)
        thread.start()
        try:
            return calls.pull(0, "/nowhere", 1, request, (int(Op.PULL_DENSE), 7, 1, rid, 0, 0, 0.0, 1500), 5.0)
        except PSError as exc:
            return exc
        finally:
            thread.join(5)

    def ok(rid: int, version: int, t: torch.Tensor) -> Message:
        return Message(Op.PULL_DENSE, 7, 0, rid, arg=version, status=Status.OK, tensors=[t])

    answers = [
        ok(1, 3, torch.arange(4.0)),  # learnt
        ok(2, 4, torch.arange(4.0) * 2),  # made ready: another version, other values
        ok(3, 4, torch.arange(5.0)),  # another size
        ok(4, 5, torch.arange(5, dtype=torch.float64)),  # another dtype
        ok(5, 5, torch.arange(6.0).reshape(2, 3)),  # not flat
        ok(6, 5, torch.arange(6.0).reshape(2, 3)),
        Message(Op.PULL_DENSE, 7, 0, 7, status=Status.ERROR, blob=b"table 7 is broken"),
        ok(8, 6, torch.zeros(0)),
        ok(9, 7, torch.zeros(0)),
        ok(10, 8, torch.ones(3)),
        ok(11, 8, torch.full((3,), 2.0)),
    ]
    conn = connect()
    values = []
    for answer in answers:
        got = pull(conn, answer)
        if answer.status == Status.ERROR:
            assert isinstance(got, PSError) and "table 7 is broken" in str(got)
            conn = connect()  # a failed call drops its connection
            continue
        want = answer.tensors[0]
        assert got.arg == answer.arg and got.request_id == answer.request_id and got.peer == 0
        assert got.tensors[0].dtype == want.dtype and torch.equal(got.tensors[0], want)
        values.append(got.tensors[0])
    for t, answer in zip(values, [a for a in answers if a.status == Status.OK], strict=True):
        assert torch.equal(t, answer.tensors[0])  # each answer's values are its own: no later one wrote them
    for end in ends:
        end.close()
    calls.close()
