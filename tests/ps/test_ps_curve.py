"""``ps_encryption="curve"``: worker-server traffic is encrypted, and only holders of the job's secret take part.

A TCP relay between a worker and a server records every byte both ways: with PLAIN the secret
and the tensors' bytes cross the wire as they are; with CURVE neither does.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import pytest
import torch

import fleet
from fleet.ps.client.client import PSClient
from fleet.ps.protocol.errors import PSServerUnavailable
from fleet.ps.protocol.wire import FRAME_BYTES
from fleet.ps.server.loop import ParameterServer
from fleet.strategy import StrategyError

SECRET = b"curve-test-secret-0123"


@contextlib.contextmanager
def server(encryption: str) -> Iterator[ParameterServer]:
    srv = ParameterServer("127.0.0.1:0", SECRET, 0, 1, 5.0, encryption=encryption, torch_threads=None)
    thread = threading.Thread(target=srv.serve, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        thread.join(5)


@contextlib.contextmanager
def relay(endpoint: str) -> Iterator[tuple[str, bytearray]]:
    """A TCP relay to ``endpoint`` that keeps a copy of everything it forwards."""
    host, _, port = endpoint.rpartition(":")
    listener = socket.create_server(("127.0.0.1", 0))
    seen = bytearray()
    lock = threading.Lock()

    def pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                with lock:
                    seen.extend(data)
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                inside, _ = listener.accept()
                outside = socket.create_connection((host, int(port)))
                for a, b in ((inside, outside), (outside, inside)):
                    threading.Thread(target=pump, args=(a, b), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}", seen
    finally:
        listener.close()


SIZE = FRAME_BYTES // 4 + 4096  # a full frame (CURVE's envelope must still fit the sockets' cap) and more


def _exchange(encryption: str) -> tuple[bytes, torch.Tensor]:
    values = torch.full((SIZE,), 1234.5678)
    with server(encryption) as srv, relay(srv.endpoint) as (endpoint, seen):
        with PSClient([endpoint], SECRET, 0, 5.0, encryption=encryption) as c:
            c.create_dense(1, values, {"optimizer": {"kind": "sgd", "lr": 1.0}, "update": "async"}).result()
            c.push_dense_grad(1, torch.ones(SIZE), 0, 0.5).result()
            pulled = c.pull_dense(1).result()
        return bytes(seen), pulled


@pytest.mark.timeout(60)
def test_curve_hides_the_secret_and_the_tensors_that_plain_shows() -> None:
    pattern = torch.full((64,), 1234.5678).numpy().tobytes()  # 256 bytes of the values being sent
    plain, pulled = _exchange("none")
    assert SECRET in plain and pattern in plain  # the relay does see what crosses the wire
    curve, pulled_curve = _exchange("curve")
    assert SECRET not in curve and pattern not in curve and len(curve) > 3 * 4 * SIZE
    assert torch.equal(pulled_curve, pulled) and torch.equal(pulled, torch.full((SIZE,), 1234.5678 - 0.5))


@pytest.mark.timeout(60)
def test_curve_admits_only_holders_of_the_secret_and_says_why_others_fail() -> None:
    with server("curve") as srv:
        for secret, encryption, hint in (
            (b"not-the-job-secret", "curve", "the shared secret differs"),
            (SECRET, "none", "ps_encryption='curve' while this worker does not"),
        ):
            outsider = PSClient([srv.endpoint], secret, 0, 3.0, encryption=encryption)
            with pytest.raises(PSServerUnavailable, match=hint):
                outsider.hello().result()
            outsider.close(stop_servers_for_me=False)
        with PSClient([srv.endpoint], SECRET, 0, 3.0, encryption="curve") as worker:
            assert worker.hello().result()[0]["server_index"] == 0
    assert fleet.DistributedStrategy(mode="ps", ps_encryption="curve").ps_encryption == "curve"
    with pytest.raises(StrategyError, match="ps_encryption"):
        fleet.DistributedStrategy(mode="ps", ps_encryption="tls")
