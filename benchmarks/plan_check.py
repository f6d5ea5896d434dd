"""fleet.plan's placement recommendation against the measured best, on W6 and W2 (issue 38).

    python benchmarks/plan_check.py [--workloads w6,w2] [--rounds 2] [--steps 60] [--json FILE]
    python benchmarks/plan_check.py --predict-only           # calibrate and predict, no measured jobs
    python benchmarks/plan_check.py --calibration-dir DIR    # reuse DIR/<workload>/calibration.json

For each workload:

1. **Calibrate** as ``fleetrun --plan`` does (:func:`fleet.plan.planner.run_probe`, ``run_measure``): the
   workload's own worker script timed as one worker, then the all-reduce, the parameter-server
   transport and the server's apply rates measured by two workers on this host. The tables'
   sizes come from the workload's definition, their unique ids per step from sample batches
   (:func:`w6_workload`, :func:`w2_workload`), the dense bytes from its dense layers.
2. **Predict** every placement for 2 workers and 1 server on this host
   (:func:`fleet.plan.placement.recommend`): once with one process's math required, once with
   stale updates allowed.
3. **Measure** each placement: the same worker script under ``python -m fleet.launch --workers 2``
   with the placement's strategy file (W6: ``benchmarks/w6_dlrm.py --role worker``, the job its
   ``fleet-*`` configurations run; W2: ``examples/single_to_multi/train_ctr.py``, as
   ``benchmarks/w2_ctr.py`` runs it), every placement once per round, the order reversed on odd
   rounds; the median samples/s over rounds, with the host's load beside it. The one-process run
   (W6's ``fleet-1p``, W2's script alone on the union batch) is printed as a reference.

Printed per workload: predicted and measured samples/s of each placement, both rankings, and
whether the recommended placement is the measured best (among the placements its rule allowed).
The figures depend on the load of this shared 2-core host: rerun to check a change.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fleet.plan.placement import CANDIDATES

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "peers"))

W6_SCRIPT = HERE / "w6_dlrm.py"
W2_SCRIPT = ROOT / "examples" / "single_to_multi" / "train_ctr.py"
WORKERS, SERVERS = 2, 1

# The strategy file of each placement (fleet.plan.placement.STRATEGIES, as TOML).
STRATEGY_FILES = {
    "replicated": 'mode = "collective"\ntable_placement = "replicated"\n',
    "sharded": 'mode = "collective"\ntable_placement = "sharded"\n',
    "table_wise": 'mode = "collective"\ntable_placement = "table_wise"\n',
    "sharding": 'mode = "sharding"\n',
    "ps_sync": 'mode = "ps"\nupdate = "sync"\n',
    "ps_sync_dense_ar": 'mode = "ps"\nupdate = "sync"\ndense_placement = "allreduce"\n',
    "ps_async": 'mode = "ps"\nupdate = "async"\n',
    "ps_async_dense_ar": 'mode = "ps"\nupdate = "async"\ndense_placement = "allreduce"\n',
    "ps_geo": 'mode = "ps"\nupdate = "geo"\nk_steps = 100\n',
}
MEASURED = tuple(name for name in CANDIDATES if name != "ps_geo")  # geo's k_steps make it another workload
W6_CONFIG = {  # the w6_dlrm.py configuration that runs the same job, for reading its --json
    "sharded": "fleet-sharded",
    "table_wise": "fleet-table-wise",
    "sharding": "fleet-sharding",
    "ps_sync": "fleet-ps-sync",
    "ps_async": "fleet-ps-async",
    "ps_async_dense_ar": "fleet-ps-async-dense-ar",
    "ps_sync_dense_ar": "fleet-ps-sync-dense-ar",
}


# --------------------------------------------------------------------------- the workloads


def w6_workload(batch: int = 256, samples: int = 4) -> tuple[Any, int]:
    """W6's tables (benchmarks/peers/dlrm_workload.py, ``full``) with their unique ids per step, and batch."""
    import dlrm_workload as W

    from fleet.plan.placement import Table, Workload

    spec = W.spec("full", batch)
    unique = [0.0] * len(spec.tables)
    lookups = [0.0] * len(spec.tables)
    for step in range(samples):
        _, feats, _ = W.make_batch(spec, 0, step)
        for t, (ids, _) in enumerate(feats):
            unique[t] += ids.unique().numel() / samples
            lookups[t] += ids.numel() / samples
    dense = sum(p.numel() * p.element_size() for p in W.dense_part(spec).parameters())
    tables = tuple(
        Table(rows, dim, unique[t], name=name, lookups_per_step=lookups[t])
        for t, ((rows, dim), name) in enumerate(zip(spec.tables, spec.names, strict=True))
    )
    return Workload(tables, dense, state=1.0), batch  # SGD


