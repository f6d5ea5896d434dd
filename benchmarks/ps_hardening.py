"""The parameter-server transport under pressure: a stranger's memory attack, one request's hold on the loop,
and one worker's huge pull beside another worker's steps.

    python benchmarks/ps_hardening.py [--parts attack,hold,starve] [--ids 4000000] [--dim 8]
    PYTHONPATH=/path/to/an/older/checkout python benchmarks/ps_hardening.py   # the same, against older code

* attack: a server process (``python -m fleet.ps.server.loop``) and 8 raw TCP connections that each send
  a ZMTP 3.0 greeting (mechanism PLAIN), a long command-frame header declaring 200 MiB, then stream
  up to 200 MiB of filler. Reports the server's peak RSS growth (``/proc/<pid>/status`` VmRSS,
  sampled every 20 ms), the bytes it took in, and whether a worker is served afterwards.
* hold: how long one request of the largest size the default limits allow holds the server loop:
  a server in this process handles the encoded request exactly as its loop does
  (``ParameterServer._handle``: decode, the table operation, encode, send), timed per request while
  the table grows from empty to ``--ids`` rows (fresh pulls: median, p99 and the worst, which is
  the request that doubles the table's storage), then pulls of existing rows and pushes.
* starve: a server process; worker A pulls ``--ids`` fresh ids in one call (its own process),
  worker B meanwhile runs steps (``--compute-ms`` of compute, then pull 1,024 existing ids and
  push their gradients). Reports A's pull time, B's steps during it and B's step rate alone and
  during A's pull; then the same with A pulling the same ids as ordinary calls of 1,024 ids, one
  after another: B's pace beside an ordinary busy worker, the reference for the huge call.

* curve: the price of ``ps_encryption="curve"``: 4 MiB dense push-then-pull round trips against a
  server process with and without it, alternated (median MB/s moved).

The older code has no request limits: for it, A's pull is one request, and ``hold`` is skipped.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import secrets
import socket
import statistics
import subprocess
import sys
import threading
import time

import torch
from _common import record_result

from fleet.ps.client.client import PSClient

SECRET = secrets.token_bytes(16)
MiB = 1 << 20
ADAGRAD = {"kind": "adagrad", "lr": 0.1}
GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"PLAIN".ljust(20, b"\0") + b"\0" + bytes(31)


def start_server(workers: int, *options: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleet.ps.server.loop", "--endpoint", "127.0.0.1:0", "--index", "0"]
        + ["--workers", str(workers), "--timeout", "600", *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "FLEET_SECRET": SECRET.hex(), "OMP_NUM_THREADS": "1"},
        text=True,
    )
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    return proc, line.split()[-1]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def stranger(endpoint: str, declared: int, send: int) -> int:
    host, _, port = endpoint.rpartition(":")
    sent = 0
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        try:
            sock.sendall(GREETING + bytes([0x06]) + declared.to_bytes(8, "big"))
            chunk = bytes(MiB)
            while sent < send:
                sock.sendall(chunk)
                sent += len(chunk)
            time.sleep(2.0)  # hold the connection (and whatever the server allocated for it) a moment
        except OSError:
            pass
    return sent


def attack(declared: int) -> None:
    proc, endpoint = start_server(workers=1)
    try:
        with PSClient([endpoint], SECRET, 0, timeout_s=60.0) as worker:
            worker.create_sparse(1, {"dim": 8, "optimizer": ADAGRAD}).result()
            worker.pull_sparse(1, torch.arange(1000)).result()
            time.sleep(0.5)
            before = rss_mib(proc.pid)
            peak, done = [before], threading.Event()

            def sample() -> None:
                while not done.is_set():
                    peak[0] = max(peak[0], rss_mib(proc.pid))
                    time.sleep(0.02)

            sampler = threading.Thread(target=sample)
            sampler.start()
            sent = [0] * 8
            t0 = time.monotonic()
            threads = [
                threading.Thread(target=lambda i=i: sent.__setitem__(i, stranger(endpoint, declared, declared)))
                for i in range(8)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            elapsed = time.monotonic() - t0
            time.sleep(0.5)
            done.set()
            sampler.join()
            served = worker.pull_sparse(1, torch.arange(500, 1500)).result().shape == (1000, 8)
            print(
                f"attack: 8 connections declaring {declared / MiB:g} MiB each: server RSS {before:.0f} -> peak "
                f"{peak[0]:.0f} MiB (growth {peak[0] - before:.1f} MiB); sent {sum(sent) / MiB:.0f} MiB before it hung up, in "
                f"{elapsed:.1f} s; a worker served afterwards: {served}"
            )
    finally:
        proc.kill()
        proc.wait()


def hold(max_rows: int) -> None:
    try:
        from fleet.ps.protocol.limits import RequestLimits
    except ImportError:
        print("hold: skipped (this code has no request limits)")
        return
    from fleet.ps.protocol.wire import Message, Op, encode
    from fleet.ps.server.loop import ParameterServer

    torch.set_num_threads(1)
    limits = RequestLimits()
    for dim, optimizer in ((8, ADAGRAD), (64, {"kind": "adam", "lr": 0.01})):
        server = ParameterServer("127.0.0.1:0", SECRET, 0, 1, 60.0, limits=limits, torch_threads=1)
        try:
            create = Message(Op.CREATE_SPARSE, table=1, blob=json.dumps({"dim": dim, "optimizer": optimizer}).encode())
            handle = functools.partial(_handled_in, server, encode)
            handle(create)
            n = limits.ids_per_request(dim)
            fresh, total = [], 0
            while total + n <= max_rows:
                fresh.append(handle(Message(Op.PULL_SPARSE, table=1, tensors=[torch.arange(total, total + n) * 7919])))
                total += n
            g = torch.Generator().manual_seed(0)
            existing, pushes = [], []
            for _ in range(20):
                ids = torch.randint(0, total, (n,), generator=g).unique() * 7919
                existing.append(handle(Message(Op.PULL_SPARSE, table=1, tensors=[ids])))
                grads = torch.randn(ids.numel(), dim, generator=g)
                pushes.append(handle(Message(Op.PUSH_SPARSE_GRAD, table=1, lr=0.1, tensors=[ids, grads])))
            q = statistics.quantiles(fresh, n=100)
            print(
                f"hold: dim {dim} {optimizer['kind']}, {n:,} ids per request, table grown to {total:,} rows: "
                f"fresh pull median {statistics.median(fresh) * 1e3:.1f} ms, p99 {q[98] * 1e3:.1f} ms, worst "
                f"{max(fresh) * 1e3:.0f} ms; existing-row pull median "
                f"{statistics.median(existing) * 1e3:.1f} ms; push median {statistics.median(pushes) * 1e3:.1f} ms"
            )
        finally:
            server.shutdown()
            server.close()


def _handled_in(server, encode, msg) -> float:
    """Seconds ``server`` spends on ``msg`` in its loop's handler (decode, table operation, encode, send)."""
    import zmq

    frames = [zmq.Frame(b"nobody"), *(zmq.Frame(bytes(memoryview(f))) for f in encode(msg))]
    t0 = time.perf_counter()
    server._handle(frames)  # the reply goes to an unknown peer: the ROUTER socket drops it
    return time.perf_counter() - t0


