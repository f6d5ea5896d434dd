"""Memory of mode="sharding" (FSDP2) against DistributedDataParallel, per worker, for 1, 2 and 4 workers.

    python benchmarks/sharding_memory.py [--workers 1 2 4] [--layers 12] [--width 2048] [--steps 3] [--stage 3]

The model is an MLP of ``layers`` Linear(width, width) blocks (12 x 2048 x 2048: 50.4 M
parameters), trained with Adam, batch 8 per worker, one intra-op thread per process, gloo
on loopback. For each worker count both are run, one after the other in this command:
DDP, then fleet's sharding (``--stage 3``, the default: parameters, gradients and Adam's
moments sharded; ``--stage 2``: parameters gathered once per step).

Per worker it measures, after the timed steps:

- **state**: the bytes this worker holds in parameters, gradients and optimizer state (the
  local shards, for sharding), counted tensor by tensor: what sharding is about;
- **peak RSS in training**: the process's peak resident memory during the timed steps (the
  high-water mark is reset after the first step) minus what it held before the model was
  built: it also counts activations, gathered layers and communication buffers. Large
  allocations are mmap'd (``MALLOC_MMAP_THRESHOLD_``) so that freed tensors leave the RSS;
- **step time**: the median over the timed steps.

Target: with full sharding each worker's state is at most 1/N + 10 % of DDP's.

``--meta`` measures building instead (a model that must not be whole on any worker): per
worker, the peak RSS growth from before the model is built to the end of
``fleet.distributed_optimizer``, for the model built whole (then sharded) and built on the
``meta`` device (sharded, then only this worker's shards materialised and initialised). Then
the same two builds run under a cap on the address space (``RLIMIT_AS``: what the process
maps when the build starts plus ``--cap`` x the model's bytes): the whole build fails, the meta
build succeeds. Target: the meta build's peak at most 1/N of the model + one layer + 10 %.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp
from _common import become_local_worker, record_result


def build_model(layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(width, 10))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    params = sum(_local(p).nbytes for p in model.parameters())
    grads = sum(_local(p.grad).nbytes for p in model.parameters() if p.grad is not None)
    inner = getattr(optimizer, "inner", optimizer)
    states = sum(_local(v).nbytes for s in inner.state.values() for v in s.values() if torch.is_tensor(v))
    return {"params": params, "grads": grads, "optimizer": states, "total": params + grads + states}


def _status_bytes(field: str) -> int:
    """VmRSS (now) or VmHWM (the peak since the last reset) of this process, from /proc."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # resets VmHWM to the current RSS (Linux)
    except OSError:
        pass


def worker(rank: int, workers: int, port: int, kind: str, args: argparse.Namespace, out: str) -> None:
    become_local_worker(rank, workers, port)
    torch.set_num_threads(1)
    import fleet

    fleet.init()
    before = _status_bytes("VmRSS")
    model = build_model(args.layers, args.width)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    if kind == "ddp":
        if workers > 1:
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(model)
    else:
        strategy = fleet.DistributedStrategy(mode="sharding", sharding_stage=args.stage)
        optimizer = fleet.distributed_optimizer(optimizer, strategy)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, args.width, generator=g), torch.randint(0, 10, (8,), generator=g)
    times = []
    for step in range(args.steps + 1):
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=False)  # keep the gradients: they are part of what a worker holds
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        if step:  # the first step allocates the optimizer state
            times.append(time.perf_counter() - started)
        else:
            _reset_peak()
    result = {
        "kind": kind,
        "workers": workers,
        "parameters": args.layers * (args.width + 1) * args.width + (args.width + 1) * 10,
        "state": state_bytes(model, optimizer),
        "peak_rss_growth": _status_bytes("VmHWM") - before,
        "step_s": statistics.median(times),
    }
    if rank == 0:
        with open(out, "w") as handle:
            json.dump(result, handle)
    fleet.stop_worker()


