"""Shared pieces of the straggler / fan-out / scaling study (benchmarks/stragglers.py, fanout.py, scaling.py).

Two halves:

- driver helpers (no torch needed until a function uses it): :func:`fleetrun` runs this very file
  as the training script of a real ``fleetrun`` job and collects every worker's result file and
  fleetrun's ``report.json``; table/CSV/JSON writers; optional matplotlib; the pure math
  (:func:`expected_max_lognormal`, :func:`predicted_speedup`).
- the worker (``python benchmarks/_common.py ...`` under fleetrun): one training loop for three
  workloads, timed per step by the loop itself (wall time between step boundaries; communication
  / wait from fleet's own recorder in collective mode, and for the parameter server the time
  spent in ``opt.step()`` (push + pull) plus the sparse pull in the embedding's forward).

Workloads: ``w1`` (benchmarks/README.md W1 MLP, cross-entropy, SGD 0.01), ``ctr`` (W2's CTR model from
examples/single_to_multi/train_ctr.py, SGD 0.1), ``sleep`` (a Linear(8, 1) whose "compute" is the
injected log-normal delay: the cleanest fan-out measurement).

Straggler delays use fleet's own injector (:class:`fleet.runtime.inject.Injector`, log-normal, seeded per
rank), applied at the step boundary by this loop, so the same delay sequence hits every mode.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ROOT / "docs" / "figures"
WORKER = Path(__file__).resolve()


# --------------------------------------------------------------------------- pure math


def expected_max_lognormal(n: int, mu: float, sigma: float, samples: int = 200_000, seed: int = 0) -> float:
    """E[max of n iid log-normal(mu, sigma)] by Monte Carlo (the simulated fan-out step)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    z = torch.randn(samples, n, generator=g, dtype=torch.float64)
    return float(torch.exp(mu + sigma * z).max(dim=1).values.mean())


def lognormal_mean(mu: float, sigma: float) -> float:
    """E[X] for X ~ log-normal(mu, sigma): exp(mu + sigma^2 / 2)."""
    return math.exp(mu + sigma * sigma / 2)


def expected_max2_lognormal(mu: float, sigma: float) -> float:
    """Closed form for n = 2: 2 exp(mu + sigma^2/2) Phi(sigma / sqrt 2) (checks the Monte Carlo)."""
    phi = 0.5 * (1 + math.erf(sigma / math.sqrt(2) / math.sqrt(2)))
    return 2 * lognormal_mean(mu, sigma) * phi


def predicted_speedup(t_comp_1: float, t_sync: float, workers: int, t_sync_1: float = 0.0) -> float:
    """Speedup of R workers over one from the data-parallel model behind T_sync < (R-1)/R x T_comp.

    One step of R workers does the work one process does in T = R x t_comp_1; the R workers take
    T/R + t_sync. So S = T / (T/R + t_sync) = R t_comp_1 / (t_comp_1 + t_sync), and S > 1 exactly
    when t_sync < (R-1)/R x T. ``t_sync_1``: communication the single worker pays too (a parameter
    server job with one worker still pushes and pulls), added to the one-worker baseline.
    """
    return workers * (t_comp_1 + t_sync_1) / (t_comp_1 + t_sync)


# --------------------------------------------------------------------------- driver helpers