def _client(endpoint: str, secret: bytes, worker: int, max_ids: int | None) -> PSClient:
    if max_ids is None:
        return PSClient([endpoint], secret, worker, timeout_s=600.0)
    from fleet.ps.protocol.limits import RequestLimits

    return PSClient([endpoint], secret, worker, timeout_s=600.0, limits=RequestLimits(max_ids=max_ids))


def _huge_pull(
    endpoint: str, secret: bytes, dim: int, ids: int, max_ids: int | None, batch: int | None, span: mp.Queue
) -> None:
    """A pulls ``ids`` fresh ids: in one call, or (``batch``) as ordinary calls of ``batch`` ids one after another."""
    torch.set_num_threads(1)
    with _client(endpoint, secret, 0, max_ids) as a:
        a.create_sparse(1, {"dim": dim, "optimizer": ADAGRAD}).result()
        span.put(("start", time.monotonic()))
        every = torch.arange(10**9, 10**9 + ids)
        for part in [every] if batch is None else every.split(batch):
            a.pull_sparse(1, part).result()
        span.put(("end", time.monotonic()))


def starve(ids: int, max_ids: int | None, compute_s: float, a_batch: int | None = None) -> dict[str, float]:
    options = () if max_ids is None else ("--max-request-ids", str(max_ids))
    proc, endpoint = start_server(2, *options)
    try:
        with _client(endpoint, SECRET, 1, max_ids) as b:
            b.create_sparse(1, {"dim": DIM, "optimizer": ADAGRAD}).result()
            batch = torch.arange(1024)
            b.pull_sparse(1, batch).result()

            def step() -> float:
                t0 = time.monotonic()
                time.sleep(compute_s)  # the step's forward and backward
                b.pull_sparse(1, batch).result()
                b.push_sparse_grad(1, batch, torch.ones(1024, DIM), 0, 0.1).result()
                return t0

            t0 = time.monotonic()
            alone = 0
            while time.monotonic() - t0 < 3.0:
                step()
                alone += 1
            alone_rate = alone / (time.monotonic() - t0)
            ctx = mp.get_context("spawn")
            span: mp.Queue = ctx.Queue()
            puller = ctx.Process(target=_huge_pull, args=(endpoint, SECRET, DIM, ids, max_ids, a_batch, span))
            puller.start()
            marks = dict([span.get(timeout=120)])
            starts: list[float] = []
            while "end" not in marks:
                starts.append(step())
                while not span.empty():
                    marks.update([span.get()])
                if not puller.is_alive() and "end" not in marks:
                    raise SystemExit("worker A died")
            puller.join()
            during = [s for s in starts if marks["start"] <= s <= marks["end"]]
            pull_s = marks["end"] - marks["start"]
            limit = "" if max_ids is None else f", {max_ids:,} ids per request"
            limit += f", B computes {compute_s * 1e3:g} ms per step" if compute_s else ""
            how = "in one call" if a_batch is None else f"as calls of {a_batch:,} ids"
            print(
                f"starve{limit}: A pulled {ids:,} fresh ids (dim {DIM}) {how} in {pull_s:.1f} s; "
                f"B made {len(during)} steps "
                f"meanwhile ({len(during) / pull_s:.1f} steps/s; alone {alone_rate:.1f} steps/s, "
                f"ratio {len(during) / pull_s / alone_rate:.2f})"
            )
            return {"pace": len(during) / pull_s / alone_rate, "pull_s": pull_s, "alone_steps_per_s": alone_rate}
    finally:
        proc.kill()
        proc.wait()


