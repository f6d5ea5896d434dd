"""Micro-benchmarks of the transports and the server: the network half of a calibration.

Run as a two-worker fleetrun job, on one host (``fleetrun --plan`` does this) or across two
hosts of a real cluster, one worker on each (that is how the network between hosts gets
measured)::

    fleetrun --workers 2 fleet/plan/measure.py --out net.json
    # host A:  fleetrun --nnodes 2 --node-rank 0 --master A:6170 fleet/plan/measure.py --out net.json
    # host B:  fleetrun --nnodes 2 --node-rank 1 --master A:6170 fleet/plan/measure.py --out net.json

``python -m fleet.plan measure-path`` prints this file's path for such command lines.
Worker 0 writes ``--out``. What it measures, one thing at a time so they do not compete for
the cores:

1. all-reduce (the job's process group: gloo for CPU tensors, NCCL for ``--device cuda``) of
   float32 tensors from 1 KB to ``--max-bytes``, sizes interleaved within each repetition;
   the median per size;
2. the parameter-server transport: worker 0 serves a fleet parameter server (a thread, bound
   to worker 0's own address, port chosen by the kernel), worker 1 pulls dense tables of
   the same sizes and sparse rows of ``--sparse-dim``; the median per size;
3. the server's apply rates on worker 0 (no transport): a dense gradient with
   ``--optimizer``'s update, and sparse rows pulled and updated in a warm table.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # run as a file: this package's own directory must not shadow top-level modules

import argparse
import json
import os
import secrets
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fleet
from fleet.runtime import env

KB = 1024


def sizes_up_to(max_bytes: int) -> list[int]:
    """Message sizes: 1 KB, 8 KB, ... x8 ... up to ``max_bytes`` (at least 1 MB), multiples of 4."""
    out, n = [], KB
    while n < max_bytes:
        out.append(n)
        n *= 8
    out.append(max(4, max_bytes // 4 * 4))
    return out


def _median_times(fns: dict[int, Any], reps: int, before=None) -> dict[int, float]:
    """Median seconds of each fn, interleaved: one call of each per repetition."""
    times: dict[int, list[float]] = {key: [] for key in fns}
    for fn in fns.values():
        fn()  # warm-up (buffers, connections)
    for _ in range(reps):
        for key, fn in fns.items():
            if before is not None:
                before()
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    return {key: statistics.median(ts) for key, ts in times.items()}


def measure_allreduce(group: Any, sizes: list[int], reps: int, device: torch.device) -> list[tuple[int, float]]:
    tensors = {n: torch.ones(n // 4, dtype=torch.float32, device=device) for n in sizes}
    flag = torch.zeros(1, device=device)

    def sync() -> None:
        dist.all_reduce(flag, group=group)  # both start together; its own time is not counted
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def run(n: int):
        def fn() -> None:
            dist.all_reduce(tensors[n], group=group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        return fn

    medians = _median_times({n: run(n) for n in sizes}, reps, before=sync)
    return sorted(medians.items())


def measure_round(group: Any, device: torch.device, reps: int = 60) -> float:
    """Mean seconds of one small all-reduce, back to back: what a synchronizing round of a step costs.

    The mean, not the median: on a host with more busy processes than cores, a round now and then
    waits for the peer to be scheduled, and a step with many rounds pays those waits on average.
    """
    flag = torch.zeros(2, device=device)
    dist.all_reduce(flag, group=group)
    t0 = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(flag, group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / reps


def measure_ps(rank: int, group: Any, sizes: list[int], args: argparse.Namespace) -> dict:
    """Worker 0 serves, worker 1 pulls; returns worker 1's medians (dense bytes and sparse rows), and
    the script's own step shape replayed without computation (see :func:`replay_steps`)."""
    reps, sparse_dim, sparse_rows = args.reps, args.sparse_dim, args.sparse_rows
    from fleet.ps.client.client import PSClient
    from fleet.ps.server.loop import ParameterServer

    box: list[Any] = [None, None]
    server = thread = None
    if rank == 0:
        host = env.split_endpoint(env.current().str(env.FLEET_MASTER) or "127.0.0.1:0")[0]
        secret = secrets.token_bytes(32)
        server = ParameterServer(f"{host}:0", secret, 0, num_workers=1, timeout_s=120.0)
        thread = threading.Thread(target=server.serve, name="plan-measure-server", daemon=True)
        thread.start()
        box = [server.endpoint, secret.hex()]
    dist.broadcast_object_list(box, src=0, group=group)
    result: dict[str, Any] = {"endpoint": box[0]}
    cpu0 = time.process_time()
    if rank == 1:
        client = PSClient([box[0]], bytes.fromhex(box[1]), 0, timeout_s=120.0)
        try:
            config = {"optimizer": {"kind": "sgd", "lr": 0.0}, "update": "async"}
            for i, n in enumerate(sizes):
                client.create_dense(i + 1, torch.zeros(n // 4), config).result()
            pulls = {n: (lambda t=i + 1: client.pull_dense(t).result()) for i, n in enumerate(sizes)}
            result["dense_pull"] = sorted(_median_times(pulls, reps).items())
            # The server's own cost per request: many small requests in flight at once, so the
            # wire's latency overlaps and what is left is the handling on both ends.
            burst = 200
            t0 = time.perf_counter()
            futures = [client.pull_dense(1) for _ in range(burst)]
            for future in futures:
                future.result()
            result["request_s"] = (time.perf_counter() - t0) / burst
            if sparse_dim and sparse_rows:
                table = len(sizes) + 1
                client.create_sparse(table, {"dim": sparse_dim, "optimizer": {"kind": "sgd", "lr": 0.0}}).result()
                counts = sorted({max(1, sparse_rows // 16), max(1, sparse_rows)})
                ids = {n: torch.randperm(4 * n)[:n] for n in counts}
                for n in counts:
                    client.pull_sparse(table, ids[n]).result()  # the rows exist from now on
                fns = {n: (lambda x=ids[n]: client.pull_sparse(table, x).result()) for n in counts}
                result["sparse_pull"] = sorted(_median_times(fns, reps).items())
            replay = prepare_replay(client, len(sizes) + 2, args)
            dist.barrier(group=group)
            cpu0 = time.process_time()
            result.update(replay())
            result["client_cpu_s"] = time.process_time() - cpu0  # the worker's side: packing, IO threads
            dist.barrier(group=group)
        finally:
            client.close()
    else:
        dist.barrier(group=group)
        cpu0 = time.process_time()  # the server's process does nothing else while the steps replay
        dist.barrier(group=group)
        result["server_cpu_s"] = time.process_time() - cpu0
    if thread is not None:
        thread.join(timeout=30)
    return result


def prepare_replay(client: Any, table: int, args: argparse.Namespace, steps: int = 12) -> Any:
    """The script's parameter-server traffic per step, without its computation, on one worker.

    Each step: push the dense gradient (``--dense-bytes``) and the sparse gradient rows, then pull
    the dense values and the next step's sparse rows (``--sparse-new`` of them never seen
    before, so the server creates them), waiting for all. The steps' median wall time is what
    one worker of a sync job waits per step with one server; the sparse pull alone, issued after
    the pushes as an async worker does, is what an async worker waits.
    """
    numel = max(1, args.dense_bytes // 4)
    config = {
        "optimizer": {"kind": args.optimizer if args.optimizer in ("sgd", "adam", "adagrad") else "sgd", "lr": 0.0}
    }
    client.create_dense(table, torch.zeros(numel), {**config, "update": "async"}).result()
    rows, dim = args.sparse_rows, args.sparse_dim
    if rows:
        client.create_sparse(table + 1, {"dim": dim, **config}).result()
    grad = torch.randn(numel)
    g = torch.Generator().manual_seed(0)
    known = torch.randint(0, 1 << 40, (4 * rows,), generator=g).unique() if rows else None
    first_fresh = [1 << 41]  # ids above every known one: never seen by the server
    if rows:
        client.pull_sparse(table + 1, known).result()  # the ids every step shares exist already

    def ids_for_step() -> torch.Tensor:
        new = min(args.sparse_new, rows)
        old = known[torch.randperm(known.numel(), generator=g)[: rows - new]]
        fresh = torch.arange(first_fresh[0], first_fresh[0] + new)
        first_fresh[0] += new
        return torch.cat([old, fresh])

    def replay() -> dict[str, Any]:
        return _replay(client, table, grad, ids_for_step if rows else None, dim, steps)

    return replay


def _replay(client: Any, table: int, grad: torch.Tensor, ids_for_step: Any, dim: int, steps: int) -> dict[str, Any]:
    rows = ids_for_step is not None
    step_s, pull_s = [], []
    ids = ids_for_step() if rows else None
    for _ in range(steps):
        t0 = time.perf_counter()
        pending = [client.push_dense_grad(table, grad, 0, 0.0)]
        if rows:
            pending.append(client.push_sparse_grad(table + 1, ids, torch.randn(ids.numel(), dim), 0, 0.0))
        pending.append(client.pull_dense(table))
        t1 = time.perf_counter()
        if rows:
            ids = ids_for_step()
            client.pull_sparse(table + 1, ids).result()
        t2 = time.perf_counter()
        for future in pending:
            future.result()
        step_s.append(time.perf_counter() - t0)
        pull_s.append(t2 - t1)
    return {
        "replay_steps": steps,
        "replay_step_s": statistics.median(step_s),
        "replay_sparse_pull_s": statistics.median(pull_s) if rows else 0.0,
        "replay_wall_s": sum(step_s),
    }


def measure_apply(optimizer: str, dense_bytes: int, sparse_dim: int, sparse_rows: int, reps: int) -> dict:
    """The server's own work, in this process: a dense update, sparse pulls and updates of a warm table."""
    from fleet.ps.server.dense_table import DenseTable
    from fleet.sparse.optim import OptimizerSpec
    from fleet.sparse.table import SparseTable

    kind = optimizer if optimizer in ("sgd", "adam", "adamw", "adagrad") else "sgd"
    numel = max(1024, min(dense_bytes, 64 * 2**20) // 4)
    table = DenseTable(numel, OptimizerSpec(kind=kind, lr=0.01))
    grad = torch.randn(numel)
    dense = _median_times({0: lambda: table.apply_gradient(grad, 0.01)}, reps)[0]
    out = {"optimizer": kind, "dense_apply_Bps": numel * 4 / dense}
    if sparse_dim:
        rows = max(1024, sparse_rows)
        sparse = SparseTable(sparse_dim, OptimizerSpec(kind=kind, lr=0.01), seed=0)
        warm = torch.randperm(50 * rows)[: 20 * rows]
        for chunk in warm.split(rows):
            sparse.pull(chunk)
        batch = warm[torch.randperm(warm.numel())[:rows]]
        grads = torch.randn(rows, sparse_dim)
        t = _median_times({0: lambda: sparse.pull(batch), 1: lambda: sparse.apply_gradient(batch, grads, 0.01)}, reps)
        out["sparse_pull_rows_s"] = rows / t[0]
        out["sparse_apply_rows_s"] = rows / t[1]
        # Rows created on first touch (a fresh table grown batch by batch: allocation, growth, initial values).
        fresh = SparseTable(sparse_dim, OptimizerSpec(kind=kind, lr=0.01), seed=0)
        batches = torch.randperm(1 << 26)[: 10 * rows].split(rows)
        t0 = time.perf_counter()
        for chunk in batches:
            fresh.pull(chunk)
        out["sparse_create_rows_s"] = 10 * rows / (time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", default="cpu", help="where the all-reduced tensors live: cpu or cuda")
    parser.add_argument("--max-bytes", type=int, default=64 * 2**20, help="largest message (default 64 MB)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--dense-bytes", type=int, default=16 * 2**20, help="dense gradient for the apply rate")
    parser.add_argument("--sparse-dim", type=int, default=16)
    parser.add_argument("--sparse-rows", type=int, default=13312, help="unique sparse rows per step")
    parser.add_argument("--sparse-new", type=int, default=0, help="of those, rows never seen before")
    parser.add_argument("--no-ps", action="store_true", help="all-reduce only")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    fleet.init()
    rank, workers = fleet.worker_index(), fleet.worker_num()
    if workers != 2:
        raise SystemExit(
            f"fleet.plan.measure needs exactly 2 workers (one per host to measure a network), got {workers}"
        )
    group = fleet.runtime.context.current().process_group(120.0)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", fleet.local_rank() % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(device)
    sizes = sizes_up_to(args.max_bytes)
    master = env.current().str(env.FLEET_MASTER) or "127.0.0.1:0"
    host = env.split_endpoint(master)[0]
    result: dict[str, Any] = {
        "workers": workers,
        "master_host": host,
        "loopback": host.startswith("127.") or host in ("localhost", "::1"),
        "device": device.type,
        "backend": dist.get_backend(group) if group is not None else None,
        "load_average_start": os.getloadavg()[0],
        "cores": os.cpu_count() or 1,
        "allreduce": measure_allreduce(group, sizes, args.reps, device),
        "round_s": measure_round(group, device),
    }
    if not args.no_ps:
        result["ps"] = measure_ps(rank, group, sizes, args)
        dist.barrier(group=group)
        if rank == 0:
            result["apply"] = measure_apply(
                args.optimizer, args.dense_bytes, args.sparse_dim, args.sparse_rows, args.reps
            )
        ps_part = [result.get("ps")]
        server_cpu = [result["ps"].get("server_cpu_s")]
        dist.broadcast_object_list(ps_part, src=1, group=group)  # worker 1 measured the transport
        dist.broadcast_object_list(server_cpu, src=0, group=group)
        result["ps"] = {**ps_part[0], "server_cpu_s": server_cpu[0]}
    result["load_average_end"] = os.getloadavg()[0]
    if rank == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, args.out)
    fleet.stop_worker()


if __name__ == "__main__":
    main()
