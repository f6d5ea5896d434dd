"""Workload W3 (transport): fleet's parameter-server wire vs a raw TCP echo, same run, same machine.

    python benchmarks/w3_transport.py [--iters 200] [--small-iters 2000] [--mb 4]

* fleet: one worker (this process) and one server process (``python -m
  fleet.ps.server.loop``). One iteration = push a 4 MB float32 gradient (async SGD
  on the server) and pull the 4 MB back: 8 MB moved. Two variants: "push,
  then pull" waits for each answer (two round trips); "pipelined" sends the
  pull right behind the push on the same connection and waits for both (one
  round trip, like the echo; the server still applies the push first).
* peer: a raw TCP echo between this process and a child process on loopback:
  send 4 MB, receive the 4 MB echo (``sendall`` / ``recv_into(MSG_WAITALL)``,
  no copies beyond the kernel's).
* small: one 16-byte request and its answer (fleet: PULL_DENSE of a 4-float
  table; peer: a 16-byte echo).

Single iterations of fleet and the peer alternate, and the table reports
the median of each, so that load from other processes on this shared machine
hits both alike.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
from _common import record_result

from fleet.ps.client.client import PSClient

SECRET = secrets.token_bytes(16)


def _echo_server(port_queue: mp.Queue, size: int) -> None:
    """Child process: echo fixed-size messages back until the peer closes."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    port_queue.put(lsock.getsockname()[1])
    conn, _ = lsock.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(size)
    view = memoryview(buf)
    while True:
        header = conn.recv(8)
        if len(header) < 8:
            return
        n = int.from_bytes(header, "little")
        if conn.recv_into(view[:n], n, socket.MSG_WAITALL) != n:
            return
        conn.sendall(view[:n])


class RawEcho:
    """The peer: a length-prefixed echo over one TCP connection."""

    def __init__(self, size: int):
        q: mp.Queue = mp.get_context("spawn").Queue()
        self.proc = mp.get_context("spawn").Process(target=_echo_server, args=(q, size), daemon=True)
        self.proc.start()
        self.sock = socket.create_connection(("127.0.0.1", q.get(timeout=30)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = memoryview(bytearray(size))

    def round_trip(self, payload: memoryview) -> None:
        n = len(payload)
        self.sock.sendall(n.to_bytes(8, "little"))
        self.sock.sendall(payload)
        if self.sock.recv_into(self.buf[:n], n, socket.MSG_WAITALL) != n:
            raise ConnectionError("the echo process closed the connection")

    def close(self) -> None:
        self.sock.close()
        self.proc.join(5)


def start_server() -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "FLEET_SECRET": SECRET.hex()}
    cmd = [sys.executable, "-m", "fleet.ps.server.loop", "--endpoint", "127.0.0.1:0", "--index", "0", "--workers", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    line = proc.stdout.readline()
    if "listening on" not in line:
        raise RuntimeError(f"parameter server did not start: {line!r}")
    return proc, line.split()[-1]


def interleaved(fns: dict[str, Callable[[], None]], iters: int) -> dict[str, float]:
    """Median seconds per call of each function, calls interleaved so load spikes hit all alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(iters):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--small-iters", type=int, default=2000)
    parser.add_argument("--mb", type=float, default=4.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    numel = int(args.mb * (1 << 20)) // 4
    nbytes = numel * 4

    proc, endpoint = start_server()
    client = PSClient([endpoint], SECRET, 0, timeout_s=30.0)
    echo = RawEcho(nbytes)
    try:
        client.create_dense(
            1, torch.zeros(numel), {"optimizer": {"kind": "sgd", "lr": 0.0}, "update": "async"}
        ).result()
        client.create_dense(2, torch.zeros(4), {"optimizer": {"kind": "sgd", "lr": 0.0}, "update": "async"}).result()
        grad = torch.randn(numel)
        payload = memoryview(grad.numpy()).cast("B")
        small = memoryview(bytearray(16))

        def fleet_big() -> None:
            client.push_dense_grad(1, grad, 0, 0.0).result()
            client.pull_dense(1).result()

        def fleet_big_pipelined() -> None:
            pushed = client.push_dense_grad(1, grad, 0, 0.0)
            client.pull_dense(1).result()  # same connection, so the server applies the push first
            pushed.result()

        def raw_big() -> None:
            echo.round_trip(payload)

        def fleet_small() -> None:
            client.pull_dense(2).result()

        def raw_small() -> None:
            echo.round_trip(small)

        big = interleaved({"fleet": fleet_big, "pipelined": fleet_big_pipelined, "raw": raw_big}, args.iters)
        small = interleaved({"fleet": fleet_small, "raw": raw_small}, args.small_iters)
    finally:
        echo.close()
        client.close()
        proc.wait(10)

    moved_mb = 2 * nbytes / 1e6
    fleet_bw, raw_bw = moved_mb / big["fleet"], moved_mb / big["raw"]
    print(f"W3 transport, {args.mb:g} MB float32, {args.iters} interleaved iterations (medians), loopback")
    print(f"{'':34}{'fleet':>12}{'raw TCP':>12}{'fleet/raw':>12}")
    pipe_bw = moved_mb / big["pipelined"]
    print(f"{'push, then pull: MB/s':34}{fleet_bw:12.0f}{raw_bw:12.0f}{fleet_bw / raw_bw:12.1%}")
    print(f"{'  ms per iteration':34}{big['fleet'] * 1e3:12.2f}{big['raw'] * 1e3:12.2f}")
    print(f"{'push + pull pipelined: MB/s':34}{pipe_bw:12.0f}{raw_bw:12.0f}{pipe_bw / raw_bw:12.1%}")
    print(f"{'  ms per iteration':34}{big['pipelined'] * 1e3:12.2f}{big['raw'] * 1e3:12.2f}")
    rtt_f, rtt_r = small["fleet"] * 1e6, small["raw"] * 1e6
    print(f"{'16-byte round trip (us)':34}{rtt_f:12.1f}{rtt_r:12.1f}{rtt_r / rtt_f:12.1%}")
    print("target: fleet bandwidth >= 70% of raw TCP")
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    ratio = fleet_bw / raw_bw
    record_result(
        "w3_transport",
        variant=f"dense {args.mb:g} MB push then pull",
        figure=f"dense {args.mb:g} MB push then pull: bandwidth, fleet vs raw TCP echo in the same run",
        units="MB/s",
        fleet=round(fleet_bw, 1),
        peer="raw TCP echo",
        peer_value=round(raw_bw, 1),
        ratio=round(ratio, 4),
        ratio_means="fleet / raw TCP bandwidth",
        target=">= 70 %",
        summary=f"{ratio:.1%} of raw TCP ({fleet_bw:,.0f} vs {raw_bw:,.0f} MB/s; pipelined push+pull {pipe_bw / raw_bw:.1%})",
        details={"pipelined_ratio": round(pipe_bw / raw_bw, 4), "iters": args.iters},
    )
    record_result(
        "w3_transport",
        variant="16-byte request round trip",
        figure="16-byte request round trip",
        units="us",
        fleet=round(rtt_f, 1),
        peer="raw TCP echo",
        peer_value=round(rtt_r, 1),
        ratio=round(rtt_f / rtt_r, 3),
        ratio_means="fleet / raw TCP round trip (lower is better)",
        summary=f"{rtt_f:.0f} us round trip vs {rtt_r:.0f} us for raw TCP",
        headline=False,
    )


if __name__ == "__main__":
    main()
