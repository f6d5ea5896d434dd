"""The same-host path: workers reach a server on their host through its Unix socket, under the same rules as TCP.

Checked here: a worker chooses the Unix socket by itself (and the server sees it come that way),
the off switches keep TCP, a peer without the secret is refused there as over TCP, the request
limits and the frame cap hold there, a server that dies is reported naming its index, one
restarted at the same endpoint (over the file its predecessor left) is found again, and no
socket file outlives its server. The single-process math of every mode is what the rest of
tests/ps checks, now over this path (it is on by default).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from fleet.ps.client.client import PSClient
from fleet.ps.protocol import auth
from fleet.ps.protocol import local as same_host
from fleet.ps.protocol.errors import PSServerUnavailable
from fleet.ps.protocol.limits import RequestLimits
from fleet.ps.protocol.wire import FRAME_BYTES, MAX_WIRE_FRAME, Message, Op, Status, decode, encode
from fleet.ps.server.loop import ParameterServer
from fleet.runtime import env
from fleet.runtime.job_files import ps_socket_dir, remove_ps_sockets
from ps_jobs import reference, run_job, train

SECRET = b"same-host-secret-0123"
ASYNC_SGD = {"optimizer": {"kind": "sgd", "lr": 1.0}, "update": "async"}


@contextlib.contextmanager
def server(**options) -> Iterator[ParameterServer]:
    srv = ParameterServer("127.0.0.1:0", SECRET, 0, 2, 5.0, torch_threads=None, **options)
    thread = threading.Thread(target=srv.serve, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        thread.join(5)
        assert not thread.is_alive()


def settled(client: PSClient, want: str, timeout_s: float = 10.0) -> list[str]:
    """The client's transports once its first server uses ``want`` (its route moves between two requests)."""
    deadline = time.monotonic() + timeout_s
    while client.transports[0] != want and time.monotonic() < deadline:
        client.hello().result()
        time.sleep(0.02)
    return client.transports


