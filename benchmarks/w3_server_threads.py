"""Workload W3 (server threads): one parameter server's table throughput with 1 and 2 table threads.

    python benchmarks/w3_server_threads.py [--tables 4] [--rows 200000] [--batch 4096] [--seconds 6]
                                           [--optimizer adam] [--threads 1,2]

One server process (``python -m fleet.ps.server.loop --threads N``) holds ``--tables`` sparse tables
(dim 16, ``--rows`` rows each, created before timing); two worker processes each loop over the
tables: pull ``--batch`` existing ids of every table (one request per table, all sent, then all
waited for), then push a gradient for the same rows (async, ``--optimizer``). The figure is rows
pulled + pushed per second by both workers together; each thread count gets a fresh server, and
the counts alternate (1, 2, 1, 2, ...) for ``--rounds`` rounds so that load from other processes
hits both alike; the medians are reported, with their ratio as ``threads 1 vs 2``.

What limits it: with one table thread the tables' kernels run one at a time while the loop decodes
and answers; with two, two tables' kernels overlap (each table stays serial: fleet.ps.server.lanes).
The server's Python work per request (decoding, checks, replies: under the GIL) does not overlap,
so the ratio approaches 2 only when kernels dominate (large batches, Adam) and the machine has the
cores free: on a 2-core machine the two workers and the loop share them with the table threads.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
from _common import record_result

SECRET = secrets.token_bytes(16)  # the spawned workers get it as an argument (they import anew)
DIM = 16


def _worker(index: int, endpoint: str, secret: bytes, args: argparse.Namespace, go: Any, out: mp.Queue) -> None:
    from fleet.ps.client.client import PSClient

    torch.set_num_threads(1)
    client = PSClient([endpoint], secret, index, timeout_s=60.0)
    config = {"dim": DIM, "optimizer": {"kind": args.optimizer, "lr": 0.01}, "update": "async"}
    for table in range(args.tables):
        client.create_sparse(table, config).result()
    gen = torch.Generator().manual_seed(index)
    batches = [torch.randint(0, args.rows, (args.batch,), generator=gen).unique() for _ in range(8)]
    grads = [torch.randn(b.numel(), DIM, generator=gen) for b in batches]
    out.put(("ready", index))
    go.wait()  # both workers start together, once both are ready
    start = time.monotonic()
    rows, step, deadline = 0, 0, start + args.seconds
    while time.monotonic() < deadline:
        ids, grad = batches[step % len(batches)], grads[step % len(batches)]
        pulls = [client.pull_sparse(table, ids) for table in range(args.tables)]
        for f in pulls:
            f.result()
        pushes = [client.push_sparse_grad(table, ids, grad, step, 0.01) for table in range(args.tables)]
        for f in pushes:
            f.result()
        rows += 2 * ids.numel() * args.tables
        step += 1
    out.put((index, rows / (time.monotonic() - start)))
    client.close()


def _server(threads: int) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "FLEET_SECRET": SECRET.hex()}
    cmd = [sys.executable, "-m", "fleet.ps.server.loop", "--endpoint", "127.0.0.1:0", "--index", "0"]
    cmd += ["--workers", "3", "--threads", str(threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    line = proc.stdout.readline()
    if "listening on" not in line:
        raise RuntimeError(f"parameter server did not start: {line!r}")
    return proc, line.split()[-1]


def _fill(endpoint: str, args: argparse.Namespace) -> None:
    """Create every table's rows before timing (worker 2: neither timed worker)."""
    from fleet.ps.client.client import PSClient

    client = PSClient([endpoint], SECRET, 2, timeout_s=120.0)
    config = {"dim": DIM, "optimizer": {"kind": args.optimizer, "lr": 0.01}, "update": "async"}
    ids = torch.arange(args.rows)
    for table in range(args.tables):
        client.create_sparse(table, config).result()
        client.pull_sparse(table, ids).result()
    client.close()


def one_run(threads: int, args: argparse.Namespace) -> float:
    proc, endpoint = _server(threads)
    try:
        _fill(endpoint, args)
        ctx = mp.get_context("spawn")
        out: mp.Queue = ctx.Queue()
        go = ctx.Event()
        workers = [ctx.Process(target=_worker, args=(i, endpoint, SECRET, args, go, out)) for i in range(2)]
        for w in workers:
            w.start()
        for _ in workers:
            out.get(timeout=300)
        go.set()
        total = sum(out.get(timeout=120 + args.seconds)[1] for _ in workers)
        for w in workers:
            w.join(30)
        return total
    finally:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tables", type=int, default=4)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--optimizer", default="adam", choices=["sgd", "adagrad", "adam"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--threads", default="1,2", help="comma-separated table thread counts (the first two give the ratio)"
    )
    parser.add_argument("--no-record", dest="record", action="store_false", help="do not write benchmarks/results/")
    args = parser.parse_args()
    counts = [int(t) for t in args.threads.split(",")]
    got: dict[int, list[float]] = {t: [] for t in counts}
    for _ in range(args.rounds):
        for t in counts:
            got[t].append(one_run(t, args))
    med = {t: statistics.median(v) for t, v in got.items()}
    print(
        f"W3 server threads: {args.tables} sparse tables x {args.rows:,} rows (dim {DIM}, {args.optimizer}), "
        f"2 workers pulling + pushing {args.batch:,} ids per table per step, {args.rounds} rounds (medians)"
    )
    for t in counts:
        runs = ", ".join(f"{v / 1e6:.2f}" for v in got[t])
        print(f"  table threads {t}: {med[t] / 1e6:6.2f} M rows/s  (runs: {runs})")
    if len(counts) >= 2:
        a, b = counts[0], counts[1]
        print(f"threads {a} vs {b}: {med[b] / med[a]:.2f}x")
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    if args.record and len(counts) >= 2:
        record_result(
            "w3_server_threads",
            variant=f"{args.optimizer} table threads {a} vs {b}",
            figure=f"rows/s through one server, {args.tables} {args.optimizer} tables, 2 workers pulling and pushing",
            units="M rows/s",
            fleet=round(med[b] / 1e6, 3),
            peer=f"the same server with {a} table thread(s)",
            peer_value=round(med[a] / 1e6, 3),
            ratio=round(med[b] / med[a], 3),
            ratio_means=f"rows/s with {b} table threads over rows/s with {a} (higher is better)",
            summary=f"{b} table threads {med[b] / med[a]:.2f}x {a} ({med[b] / 1e6:.2f} vs {med[a] / 1e6:.2f} M rows/s, "
            f"{os.cpu_count()} CPUs, shared with both workers)",
            details={"runs_rows_per_s": {str(t): v for t, v in got.items()}},
        )


if __name__ == "__main__":
    main()