def build_worker(rank: int, workers: int, port: int, kind: str, args: argparse.Namespace, out: str) -> None:
    """Build the model whole or on meta, shard it, and say how much memory building took (under a cap, maybe)."""
    become_local_worker(rank, workers, port)
    torch.set_num_threads(1)
    import fleet

    fleet.init()
    strategy = fleet.DistributedStrategy(mode="sharding")
    with torch.device("meta"):  # a small model first: what building imports and starts is not the model's cost
        small = [build_model(1, 8)]
    small.append(build_model(1, 8))
    for m in small:
        fleet.distributed_optimizer(torch.optim.Adam(m.parameters()), strategy)
    fleet.barrier_worker()
    model_bytes = (args.layers * (args.width + 1) * args.width + (args.width + 1) * 10) * 4
    limit = None
    if args.capped:
        limit = _status_bytes("VmSize") + int(args.cap * model_bytes)
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    _reset_peak()
    before = _status_bytes("VmRSS")
    error = None
    try:
        if kind == "meta":
            with torch.device("meta"):
                model = build_model(args.layers, args.width)
        else:
            model = build_model(args.layers, args.width)
        optimizer = fleet.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=1e-4), strategy)
    except (RuntimeError, MemoryError) as failure:
        error = str(failure).splitlines()[0][:120]
    peak = _status_bytes("VmHWM") - before
    if limit is not None:
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.getrlimit(resource.RLIMIT_AS)[1]))
    if error is None and limit is None:  # the model trains: one step, to show the shards are real
        x = torch.randn(8, args.width)
        torch.nn.functional.cross_entropy(model(x), torch.zeros(8, dtype=torch.long)).backward()
        optimizer.step()
    result = {"kind": kind, "workers": workers, "model_bytes": model_bytes, "build_peak": peak, "error": error}
    if rank == 0:
        with open(out, "w") as handle:
            json.dump(result, handle)
    fleet.stop_worker()


def run_build(kind: str, workers: int, args: argparse.Namespace, capped: bool) -> dict:
    args = argparse.Namespace(**{**vars(args), "capped": capped})
    return run(kind, workers, args, target=build_worker)


def meta_main(args: argparse.Namespace) -> int:
    """Building: whole vs meta, peak RSS growth, then both under the address-space cap."""
    os.environ["MALLOC_ARENA_MAX"] = "2"  # no 64 MiB arena reserved per thread: the cap counts mappings
    mib = 1 << 20
    print(f"{'workers':>7} {'build':>6} {'model MiB':>10} {'peak MiB':>9} {'of model':>9} {'under cap':>30}")
    ok = True
    points = []
    for workers in args.workers:
        row = {}
        for kind in ("whole", "meta"):
            free = run_build(kind, workers, args, capped=False)
            capped = run_build(kind, workers, args, capped=True)
            share = free["build_peak"] / free["model_bytes"]
            outcome = "ok" if capped["error"] is None else f"failed: {capped['error'][:22]}"
            print(
                f"{workers:>7} {kind:>6} {free['model_bytes'] / mib:10.1f} {free['build_peak'] / mib:9.1f} "
                f"{share:9.3f} {outcome:>30}"
            )
            row[kind] = {"peak_mib": round(free["build_peak"] / mib, 1), "share": round(share, 4), "capped": outcome}
        layer = (args.width + 1) * args.width * 4 / free["model_bytes"]
        target = (1 / workers + layer) * 1.10
        ok &= row["meta"]["share"] <= target and row["meta"]["capped"] == "ok" and row["whole"]["capped"] != "ok"
        points.append({"workers": workers, "target_share": round(target, 4), **row})
    print(
        f"cap: {args.cap} x the model above what each process mapped; target: meta build's peak <= (1/N + one layer) "
        f"+ 10 % of the model, fits the cap, the whole build does not: " + ("PASS" if ok else "MISS")
    )
    last = points[-1]
    record_result(
        "sharding_memory",
        variant="meta build, " + " / ".join(str(p["workers"]) for p in points) + " workers",
        figure=f"peak RSS growth per worker while building and sharding a {free['model_bytes'] / mib:.0f} MiB model",
        units="fraction of the model",
        fleet=last["meta"]["share"],
        peer="the same model built whole, then sharded",
        peer_value=last["whole"]["share"],
        ratio=round(last["meta"]["share"] / last["whole"]["share"], 4),
        ratio_means="meta build's peak / whole build's",
        target="<= (1/N + one layer) + 10 %",
        summary=f"meta build {last['meta']['share']:.3f} of the model, whole build {last['whole']['share']:.3f} at "
        f"{last['workers']} workers; under a cap of {args.cap} x the model the whole build {last['whole']['capped']}, "
        f"the meta build {last['meta']['capped']}",
        headline=False,
        details={"points": points, "layers": args.layers, "width": args.width, "cap": args.cap},
    )
    return 0 if ok else 1