def w2_workload(batch: int = 512, samples: int = 4) -> tuple[Any, int]:
    """W2's one table (1 M ids, dim 16) with its unique ids per step, and its MLP's bytes."""
    import torch

    from fleet.plan.placement import Table, Workload

    slots, dim, dense_in, id_space = 26, 16, 13, 1_000_000  # examples/single_to_multi/train_ctr.py
    g = torch.Generator().manual_seed(1)
    unique = statistics.fmean(
        torch.randint(0, id_space, (batch, slots), generator=g).unique().numel() for _ in range(samples)
    )  # each of the 26 slots is a feature of the one table: table-wise, 26 pooled vectors a sample come back
    widths = [slots * dim + dense_in, 400, 400, 400, 1]
    dense = 4 * sum(a * b + b for a, b in zip(widths, widths[1:], strict=False))
    table = Table(id_space, dim, unique, name="embedding", features=slots, lookups_per_step=batch * slots)
    return Workload((table,), dense, state=1.0), batch


def worker_command(workload: str, report: str, steps: int, warmup: int) -> list[str]:
    if workload == "w6":
        return [str(W6_SCRIPT), "--steps", str(steps), "--warmup", str(warmup), "--report", report, "--role", "worker"]
    return [str(W2_SCRIPT), "--steps", str(steps), "--warmup", str(warmup), "--report", report]


def one_process_command(workload: str, report: str, steps: int, warmup: int) -> list[str]:
    """The reference: one process on the union of the 2 workers' batches."""
    if workload == "w6":
        cmd = [str(W6_SCRIPT), "--steps", str(steps), "--warmup", str(warmup), "--report", report]
        return [sys.executable, *cmd, "--role", "local", "--system", "fleet"]
    return [sys.executable, *worker_command(workload, report, steps, warmup), "--batch", str(WORKERS * 512)]


# --------------------------------------------------------------------------- calibration


def calibrate(workload: str, work: Any, log_dir: Path, batch: int) -> Any:
    """A :class:`~fleet.plan.calibration.Calibration` of the workload's worker script on this host."""
    from fleet.plan import planner
    from fleet.plan.placement import calibration_for

    path = log_dir / "calibration.json"
    if path.exists():
        from fleet.plan.calibration import Calibration

        print(f"{workload}: calibration from {path}", flush=True)
        return Calibration.load(path)
    report = str(log_dir / "probe-report.jsonl")
    args = worker_command(workload, report, 100000, 0)
    script, rest = Path(args[0]), tuple(args[1:])
    print(f"{workload}: timing the worker script as one worker", flush=True)
    probe = planner.run_probe(script, rest, log_dir, planner.PROBE_STEPS, planner.PROBE_SECONDS)
    # The transport replay carries the workload's rows: its unique ids per step and their width.
    eff = calibration_for(_stub(), work)
    probe["sparse_rows"] = [round(eff.sparse_rows)]
    probe["sparse_dim"] = eff.sparse_dim
    probe["sparse_new_rows"] = probe.get("sparse_new_rows") or [0]
    probe["batch"] = probe.get("batch") or batch  # the worker script passes no loader: the workload's batch
    print(f"{workload}: measuring all-reduce and the parameter-server transport (2 workers)", flush=True)
    net = planner.run_measure(log_dir, probe)
    cal = planner.build(probe, net, " ".join(str(a) for a in args))
    cal.save(path)
    return cal


def _stub() -> Any:
    from fleet.plan.calibration import Calibration, Link

    return Calibration(cores=1, t_comp_s=1.0, allreduce=Link(latency_s=0, bandwidth_Bps=1))


# --------------------------------------------------------------------------- measurement


