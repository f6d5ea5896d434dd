"""Parameter servers in threads of the test process, and raw sockets to them (shared by the PS tests)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import zmq

from fleet.ps.client.client import PSClient
from fleet.ps.protocol import auth, unix
from fleet.ps.protocol import local as same_host
from fleet.ps.protocol.limits import RequestLimits
from fleet.ps.protocol.wire import Message, decode
from fleet.ps.server.loop import ParameterServer

SECRET = b"test-secret-0123"
SGD = {"kind": "sgd", "lr": 0.1}


@contextlib.contextmanager
def servers(
    n: int, workers: int, timeout_s: float = 3.0, limits: RequestLimits | None = None
) -> Iterator[list[ParameterServer]]:
    """``n`` servers serving in threads; shut down (and joined) on exit."""
    started = [
        ParameterServer("127.0.0.1:0", SECRET, i, workers, timeout_s, limits=limits, torch_threads=None)
        for i in range(n)
    ]
    threads = [threading.Thread(target=s.serve, daemon=True) for s in started]
    for t in threads:
        t.start()
    try:
        yield started
    finally:
        for s in started:
            s.shutdown()
        for t in threads:
            t.join(5)
            assert not t.is_alive()


def on_ipc(client: PSClient, timeout_s: float = 10.0) -> None:
    """Wait (bounded) until ``client``'s requests to its one server go over the server's Unix socket."""
    deadline = time.monotonic() + timeout_s
    while client.transports[0] != "ipc" and time.monotonic() < deadline:
        client.hello().result()
        time.sleep(0.02)
    assert client.transports == ["ipc"]


def client(srvs: list[ParameterServer], worker: int, timeout_s: float = 3.0, secret: bytes = SECRET) -> PSClient:
    return PSClient([s.endpoint for s in srvs], secret, worker, timeout_s)


def run_workers(fn, n: int) -> list:
    """Run ``fn(worker_index)`` in ``n`` threads; re-raise the first failure."""
    results: list = [None] * n
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            results[i] = fn(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return results


def direct_unix_socket(path: str, secret: bytes = SECRET) -> socket.socket:
    """A connection to a server's direct Unix socket at ``path``, past its challenge (answered with ``secret``)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(path)
    challenge = bytes(unix.recv_exactly(sock, unix.CHALLENGE_BYTES))
    sock.sendall(unix.answer(secret, challenge))
    unix.recv_exactly(sock, unix.INCARNATION.size)
    return sock


def raw_socket(ctx: zmq.Context, endpoint: str, secret: bytes = SECRET) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    auth.configure_client(sock, secret, "raw")
    sock.connect(f"tcp://{endpoint}")
    return sock


def ask(sock: zmq.Socket, frames: list) -> Message:
    sock.send_multipart(frames, copy=False)
    assert sock.poll(3000), "the server did not answer"
    return decode(sock.recv_multipart(copy=False))


@contextlib.contextmanager
def server_process(*options: str, index: int = 0) -> Iterator[tuple[subprocess.Popen, str]]:
    """A parameter server in a process of its own (``options``: its command line), and its endpoint."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleet.ps.server.loop", "--endpoint", "127.0.0.1:0", "--index", str(index), *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "FLEET_SECRET": SECRET.hex(), "OMP_NUM_THREADS": "1"},
        text=True,
    )
    endpoint = None
    try:
        line = proc.stdout.readline()
        assert "listening on" in line, line
        endpoint = line.split()[-1]
        yield proc, endpoint
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        if endpoint is not None:  # a killed server leaves its Unix socket (fleetrun would remove it)
            same_host.remove(same_host.socket_path(SECRET, endpoint))