def run(kind: str, workers: int, args: argparse.Namespace, target=worker) -> dict:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        out = handle.name
    mp.start_processes(target, args=(workers, port, kind, args, out), nprocs=workers, start_method="spawn")
    with open(out) as handle:
        result = json.load(handle)
    os.unlink(out)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--stage", type=int, choices=[2, 3], default=3, help="sharding stage (3: parameters too)")
    parser.add_argument("--meta", action="store_true", help="measure building (whole vs on the meta device)")
    parser.add_argument("--cap", type=float, default=0.75, help="--meta: address-space cap, x the model's bytes")
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 16)  # the workers free big tensors back to the system
    if args.meta:
        return meta_main(args)
    mib = 1 << 20
    print(
        f"{'workers':>7} {'strategy':>9} {'state MiB':>10} {'of DDP':>7} {'target':>7} {'peak RSS MiB':>13} {'step ms':>8}"
    )
    ok = True
    points = []
    for workers in args.workers:
        ddp = run("ddp", workers, args)
        sharded = run("sharding", workers, args)
        share = sharded["state"]["total"] / ddp["state"]["total"]
        target = 1 / workers + 0.10
        ok &= share <= target
        for result in (ddp, sharded):
            mark = f"{share:7.3f} {target:7.3f}" if result is sharded else f"{'':7} {'':7}"
            print(
                f"{workers:>7} {result['kind']:>9} {result['state']['total'] / mib:10.1f} {mark} "
                f"{result['peak_rss_growth'] / mib:13.1f} {result['step_s'] * 1e3:8.1f}"
            )
        print(f"{'':>7} sharding / DDP step time: {sharded['step_s'] / ddp['step_s']:.2f}")
        points.append(
            {
                "workers": workers,
                "share_of_ddp_state": round(share, 4),
                "ddp_state_mib": round(ddp["state"]["total"] / mib, 1),
                "peak_rss_growth_mib": [
                    round(ddp["peak_rss_growth"] / mib, 1),
                    round(sharded["peak_rss_growth"] / mib, 1),
                ],
                "step_ms": [round(ddp["step_s"] * 1e3, 1), round(sharded["step_s"] * 1e3, 1)],
            }
        )
    print(
        f"model: {ddp['parameters'] / 1e6:.1f} M parameters, Adam; target state <= 1/N + 10 % of DDP's: "
        + ("PASS" if ok else "MISS")
    )
    shares = " / ".join(f"{p['share_of_ddp_state']:.3f}" for p in points)
    steps = " / ".join(f"{p['step_ms'][1] / p['step_ms'][0]:.2f}" for p in points)
    counts = " / ".join(str(p["workers"]) for p in points)
    record_result(
        "sharding_memory",
        variant=f"stage {args.stage}, {counts} workers",
        figure=f"per-worker parameters + gradients + Adam state of a {ddp['parameters'] / 1e6:.1f} M-parameter MLP, "
        f'mode="sharding" stage {args.stage} / DDP',
        units="fraction of DDP",
        fleet=points[-1]["share_of_ddp_state"],
        peer="DistributedDataParallel (MiB of state)",
        peer_value=points[-1]["ddp_state_mib"],
        ratio=points[-1]["share_of_ddp_state"],
        ratio_means=f"per-worker state at {points[-1]['workers']} workers / DDP's",
        target="<= 1/N + 10 %",
        summary=f"{shares} of DDP's {points[0]['ddp_state_mib']:.1f} MiB at {counts} workers; step time {steps} x DDP",
        headline=args.width == 2048 and args.layers == 12,
        details={"points": points, "layers": args.layers, "width": args.width, "steps": args.steps},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
