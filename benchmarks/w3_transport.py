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
  table, waited for at once: ``with client.direct(): client.pull_dense(t).result()``, which
  on one host goes from the calling thread over the server's direct socket,
  :mod:`fleet.ps.client.direct`; the same pull through the client's IO thread is the
  "queued" line; peer: a 16-byte echo).
* paths: fleet's worker reaches a server on its host through the server's Unix socket
  (ZeroMQ ``ipc://``, the default) and, as a second client with ``ipc=False``, through TCP;
  the peers are the same echo over TCP loopback and over a Unix socket.

Single iterations of fleet and the peer alternate, and the table reports
the median of each, so that load from other processes on this shared machine
hits both alike.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch
from _common import record_result

from fleet.ps.client.client import PSClient

SECRET = secrets.token_bytes(16)


def _echo_server(port_queue: mp.Queue, size: int, unix_path: str | None = None) -> None:
    """Child process: echo fixed-size messages back until the peer closes (TCP, or a Unix socket at ``unix_path``)."""
    if unix_path:
        lsock = socket.socket(socket.AF_UNIX)
        lsock.bind(unix_path)
        lsock.listen(1)
        port_queue.put(unix_path)
        conn, _ = lsock.accept()
    else:
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
    """The peer: a length-prefixed echo over one TCP connection (or one Unix socket connection at ``unix_path``)."""

    def __init__(self, size: int, unix_path: str | None = None):
        q: mp.Queue = mp.get_context("spawn").Queue()
        self.proc = mp.get_context("spawn").Process(target=_echo_server, args=(q, size, unix_path), daemon=True)
        self.proc.start()
        where = q.get(timeout=30)
        if unix_path:
            self.sock = socket.socket(socket.AF_UNIX)
            self.sock.connect(where)
        else:
            self.sock = socket.create_connection(("127.0.0.1", where))
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
    cmd = [sys.executable, "-m", "fleet.ps.server.loop", "--endpoint", "127.0.0.1:0", "--index", "0", "--workers", "2"]
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
    parser.add_argument("--no-record", dest="record", action="store_false", help="do not write benchmarks/results/")
    args = parser.parse_args()
    torch.set_num_threads(1)
    numel = int(args.mb * (1 << 20)) // 4
    nbytes = numel * 4

    proc, endpoint = start_server()
    near = PSClient([endpoint], SECRET, 0, timeout_s=30.0)  # this host: the server's Unix socket
    far = PSClient([endpoint], SECRET, 1, timeout_s=30.0, ipc=False)  # TCP, as from another host
    scratch = tempfile.mkdtemp(prefix="w3-")
    echo, uecho = RawEcho(nbytes), RawEcho(nbytes, os.path.join(scratch, "echo.sock"))
    try:
        sgd = {"optimizer": {"kind": "sgd", "lr": 0.0}, "update": "async"}
        near.create_dense(1, torch.zeros(numel), sgd).result()
        near.create_dense(2, torch.zeros(4), sgd).result()
        far.create_dense(1, None, {**sgd, "size": numel}).result()
        far.create_dense(2, None, {**sgd, "size": 4}).result()
        for _ in range(50):
            if near.transports == ["ipc"]:
                break
            near.pull_dense(2).result()
            time.sleep(0.01)
        paths = {"ipc": near, "tcp": far}
        print(f"fleet's transports: {near.transports[0]} (default client), {far.transports[0]} (ipc=False)")
        grad = torch.randn(numel)
        payload = memoryview(grad.numpy()).cast("B")
        small_payload = memoryview(bytearray(16))

        def big(c: PSClient) -> Callable[[], None]:
            def run() -> None:
                c.push_dense_grad(1, grad, 0, 0.0).result()
                c.pull_dense(1).result()

            return run

        def pipelined(c: PSClient) -> Callable[[], None]:
            def run() -> None:
                pushed = c.push_dense_grad(1, grad, 0, 0.0)
                c.pull_dense(1).result()  # same connection, so the server applies the push first
                pushed.result()

            return run

        def small(c: PSClient) -> Callable[[], None]:
            def run() -> None:
                with c.direct():  # the caller waits at once: on this host, its own thread sends and reads
                    c.pull_dense(2).result()

            return run

        big_fns = {f"{p} {k}": f(c) for p, c in paths.items() for k, f in (("big", big), ("pipelined", pipelined))}
        big_t = interleaved(
            {**big_fns, "raw tcp": lambda: echo.round_trip(payload), "raw unix": lambda: uecho.round_trip(payload)},
            args.iters,
        )
        small_t = interleaved(
            {
                **{p: small(c) for p, c in paths.items()},
                "ipc queued": lambda: near.pull_dense(2).result(),
                "raw tcp": lambda: echo.round_trip(small_payload),
                "raw unix": lambda: uecho.round_trip(small_payload),
            },
            args.small_iters,
        )
    finally:
        echo.close()
        uecho.close()
        shutil.rmtree(scratch, ignore_errors=True)
        far.close()
        near.close()
        proc.wait(10)

    moved_mb = 2 * nbytes / 1e6
    bw = {name: moved_mb / t for name, t in big_t.items()}
    print(f"W3 transport, {args.mb:g} MB float32, {args.iters} interleaved iterations (medians), one host")
    print(f"{'':30}{'fleet ipc':>11}{'fleet tcp':>11}{'raw TCP':>11}{'raw Unix':>11}")
    row = lambda label, vals, fmt: print(f"{label:30}" + "".join(f"{v:11{fmt}}" for v in vals))  # noqa: E731
    row("push, then pull: MB/s", [bw["ipc big"], bw["tcp big"], bw["raw tcp"], bw["raw unix"]], ".0f")
    row("  ms per iteration", [1e3 * big_t[k] for k in ("ipc big", "tcp big", "raw tcp", "raw unix")], ".2f")
    row("push + pull pipelined: MB/s", [bw["ipc pipelined"], bw["tcp pipelined"], bw["raw tcp"], bw["raw unix"]], ".0f")
    row("16-byte round trip (us)", [1e6 * small_t[k] for k in ("ipc", "tcp", "raw tcp", "raw unix")], ".1f")
    row("  queued via the IO thread (us)", [1e6 * small_t["ipc queued"]], ".1f")
    rtt = {k: 1e6 * v for k, v in small_t.items()}
    print(
        f"round trip / raw TCP echo: ipc {rtt['ipc'] / rtt['raw tcp']:.2f}x, tcp {rtt['tcp'] / rtt['raw tcp']:.2f}x; "
        f"/ raw Unix echo: ipc {rtt['ipc'] / rtt['raw unix']:.2f}x (target: at most 2x the raw echo)"
    )
    print("target: fleet bandwidth >= 70% of raw TCP")
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    if not args.record:
        return
    fleet_bw, raw_bw, pipe_bw = bw["ipc big"], bw["raw tcp"], bw["ipc pipelined"]
    ratio = fleet_bw / raw_bw
    record_result(
        "w3_transport",
        variant=f"dense {args.mb:g} MB push then pull",
        figure=f"dense {args.mb:g} MB push then pull on one host: bandwidth, fleet (Unix socket) vs raw TCP echo",
        units="MB/s",
        fleet=round(fleet_bw, 1),
        peer="raw TCP echo",
        peer_value=round(raw_bw, 1),
        ratio=round(ratio, 4),
        ratio_means="fleet / raw TCP bandwidth",
        target=">= 70 %",
        summary=f"{ratio:.1%} of raw TCP ({fleet_bw:,.0f} vs {raw_bw:,.0f} MB/s; pipelined push+pull {pipe_bw / raw_bw:.1%})",
        details={
            "pipelined_ratio": round(pipe_bw / raw_bw, 4),
            "iters": args.iters,
            "fleet_tcp_mb_s": round(bw["tcp big"], 1),
            "raw_unix_mb_s": round(bw["raw unix"], 1),
        },
    )
    record_result(
        "w3_transport",
        variant="16-byte request round trip",
        figure="16-byte request round trip on one host",
        units="us",
        fleet=round(rtt["ipc"], 1),
        peer="raw TCP echo",
        peer_value=round(rtt["raw tcp"], 1),
        ratio=round(rtt["ipc"] / rtt["raw tcp"], 3),
        ratio_means="fleet (Unix socket) / raw TCP round trip (lower is better)",
        target="<= 2x",
        summary=f"{rtt['ipc']:.0f} us round trip vs {rtt['raw tcp']:.0f} us for raw TCP (fleet over TCP {rtt['tcp']:.0f})",
        details={
            "fleet_tcp_us": round(rtt["tcp"], 1),
            "raw_unix_us": round(rtt["raw unix"], 1),
            "fleet_ipc_queued_us": round(rtt["ipc queued"], 1),
        },
        headline=False,
    )


if __name__ == "__main__":
    main()