def fleetrun(
    *,
    workers: int,
    servers: int = 0,
    strategy: dict[str, Any] | None = None,
    args: list[str] = (),  # type: ignore[assignment]
    timeout: float = 900,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run this file as a fleetrun job; return {"workers": [results by rank], "report": report.json or None, "wall_s"}."""
    with tempfile.TemporaryDirectory(prefix="fleet-bench-") as tmp:
        out = Path(tmp, "results")
        out.mkdir()
        cmd = [sys.executable, "-m", "fleet.launch", "--workers", str(workers), "--log-dir", str(Path(tmp, "logs"))]
        if servers:
            cmd += ["--servers", str(servers)]
        if strategy:
            path = Path(tmp, "strategy.json")
            path.write_text(json.dumps(strategy))
            cmd += ["--strategy", str(path)]
        cmd += [str(WORKER), "--out", str(out), *args]
        started = time.perf_counter()
        child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        child_env.pop("FLEET_INJECT", None)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env)
        wall = time.perf_counter() - started
        if done.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-3000:]}")
        results = sorted((json.loads(p.read_text()) for p in out.glob("worker-*.json")), key=lambda r: r["worker"])
        report_path = Path(tmp, "logs", "report.json")
        report = json.loads(report_path.read_text()) if report_path.exists() else None
    return {"workers": results, "report": report, "wall_s": wall}


def become_local_worker(rank: int, workers: int, port: int) -> None:
    """The environment of collective worker ``rank`` of a job on this host with its master at ``port``."""
    os.environ.update(
        {
            "FLEET_ROLE": "worker",
            "FLEET_WORKER_INDEX": str(rank),
            "FLEET_WORKER_NUM": str(workers),
            "FLEET_MASTER": f"127.0.0.1:{port}",
        }
    )


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_csv(path: Path, header: list[str], rows: list[list[Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def pyplot():
    """matplotlib.pyplot with the Agg backend, or None (plotting is the optional ``bench`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('matplotlib is not installed (pip install ".[bench]"): tables and CSV/JSON only, no PNG.')
        return None
    return plt


RESULTS = ROOT / "benchmarks" / "results"


def machine() -> dict[str, Any]:
    """What ran the benchmark: CPU model, cores, Python, torch (when importable) and the OS."""
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import torch

        torch_version: str | None = torch.__version__
    except ImportError:
        torch_version = None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch_version,
        "platform": platform.platform(),
    }


def loadavg() -> list[float] | None:
    """The 1, 5 and 15-minute load averages (None where the OS has none)."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


# Taken when this module is imported, i.e. when the benchmark script starts.
LOAD_AT_START = loadavg()


def record_result(
    benchmark: str,
    *,
    variant: str,
    figure: str,
    units: str,
    fleet: float | None,
    summary: str,
    peer: str | None = None,
    peer_value: float | None = None,
    ratio: float | None = None,
    ratio_means: str | None = None,
    target: str | None = None,
    headline: bool = True,
    details: dict[str, Any] | None = None,
    argv: list[str] | None = None,
) -> Path:
    """Write one result as ``benchmarks/results/<benchmark>/<UTC time>-<variant>.json``; return its path.

    Every benchmark script records through this function, so the results page of the docs
    (generated from these files by ``benchmarks/history.py``) and the README's headline lines read
    one format. ``fleet`` is fleet's figure in ``units``; ``peer``/``peer_value`` the peer's in the
    same run, where there is one; ``ratio`` as the script defines it (``ratio_means`` says how);
    ``summary`` is the one line the README shows. ``headline=False`` keeps a secondary variant out of
    the README. The load average is taken at import (the script's start) and now. ``FLEET_BENCH_RESULTS``
    names another directory (smoke runs that must not join the history).
    """
    now = datetime.now(UTC)
    args = sys.argv[1:] if argv is None else argv
    started = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] else None
    script = started.name if started is not None and started.parent == WORKER.parent else f"{benchmark}.py"
    record = {
        "benchmark": benchmark,
        "variant": variant,
        "date": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join(["python", f"benchmarks/{script}", *args]),
        "machine": machine(),
        "load": {"before": LOAD_AT_START, "after": loadavg()},
        "figure": figure,
        "units": units,
        "fleet": fleet,
        "peer": None if peer is None else {"name": peer, "value": peer_value},
        "ratio": ratio,
        "ratio_means": ratio_means,
        "target": target,
        "summary": summary,
        "headline": headline,
        "details": details or {},
        "source": f"measured by benchmarks/{script}",
    }
    slug = re.sub(r"[^a-z0-9]+", "-", variant.lower()).strip("-") or "result"
    # FLEET_BENCH_RESULTS: somewhere else (a smoke run that should not join the history)
    path = (
        Path(os.environ.get("FLEET_BENCH_RESULTS") or RESULTS)
        / benchmark
        / f"{now.strftime('%Y%m%dT%H%M%S')}-{slug}.json"
    )
    write_json(path, record)
    print(f"recorded {path}")
    return path


def machine_note() -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{os.cpu_count()} CPU cores, load average {load:.1f} at the start"


# --------------------------------------------------------------------------- the worker


def _ctr_module():
    sys.path.insert(0, str(ROOT / "examples" / "single_to_multi"))
    import train_ctr

    return train_ctr


def _build(workload: str, worker: int, batch: int, lr: float | None):
    import torch

    torch.manual_seed(0)
    if workload == "w1":
        model = torch.nn.Sequential(
            torch.nn.Linear(1024, 2048),
            torch.nn.ReLU(),
            torch.nn.Linear(2048, 2048),
            torch.nn.ReLU(),
            torch.nn.Linear(2048, 10),
        )
        g = torch.Generator().manual_seed(100 + worker)
        data = [(torch.randn(batch, 1024, generator=g), torch.randint(0, 10, (batch,), generator=g)) for _ in range(4)]

        def batches():
            i = 0
            while True:
                yield data[i % 4]
                i += 1

        def loss_of(b):
            return torch.nn.functional.cross_entropy(model(b[0]), b[1])

        return model, lr or 0.01, batches(), loss_of, None
    if workload == "ctr":
        ctr = _ctr_module()
        model = ctr.CTRModel()
        loss_fn = torch.nn.BCEWithLogitsLoss()

        def loss_of(b):
            return loss_fn(model(b[0], b[1]), b[2])

        return model, lr or 0.1, ctr.batches(worker, batch), loss_of, model.embedding
    if workload == "sleep":
        model = torch.nn.Linear(8, 1)
        x = torch.randn(batch, 8, generator=torch.Generator().manual_seed(worker))

        def batches():
            while True:
                yield x

        def loss_of(b):
            return model(b).pow(2).mean()

        return model, lr or 0.01, batches(), loss_of, None
    raise SystemExit(f"unknown workload {workload!r}")


def worker_main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="benchmark worker (run under fleetrun by the benchmark scripts)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--workload", choices=["w1", "ctr", "sleep"], default="ctr")
    parser.add_argument("--steps", type=int, default=100, help="maximum steps")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the timing summary")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--target-loss", type=float, default=None, help="stop once worker 0's smoothed loss reaches it")
    parser.add_argument("--window", type=int, default=10, help="steps in worker 0's smoothed loss")
    parser.add_argument("--extra-steps", type=int, default=5, help="steps worker 0 runs past the target")
    parser.add_argument("--max-seconds", type=float, default=300.0, help="worker 0 stops after this long")
    parser.add_argument(
        "--delay", default=None, help='fleet.runtime.inject spec as JSON, e.g. {"ranks":[3],"delay":{...}}'
    )
    args = parser.parse_args(argv)

    import torch

    import fleet
    from fleet.runtime import inject

    torch.set_num_threads(1)
    fleet.init()  # a parameter server serves here, then exits
    rank, workers = fleet.worker_index(), fleet.worker_num()
    model, lr, data, loss_of, embedding = _build(args.workload, rank, args.batch, args.lr)
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=lr))
    strategy = fleet.runtime.context.current().strategy
    mode = getattr(strategy, "mode", "collective")
    update = getattr(strategy, "update", "sync")
    collective = mode == "collective" and workers > 1
    injector = inject.Injector(inject.parse(args.delay, "--delay") if args.delay else None, rank)
    recorder = fleet.telemetry.timing.recorder()

    pulled = [0.0]  # PS: the sparse pull inside the embedding's forward is communication
    if embedding is not None and mode == "ps":
        starts: list[float] = []
        embedding.register_forward_pre_hook(lambda m, i: starts.append(time.perf_counter()))
        embedding.register_forward_hook(
            lambda m, i, o: pulled.__setitem__(0, pulled[0] + time.perf_counter() - starts.pop())
        )

    stop_file = Path(args.out, "stop")
    fleet.barrier_worker()
    t0 = last = time.perf_counter()
    times, losses, step_s, comm_s = [], [], [], []
    reached_at: int | None = None
    for step in range(args.steps):
        if not collective and rank != 0 and stop_file.exists():
            break
        comm_before, pulled[0] = recorder.total["comm"] + recorder._comm, 0.0
        batch = next(data)
        opt.zero_grad()
        loss = loss_of(batch)
        loss.backward()
        in_step = time.perf_counter()
        opt.step()
        in_step = time.perf_counter() - in_step
        injector.before_boundary()  # the straggler's extra time, counted as its computation
        now = time.perf_counter()
        if collective:
            comm = recorder.total["comm"] + recorder._comm - comm_before
        elif mode == "ps":
            comm = in_step + pulled[0]
        else:
            comm = 0.0
        times.append(now - t0)
        losses.append(float(loss))
        step_s.append(now - last)
        comm_s.append(min(comm, now - last))
        last = now
        stop = False
        if rank == 0 and args.target_loss is not None:
            recent = losses[-args.window :]
            if reached_at is None and len(recent) == args.window and sum(recent) / len(recent) <= args.target_loss:
                reached_at = step
            stop = reached_at is not None and step >= reached_at + args.extra_steps
        if rank == 0 and now - t0 > args.max_seconds:
            stop = True
        if collective and args.target_loss is not None:  # worker 0's decision, to all (a wait: communication)
            flag = torch.tensor([1.0 if stop else 0.0])
            torch.distributed.all_reduce(flag)
            stop = bool(flag.item())
            waited = time.perf_counter() - now
            comm_s[-1] += waited
            step_s[-1] += waited
            last = now = time.perf_counter()
            times[-1] = now - t0
        if stop:
            if rank == 0:
                stop_file.write_text("stop")
            break
    dropped = int(getattr(opt, "stale_dropped", 0) or 0)
    timed = slice(min(args.warmup, max(len(step_s) - 1, 0)), None)
    result = {
        "worker": rank,
        "workers": workers,
        "mode": mode,
        "update": update,
        "steps": len(step_s),
        "t": times,
        "loss": losses,
        "step_mean_s": mean(step_s[timed]),
        "comm_mean_s": mean(comm_s[timed]),
        "step_s": step_s,
        "comm_s": comm_s,
        "dropped": dropped,
        "batch": args.batch,
        "wall_s": time.perf_counter() - t0,
        "straggler": injector.active,
    }
    Path(args.out, f"worker-{rank}.json").write_text(json.dumps(result))
    fleet.stop_worker()


if __name__ == "__main__":
    worker_main()


def save_figure(fig: Any, name: str, tight: bool = True) -> None:
    """Lay out (unless ``tight`` is False: the caller placed things itself) and write ``docs/figures/<name>.png``."""
    if tight:
        fig.tight_layout()
    path = FIGURES / f"{name}.png"
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