def raw(
    ctx: zmq.Context, address: str, secret: bytes | None, encryption: str = "none"
) -> tuple[zmq.Socket, zmq.Socket]:
    """A DEALER to ``address`` presenting ``secret`` (None: no credentials at all), and its monitor."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if secret is not None:
        auth.configure_client(sock, secret, "raw", encryption)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                       | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_DISCONNECTED)  # fmt: skip
    sock.connect(address)
    return sock, monitor


def first_event(monitor: zmq.Socket, timeout_s: float = 5.0) -> int:
    assert monitor.poll(int(timeout_s * 1000)), "no handshake event"
    return recv_monitor_message(monitor)["event"]


def hello(peer: int = 0, request_id: int = 1) -> list:
    return encode(Message(op=Op.HELLO, peer=peer, request_id=request_id))


# ------------------------------------------------------------------ choosing the path


@pytest.mark.timeout(60)
def test_a_worker_on_the_servers_host_uses_its_unix_socket_and_the_off_switches_keep_tcp(monkeypatch) -> None:
    with server() as srv:
        path = srv.ipc_path
        assert path and stat.S_ISSOCK(os.lstat(path).st_mode)
        directory = os.path.dirname(path)
        assert directory == ps_socket_dir(SECRET.hex()) and stat.S_IMODE(os.lstat(directory).st_mode) == 0o700
        with (
            PSClient([srv.endpoint], SECRET, 0, 5.0) as near,
            PSClient([srv.endpoint], SECRET, 1, 5.0, ipc=False) as far,
        ):
            assert settled(near, "ipc") == ["ipc"]
            far.hello().result()
            near.create_dense(1, torch.arange(6.0), ASYNC_SGD).result()
            far.create_dense(1, None, {**ASYNC_SGD, "size": 6}).result()
            near.push_dense_grad(1, torch.ones(6), 0, 1.0).result()
            far.push_dense_grad(1, torch.ones(6), 0, 1.0).result()
            both = [c.pull_dense(1).result() for c in (near, far)]
            assert far.transports == ["tcp"]
            stats = near.stats().result()[0]
        # both paths reach the same table: two SGD steps of lr 1 on a gradient of ones
        assert torch.equal(both[0], torch.arange(6.0) - 2) and torch.equal(both[1], both[0])
        assert stats["ipc_endpoint"] == path
        assert stats["peers_admitted"]["ipc"] == 1 and stats["peers_admitted"]["tcp"] == 2  # near asked over TCP first
    assert not os.path.exists(path) and not os.path.exists(directory)  # the server removed its socket and the dir

    monkeypatch.setenv(env.FLEET_PS_IPC, "0")  # the environment's switch: neither side uses the path
    with server() as srv:
        assert srv.ipc_path is None
        with PSClient([srv.endpoint], SECRET, 0, 5.0) as c:
            assert c.hello().result()[0].get("ipc") is None and c.transports == ["tcp"]
    monkeypatch.delenv(env.FLEET_PS_IPC)
    with server(ipc=False) as srv, PSClient([srv.endpoint], SECRET, 0, 5.0) as c:
        c.hello().result()
        assert srv.ipc_path is None and c.transports == ["tcp"]


def test_a_worker_takes_only_an_offer_from_its_host_its_job_and_the_port_it_dialled(tmp_path) -> None:
    with server() as srv:
        offer = {"ipc": srv.ipc_path, "host": same_host.host_identity(), "endpoint": srv.endpoint}
        assert same_host.usable(SECRET, offer, srv.endpoint) == f"ipc://{srv.ipc_path}"
        port = srv.endpoint.rpartition(":")[2]
        assert same_host.usable(SECRET, {**offer, "host": "elsewhere/0"}, srv.endpoint) is None
        assert same_host.usable(SECRET, offer, "127.0.0.1:1") is None or port == "1"  # a relay dialled: keep TCP
        assert same_host.usable(b"another-job", offer, srv.endpoint) is None  # not this job's directory
        assert same_host.usable(SECRET, {**offer, "ipc": str(tmp_path / "x.sock")}, srv.endpoint) is None
        os.chmod(os.path.dirname(srv.ipc_path), 0o755)  # a directory others may enter is not used
        try:
            assert same_host.usable(SECRET, offer, srv.endpoint) is None
            assert same_host.prepare(SECRET, "127.0.0.1:1") is None  # nor bound by a server
        finally:
            os.chmod(os.path.dirname(srv.ipc_path), 0o700)


def test_fleetrun_removes_the_socket_a_killed_server_left() -> None:
    secret = os.urandom(16)
    path = same_host.prepare(secret, "127.0.0.1:9")
    assert path is not None
    open(path, "w").close()  # as a server killed outright leaves its socket file
    assert remove_ps_sockets(secret.hex()) and not os.path.exists(os.path.dirname(path))
    assert not remove_ps_sockets(secret.hex())


# ------------------------------------------------------- authentication and limits


@pytest.mark.timeout(60)
@pytest.mark.parametrize("encryption", ["none", "curve"])
def test_the_unix_socket_refuses_peers_without_the_secret(encryption: str) -> None:
    with server(encryption=encryption) as srv:
        address = f"ipc://{srv.ipc_path}"
        ctx = zmq.Context()
        try:
            for secret in (b"not-the-job-secret", None):  # a wrong secret, then no credentials at all
                sock, monitor = raw(ctx, address, secret, encryption)
                sock.send_multipart(hello())
                assert first_event(monitor) != zmq.EVENT_HANDSHAKE_SUCCEEDED
                assert not sock.poll(300), "a refused peer got an answer"
                sock.close()
                monitor.close()
            sock, monitor = raw(ctx, address, SECRET, encryption)
            sock.send_multipart(hello())
            assert first_event(monitor) == zmq.EVENT_HANDSHAKE_SUCCEEDED
            assert sock.poll(5000)
            assert decode(sock.recv_multipart()).status == Status.OK
            sock.close()
            monitor.close()
        finally:
            ctx.destroy(linger=0)
        stats = srv.stats()
    # PLAIN: the handler refuses the wrong secret; CURVE: a peer with the wrong keys fails the handshake before it
    assert stats["auth_rejected"] == (1 if encryption == "none" else 0)
    assert stats["peers_admitted"]["ipc"] == 1 and stats["ops"] == {"HELLO": 1}


@pytest.mark.timeout(60)
def test_the_request_limits_and_the_frame_cap_hold_on_the_unix_socket() -> None:
    with server(limits=RequestLimits(max_ids=100, max_bytes=64 * 1024)) as srv:
        with PSClient([srv.endpoint], SECRET, 0, 5.0, limits=RequestLimits(max_ids=100, max_bytes=64 * 1024)) as c:
            assert settled(c, "ipc") == ["ipc"]
            c.create_sparse(2, {"dim": 4, **ASYNC_SGD}).result()
            assert c.pull_sparse(2, torch.arange(1000)).result().shape == (1000, 4)  # split under the limits
        ctx = zmq.Context()
        try:
            sock, monitor = raw(ctx, f"ipc://{srv.ipc_path}", SECRET)
            assert first_event(monitor) == zmq.EVENT_HANDSHAKE_SUCCEEDED
            for ids in (20_000, 1000):  # over the bytes (refused from the header), then over the ids
                over = Message(op=Op.PULL_SPARSE, table=2, peer=1, request_id=ids, tensors=[torch.arange(ids)])
                sock.send_multipart(encode(over))
                assert sock.poll(5000)
                reply = decode(sock.recv_multipart())
                assert reply.status == Status.ERROR and "max_request_ids = 100" in reply.text(), reply.text()
            sock.send_multipart([bytes(MAX_WIRE_FRAME + 1)])  # a frame over the cap: the server hangs up
            assert first_event(monitor) == zmq.EVENT_DISCONNECTED
            sock.close()
            monitor.close()
        finally:
            ctx.destroy(linger=0)
        stats = srv.stats()
    assert (
        stats["over_limit"] == 1 and stats["table_ops"]["2"]["PULL_SPARSE"] == 167 + 1
    )  # the client sent pieces of 6 ids
    assert FRAME_BYTES < MAX_WIRE_FRAME


# ------------------------------------------------------------ failure and restarts


def _server_process(port: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleet.ps.server.loop", "--endpoint", f"127.0.0.1:{port}", "--index", "0",
         "--workers", "1", "--timeout", "5"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "FLEET_SECRET": SECRET.hex(), "OMP_NUM_THREADS": "1"},
        text=True,
    )  # fmt: skip
    line = proc.stdout.readline()
    assert "listening on" in line, line
    return proc, line.split()[-1]


def _leave_stale_socket(path: str) -> None:
    """A Unix socket file nobody listens on, as a process killed while listening leaves it."""
    import socket

    # Another test's fleet.init may have swept the dead server's directory too (it is removed once empty):
    # a kill -9 leaves both, so both are put back, with the private mode fleet gives it.
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    finally:
        sock.close()  # closing does not unlink the file


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_killed_server_is_named_and_its_restart_at_the_same_endpoint_is_found_over_the_unix_socket() -> None:
    proc, endpoint = _server_process(0)
    path = same_host.socket_path(SECRET, endpoint)
    try:
        with PSClient([endpoint], SECRET, 0, 5.0) as c:
            assert settled(c, "ipc") == ["ipc"]
            first = c.hello().result()[0]
            c.create_dense(1, torch.zeros(4), {**ASYNC_SGD, "update": "sync"}).result()
            parked = c.pull_dense(1, min_version=5)  # waits on the server for steps that never come
            time.sleep(0.3)
            proc.kill()
            proc.wait(10)
            with pytest.raises(
                PSServerUnavailable, match=r"parameter server 0 at 127\.0\.0\.1:\d+ closed the connection"
            ):
                parked.result(10)
            if not os.path.exists(path):  # another test's fleet.init swept the dead server's file meanwhile
                _leave_stale_socket(path)  # (runtime/job_files): put back what kill -9 leaves
            assert stat.S_ISSOCK(os.lstat(path).st_mode)  # a killed server leaves its file ...
            proc, again = _server_process(int(endpoint.rpartition(":")[2]))  # ... which does not block its restart
            assert again == endpoint
            c.wait_for_servers(20.0)
            assert c.transports == ["ipc"]  # the same socket reconnected to the new process
            c.create_dense(1, torch.full((4,), 3.0), ASYNC_SGD).result()
            c.push_dense_grad(1, torch.ones(4), 0, 1.0).result()
            assert torch.equal(c.pull_dense(1).result(), torch.full((4,), 2.0))
            stats = c.stats().result()[0]
            assert stats["peers_admitted"]["ipc"] >= 1 and stats["endpoint"] == first["endpoint"]
        assert proc.wait(10) == 0  # the worker's STOP ended it
        assert json.loads(proc.stdout.read().strip().splitlines()[-1])["ipc_endpoint"] == path
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
            same_host.remove(path)
    assert not os.path.exists(path)
    assert not os.path.exists(path.removesuffix(".sock") + ".direct")  # the restarted server removed both


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_job_uses_the_unix_socket_by_default_and_tcp_with_ps_ipc_false() -> None:
    """One sync job per setting, as fleetrun starts it: the servers' counters say which path the workers took,
    and both train exactly as one process on the union of the batches."""
    want = reference("adam", 3, 2)
    for ipc in (True, False):
        results = run_job(train, 1, 2, {"update": "sync", "ps_ipc": ipc}, "adam", 3, True)
        stats = results[0]["stats"][0]
        assert stats["peers_admitted"]["tcp"] == 2  # each worker asks over TCP first
        assert stats["peers_admitted"]["ipc"] == (2 if ipc else 0), stats["peers_admitted"]
        assert (stats["ipc_endpoint"] is not None) == ipc
        for result in results:
            for name, value in result["snapshot"].items():
                torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-6, msg=name)