def curve(iters: int = 60) -> dict[str, float]:
    values = torch.randn(1 << 20)
    clients, procs = {}, []
    try:
        for encryption in ("none", "curve"):
            proc, endpoint = start_server(1, "--encryption", encryption)
            procs.append(proc)
            c = PSClient([endpoint], SECRET, 0, timeout_s=60.0, encryption=encryption)
            c.create_dense(1, values, {"optimizer": {"kind": "sgd", "lr": 0.1}, "update": "async"}).result()
            clients[encryption] = c
        times: dict[str, list[float]] = {name: [] for name in clients}
        for _ in range(iters):
            for name, c in clients.items():
                t0 = time.perf_counter()
                c.push_dense_grad(1, values, 0, 0.1).result()
                c.pull_dense(1).result()
                times[name].append(time.perf_counter() - t0)
        rate = {name: 2 * values.numel() * 4 / 1e6 / statistics.median(ts) for name, ts in times.items()}
        print(
            f"curve: 4 MiB push then pull, median of {iters}: {rate['none']:.0f} MB/s without encryption, "
            f"{rate['curve']:.0f} MB/s with CURVE ({rate['curve'] / rate['none']:.0%})"
        )
        return rate
    finally:
        for c in clients.values():
            c.close()
        for proc in procs:
            proc.kill()
            proc.wait()


DIM = 8


def main() -> None:
    global DIM
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="attack,hold,starve")
    parser.add_argument("--ids", type=int, default=4_000_000)
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--max-request-ids", type=int, default=None, help="(newer code) server and client limit")
    parser.add_argument("--compute-ms", type=float, default=0.0, help="starve: B's compute per step (a sleep)")
    args = parser.parse_args()
    DIM = args.dim
    import fleet

    print(f"fleet from {os.path.dirname(fleet.__file__)}; load {os.getloadavg()[0]:.1f}")
    parts = args.parts.split(",")
    if "attack" in parts:
        attack(200 * MiB)
        try:  # the worst a stranger can do now: declare exactly the largest frame
            from fleet.ps.protocol.wire import FRAME_BYTES

            attack(FRAME_BYTES)
        except ImportError:
            pass
    if "hold" in parts:
        hold(args.ids)
    if "curve" in parts:
        rate = curve()
        record_result(
            "ps_hardening",
            variant="CURVE encryption bandwidth",
            figure="4 MiB dense push then pull with CURVE encryption vs without",
            units="MB/s",
            fleet=round(rate["curve"], 1),
            peer="the same without encryption",
            peer_value=round(rate["none"], 1),
            ratio=round(rate["curve"] / rate["none"], 4),
            ratio_means="with CURVE / without (bandwidth)",
            summary=f"CURVE: {rate['curve']:,.0f} vs {rate['none']:,.0f} MB/s without encryption",
            headline=False,
        )
    if "starve" in parts:
        huge = starve(args.ids, args.max_request_ids, args.compute_ms / 1000)
        # The reference: the same ids pulled as ordinary batches, one after another. What B loses
        # beside them is sharing the cores and the server with a busy worker; what it loses beyond
        # that beside the one huge call is what the huge call itself costs the others.
        ordinary = starve(args.ids, args.max_request_ids, args.compute_ms / 1000, a_batch=1024)
        record_result(
            "ps_hardening",
            variant="huge call vs ordinary calls",
            figure=f"a worker's pace ({args.compute_ms:g} ms compute, pull + push 1,024 ids per step) while another "
            f"pulls {args.ids:,} fresh ids in one call, against the same ids as ordinary calls of 1,024",
            units="fraction of its pace alone",
            fleet=round(huge["pace"], 4),
            peer="the same ids as ordinary calls",
            peer_value=round(ordinary["pace"], 4),
            ratio=round(huge["pace"] / ordinary["pace"], 4),
            ratio_means="pace beside the huge call / pace beside ordinary calls (1.0: the huge call costs no more)",
            target="a huge batch costs the others no more than the same ids in ordinary batches",
            summary=f"{huge['pace']:.0%} of its pace beside a {args.ids:,}-id call, {ordinary['pace']:.0%} beside the "
            f"same ids in ordinary calls; the huge pull {huge['pull_s']:.1f} s",
            details={"huge": huge, "ordinary": ordinary, "max_request_ids": args.max_request_ids},
        )


if __name__ == "__main__":
    main()