def run_job(workload: str, name: str, steps: int, warmup: int, timeout: float) -> float:
    """Total samples/s of one job of ``name`` (a placement, or "one process")."""
    with tempfile.TemporaryDirectory(prefix=f"plan-check-{workload}-{name}-") as tmp:
        report = os.path.join(tmp, "report.jsonl")
        if name == "one process":
            cmd, expect = one_process_command(workload, report, steps, warmup), 1
        else:
            strategy = os.path.join(tmp, "strategy.toml")
            Path(strategy).write_text(STRATEGY_FILES[name])
            servers = ["--servers", str(SERVERS)] if name.startswith("ps_") else []
            cmd = [sys.executable, "-m", "fleet.launch", *servers, "--workers", str(WORKERS), "--strategy", strategy]
            cmd += ["--log-dir", os.path.join(tmp, "logs"), *worker_command(workload, report, steps, warmup)]
            expect = WORKERS
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        results = []
        if os.path.exists(report):
            results = [json.loads(line) for line in Path(report).read_text().splitlines() if line.strip()]
        if done.returncode != 0 or len(results) != expect:
            raise RuntimeError(
                f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-1500:]}{done.stderr[-1500:]}"
            )
        return sum(r["samples_per_s"] for r in results)


def measure(workload: str, names: list[str], rounds: int, steps: int, warmup: int, timeout: float) -> dict:
    samples: dict[str, list[float]] = {n: [] for n in names}
    loads: dict[str, list[float]] = {n: [] for n in names}
    failures: dict[str, str] = {}
    for rnd in range(rounds):
        for name in names if rnd % 2 == 0 else names[::-1]:
            if name in failures:
                continue
            load = os.getloadavg()[0]
            try:
                rate = run_job(workload, name, steps, warmup, timeout)
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                failures[name] = str(error).splitlines()[0][:300]
                print(f"  round {rnd + 1}: {name}: FAILED {failures[name]}", flush=True)
                continue
            samples[name].append(rate)
            loads[name].append((load + os.getloadavg()[0]) / 2)
            print(f"  round {rnd + 1}: {name:18s} {rate:9,.0f} samples/s  load {loads[name][-1]:.1f}", flush=True)
    return {
        n: {"samples_per_s": statistics.median(v), "all": v, "load": statistics.median(loads[n])}
        for n, v in samples.items()
        if v
    } | {n: {"failed": f} for n, f in failures.items()}


def from_w6_json(path: str) -> dict:
    """The measured figures of a ``benchmarks/w6_dlrm.py --json FILE`` run, by placement."""
    data = json.loads(Path(path).read_text())
    out = {}
    for c in data["configs"]:
        values = [s["samples_per_s"] for s in c["samples"]]
        names = [n for n, cfg in W6_CONFIG.items() if cfg == c["name"]] or (
            ["one process"] if c["name"] == "fleet-1p" else []
        )
        if values and names:
            load = statistics.median(s["load"] for s in c["samples"])
            out[names[0]] = {"samples_per_s": statistics.median(values), "all": values, "load": load}
    return out


# --------------------------------------------------------------------------- the check


def check(workload: str, args: argparse.Namespace) -> dict:
    from fleet.plan.placement import CANDIDATES, LABELS, STALE, STALE_NOTE, Cluster, recommend

    work, batch = w6_workload() if workload == "w6" else w2_workload()
    log_dir = Path(args.calibration_dir or tempfile.mkdtemp(prefix="plan-check-")) / workload
    log_dir.mkdir(parents=True, exist_ok=True)
    cal = calibrate(workload, work, log_dir, batch)
    memory = _host_memory() / (WORKERS + SERVERS)
    # this host is shared: the jobs run beside the load the calibration saw (not a dedicated host's)
    cluster = Cluster(
        workers=WORKERS,
        workers_per_host=WORKERS,
        servers=SERVERS,
        worker_memory_bytes=memory,
        background=cal.background,
    )
    # geo is left out: its exchange every k = 100 steps falls outside a 60-step measurement
    only = tuple(n for n in CANDIDATES if n != "ps_geo")
    sync = recommend(cal, work, cluster, batch, only)
    stale = recommend(cal, dataclasses.replace(work, sync_required=False), cluster, batch, only)
    predicted = {c.name: c for c in stale.candidates}
    print(
        f"\n{workload.upper()}: tables {sum(t.value_total for t in work.tables) / 1e9:.2f} GB, "
        f"{work.ids_per_step:,.0f} unique ids per worker-step, dense {work.dense_bytes / 1e6:.2f} MB, batch {batch}; "
        f"{WORKERS} workers + {SERVERS} server on this host ({cal.cores} cores); computation "
        f"{cal.t_comp_s * 1e3:.1f} ms per step alone, background {cal.background:.1f} busy processes while calibrating"
    )
    measured: dict = {}
    if args.measured:
        saved = {r["workload"]: r["measured"] for r in json.loads(Path(args.measured).read_text())}
        measured = saved.get(workload, {})
    elif args.w6_json and workload == "w6":
        measured = from_w6_json(args.w6_json)
    elif not args.predict_only:
        names = ["one process", *[n for n in MEASURED if predicted[n].step_s is not None]]
        measured = measure(workload, names, args.rounds, args.steps, args.warmup, args.timeout)
    rows = []
    for name in [n for n in predicted if predicted[n].step_s is not None]:
        got = measured.get(name, {})
        rows.append((name, predicted[name].samples_per_s, got.get("samples_per_s"), got.get("load")))
    print("| placement | strategy | predicted samples/s | measured samples/s | load |")
    print("|---|---|---|---|---|")
    for name, pred, meas, load in rows:
        print(
            f"| {LABELS[name]} | `{predicted[name].strategy}` | {pred:,.0f} | "
            f"{'-' if meas is None else f'{meas:,.0f}'} | {'' if load is None else f'{load:.1f}'} |"
        )
    if "one process" in measured and "samples_per_s" in measured["one process"]:
        one = measured["one process"]
        print(f"| one process (reference) | no fleet job | - | {one['samples_per_s']:,.0f} | {one['load']:.1f} |")
    both = [(n, p, m) for n, p, m, _ in rows if m is not None]
    pred_rank = [n for n, _, _ in sorted(both, key=lambda r: -r[1])]
    meas_rank = [n for n, _, _ in sorted(both, key=lambda r: -r[2])]
    print(f"predicted ranking: {' > '.join(pred_rank) or '-'}")
    print(f"measured ranking:  {' > '.join(meas_rank) or '-'}")
    verdicts = {}
    for label, rec, allowed in (("one process's math", sync, lambda n: n not in STALE), ("stale allowed", stale, None)):
        pool = [n for n in meas_rank if allowed is None or allowed(n)]
        best = pool[0] if pool else None
        ok = None if best is None else rec.best.name == best
        mine = measured.get(rec.best.name, {}).get("samples_per_s")
        share = mine / measured[best]["samples_per_s"] if mine and best else None
        verdicts[label] = {"recommended": rec.best.name, "measured_best": best, "match": ok, "of_best": share}
        status = "not measured" if ok is None else ("matches" if ok else "DIFFERS from")
        print(f"recommended ({label}): {rec.best.strategy}  -- {rec.reason}")
        print(
            f"  {status} the measured best{f' ({best})' if best else ''}"
            + (f"; measured at {share:.2f} x the best" if share is not None and not ok else "")
        )
    for c in stale.candidates:
        if c.ruled_out and c.ruled_out != STALE_NOTE:
            print(f"  ruled out: {LABELS[c.name]}: {c.ruled_out}")
    return {
        "workload": workload,
        "calibration": cal.model_dump(),
        "predicted": {n: p for n, p, _, _ in rows},
        "measured": measured,
        "predicted_ranking": pred_rank,
        "measured_ranking": meas_rank,
        "verdicts": verdicts,
    }


def _host_memory() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 8e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="w6,w2")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    parser.add_argument("--predict-only", action="store_true", help="calibrate and predict; run no measured job")
    parser.add_argument("--calibration-dir", default=None, help="keep (and reuse) the calibrations here")
    parser.add_argument("--w6-json", default=None, help="W6's measured figures from a w6_dlrm.py --json FILE run")
    parser.add_argument("--measured", default=None, help="reuse the measurements of an earlier --json FILE")
    parser.add_argument("--json", default=None, help="write the predictions and measurements here")
    args = parser.parse_args()
    started = time.time()
    print(f"plan check on {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}", flush=True)
    results = []
    for workload in (w for w in args.workloads.split(",") if w):
        results.append(check(workload, args))
        if args.json:  # after each workload: a long run stopped midway keeps what it measured
            Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    print(f"\n({time.time() - started:.0f} s; load {os.getloadavg()[0]:.1f} at the end)")


if __name__ == "__main__":
    main()
