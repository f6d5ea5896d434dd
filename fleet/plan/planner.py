"""``fleetrun --plan script.py [args]``: calibrate on this machine, then print the predicted scaling.

1. The script runs for a short while as one worker under fleetrun (:mod:`fleet.plan.probe`):
   computation per step and its spread, gradient bytes, sparse rows, device, batch size.
2. Unless ``--calibration FILE`` gives transport measurements taken elsewhere (between two
   hosts of the real cluster), a two-worker job of :mod:`fleet.plan.measure` measures the
   all-reduce and the parameter-server transport here, and the server's apply rates.
3. :mod:`fleet.plan.model` predicts every mode at 1, 2, 4, ..., 1,024 workers (``--plan-workers``)
   with ``--workers`` workers per host and ``--servers`` servers per host (1 when not given),
   and the planner prints the table, where the speed-up condition breaks, the strategy it
   recommends and the assumptions it made. ``calibration.json`` stays in the log directory
   (``python -m fleet.plan predict --calibration FILE`` prints the table again from it).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from fleet.plan import measure_path, probe_path
from fleet.plan.calibration import Calibration, Link, fit_link, lognormal_sigma
from fleet.plan.host import CpuMeter, memory_bytes
from fleet.plan.lognormal import LogNormal
from fleet.plan.model import DEFAULT_COUNTS, LABELS, MODES, SYNC_MODES, Model, Prediction, Setup, breaks_at
from fleet.plan.placement import Cluster, Recommendation, Workload, gb, workload_from
from fleet.plan.placement import recommend as recommend_placement

if TYPE_CHECKING:
    from fleet.plan.table_steps import TableShape

PROBE_STEPS, PROBE_SECONDS = 30, 20.0
START_BUDGET_S = 180.0  # imports, data loading and fleet.init before the first step


class PlanError(RuntimeError):
    """A calibration run that failed; the message names the run and shows its last lines."""


class PlanArgumentError(ValueError):
    """A mistake in the planning options (``--plan-workers``), explained for the user."""


def worker_counts(text: str | None) -> tuple[int, ...] | None:
    """``--plan-workers 1,8,64``; None: the default 1, 2, 4, ..., 1,024."""
    if text is None:
        return None
    try:
        counts = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise PlanArgumentError(
            f"--plan-workers {text!r} is not a list of numbers; give e.g. --plan-workers 1,8,64."
        ) from None
    if not counts or counts[0] < 1:
        raise PlanArgumentError(
            f"--plan-workers {text!r}: give worker counts of 1 or more, e.g. --plan-workers 1,8,64."
        )
    return counts


# --------------------------------------------------------------------------- calibration


def _run(command: list[str], log: Path, timeout: float, what: str) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        try:
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, env=_child_env())
        except subprocess.TimeoutExpired:
            raise PlanError(f"{what} did not finish within {timeout:.0f} s. Its output: {log}\n{_tail(log)}") from None
    if done.returncode != 0:
        raise PlanError(f"{what} failed (exit status {done.returncode}). Its last lines ({log}):\n{_tail(log)}")


def _child_env() -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_") or k == "FLEET_SECRET"}
    environ.update({"NO_COLOR": "1", "COLUMNS": "160", "PYTHONUNBUFFERED": "1"})
    return environ


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no output)"


def run_probe(script: Path, args: tuple[str, ...], log_dir: Path, steps: int, seconds: float) -> dict[str, Any]:
    """Run the script as one worker until ``steps`` timed steps or ``seconds``; the probe's record."""
    out = log_dir / "probe.json"
    out.unlink(missing_ok=True)
    command = [sys.executable, "-m", "fleet.launch", "--workers", "1", "--log-dir", str(log_dir / "probe")]
    command += [str(probe_path()), "--out", str(out), "--steps", str(steps), "--seconds", str(seconds)]
    command += [str(script), *args]
    with CpuMeter() as meter:
        _run(command, log_dir / "probe.log", START_BUDGET_S + seconds + 60, f"the calibration run of {script.name}")
    if not out.exists():
        raise PlanError(f"the calibration run of {script.name} wrote no record ({log_dir / 'probe.log'}).")
    record = json.loads(out.read_text())
    record["background"] = meter.background(record.get("threads") or 1)
    if record["steps"] < 2:
        raise PlanError(
            f"{script.name} made {record['steps']} timed optimizer steps in its calibration run (after "
            f"{record['warmup']} warm-up steps); the plan needs at least 2. Does the script call "
            f"optimizer.step() in a loop? Its output: {log_dir / 'probe.log'}"
        )
    return record


def run_measure(log_dir: Path, probe: dict[str, Any], reps: int = 7) -> dict[str, Any]:
    """The two-worker transport and server micro-benchmarks on this host."""
    out = log_dir / "transport.json"
    rows = max(1, round(sum(probe["sparse_rows"]) / max(1, len(probe["sparse_rows"]))))
    max_bytes = min(64 * 2**20, max(2**20, 2 * probe["dense_bytes"]))
    command = [sys.executable, "-m", "fleet.launch", "--workers", "2", "--log-dir", str(log_dir / "transport")]
    command += [str(measure_path()), "--out", str(out), "--device", probe["device"], "--max-bytes", str(max_bytes)]
    command += ["--reps", str(reps), "--optimizer", probe["optimizer"] or "sgd"]
    command += ["--dense-bytes", str(max(4096, probe["dense_bytes"]))]
    new = round(sum(probe.get("sparse_new_rows") or [0]) / max(1, len(probe.get("sparse_new_rows") or [0])))
    command += [
        "--sparse-dim",
        str(probe["sparse_dim"] or 16),
        "--sparse-rows",
        str(rows if probe["sparse_dim"] else 0),
    ]
    command += ["--sparse-new", str(min(new, rows))]
    _run(command, log_dir / "transport.log", 300, "the transport measurement (2 workers)")
    net = json.loads(out.read_text())
    steps = run_table_steps(log_dir, probe)
    if steps:
        net["table_steps"] = steps
    return net


def table_shapes(probe: dict[str, Any]) -> list[TableShape]:
    """The probe's tables as :class:`fleet.plan.table_steps.TableShape` (none from records taken before it
    counted lookups)."""
    from fleet.plan.table_steps import TableShape  # here: that module imports torch, fleetrun --plan does not

    shapes = []
    for t in probe.get("tables") or []:
        ids, lookups = t.get("ids") or [], t.get("lookups") or []
        if not ids or not lookups or "kind" not in t:
            return []
        mean_lookups = round(sum(lookups) / len(lookups))
        if mean_lookups < 1:
            continue
        shapes.append(
            TableShape(t["kind"], int(t["dim"]), round(sum(ids) / len(ids)), mean_lookups, int(t.get("features") or 1))
        )
    return shapes


def run_table_steps(log_dir: Path, probe: dict[str, Any], rounds: int = 2) -> dict[str, float]:
    """The script's tables (a stand-in) alone and sharded each way across 2 workers on this host, seconds per
    step (:mod:`fleet.plan.table_steps`; one job per placement). Empty where there is nothing to measure."""
    from fleet.plan import table_steps

    shapes = table_shapes(probe)
    if not shapes or (probe.get("device") or "cpu") != "cpu" or not probe.get("batch"):
        return {}
    steps: dict[str, list[float]] = {}
    # two rounds, the order reversed in the second: a shared host's stall then lands on different placements
    order = [*table_steps.PLACEMENTS, *reversed(table_steps.PLACEMENTS)][: rounds * len(table_steps.PLACEMENTS)]
    for placement in order:
        out = log_dir / f"table_steps_{placement}.json"
        command = [sys.executable, "-m", "fleet.launch", "--workers", "2", "--log-dir", str(log_dir / "table_steps")]
        command += [str(Path(table_steps.__file__)), "--out", str(out), "--placement", placement]
        command += ["--tables", table_steps.encode_all(shapes), "--batch", str(probe["batch"])]
        _run(command, log_dir / f"table_steps_{placement}.log", 300, f"the tables' step measurement ({placement})")
        for key, value in json.loads(out.read_text()).items():
            if key in ("local", placement):
                steps.setdefault(key, []).append(float(value))
    return {key: statistics.median(values) for key, values in steps.items()}


def build(probe: dict[str, Any], net: dict[str, Any], script: str = "") -> Calibration:
    """A :class:`Calibration` from a probe record and a transport measurement (both plain JSON)."""
    compute = [t for t in probe["compute_s"] if t > 0]
    if len(compute) < 2:
        raise ValueError(f"the probe timed {len(compute)} steps; at least 2 are needed")
    sigma = lognormal_sigma(compute)
    median = sorted(compute)[len(compute) // 2]
    dist = LogNormal(math.log(median), sigma)
    rows = probe.get("sparse_rows") or [0]
    loopback = bool(net.get("loopback", True))
    where = "127.0.0.1" if loopback else f"{net.get('master_host')} <-> the other host"
    allreduce_pts = [tuple(p) for p in net["allreduce"]]
    lat, bw = fit_link(allreduce_pts, messages=2)
    assumptions = [
        "every worker computes like the calibrated one (same hardware, same per-worker batch: weak scaling)",
        "the gradient all-reduce does not overlap the backward pass",
    ]
    if loopback:
        assumptions.append(
            f"between hosts the network is as fast as this host's loopback ({lat * 1e6:.0f} us per message, "
            f"{bw / 1e6:,.0f} MB/s); measure your network with fleet/plan/measure.py on two hosts and pass "
            "--calibration (docs/scaling.md)"
        )
    cal: dict[str, Any] = {
        "script": script,
        "device": probe.get("device") or "cpu",
        "cores": int(net.get("cores") or os.cpu_count() or 1),
        "threads": int(probe.get("threads") or 1),
        "background": probe["background"]
        if "background" in probe
        else max(0.0, (probe.get("load_average") or 0.0) - 1),
        "t_comp_s": dist.mean,
        "step_sigma": sigma,
        "steps_timed": len(compute),
        "batch": probe.get("batch"),
        "dense_bytes": int(probe.get("dense_bytes") or 0),
        "sparse_rows": sum(rows) / len(rows),
        "sparse_new_rows": sum(new := probe.get("sparse_new_rows") or [0]) / len(new),
        "sparse_dim": int(probe.get("sparse_dim") or 0),
        "tables": [
            {
                "dim": t["dim"],
                "ids_per_step": sum(t["ids"]) / len(t["ids"]) if t.get("ids") else 0.0,
                "rows_seen": t.get("rows_seen") or 0,
                "max_rows": t.get("max_rows"),
            }
            for t in probe.get("tables") or []
        ],
        "sparse_local_s": sum(local := probe.get("sparse_s") or [0.0]) / len(local),
        "allreduce": Link(latency_s=lat, bandwidth_Bps=bw, loopback=loopback, where=where, points=allreduce_pts),
        "round_s": net.get("round_s"),
        "table_steps_s": net.get("table_steps") or {},
        "load_average": probe.get("load_average"),
        "assumptions": assumptions,
    }
    if net.get("ps"):
        ps_pts = [tuple(p) for p in net["ps"]["dense_pull"]]
        ps_lat, ps_bw = fit_link(ps_pts, messages=1)
        cal["ps"] = Link(latency_s=ps_lat, bandwidth_Bps=ps_bw, loopback=loopback, where=where, points=ps_pts)
        apply = net.get("apply") or {}
        cal["optimizer"] = apply.get("optimizer", "sgd")
        for key in ("dense_apply_Bps", "sparse_apply_rows_s", "sparse_pull_rows_s", "sparse_create_rows_s"):
            cal[key] = apply.get(key)
        cal["ps_request_s"] = net["ps"].get("request_s", 0.0)
        if "replay_step_s" in net["ps"]:
            cal["ps_step_s"] = net["ps"]["replay_step_s"]
            cal["ps_sparse_pull_s"] = net["ps"]["replay_sparse_pull_s"]
            cal["ps_server_step_s"] = (net["ps"].get("server_cpu_s") or 0.0) / net["ps"]["replay_steps"]
            cal["ps_client_step_s"] = (net["ps"].get("client_cpu_s") or 0.0) / net["ps"]["replay_steps"]
        if cal["sparse_rows"]:
            assumptions.append("geo: the sparse rows touched in k steps are all distinct (the most traffic)")
    if table_shapes(probe) and not cal["table_steps_s"]:
        assumptions.append(
            "sharded tables: their cost estimated from row rates, not measured (the tables' step is measured on "
            "CPU where the batch size is known)"
        )
    if not cal["batch"]:
        assumptions.append(
            "samples/s: not shown, the batch size is unknown (the script passes no DataLoader to "
            "fleet.distributed_loader); call fleet.telemetry.timing.set_batch_size(n) in the script to see them"
        )
    return Calibration(**cal)


def load_transport(path: Path) -> dict[str, Any]:
    """A measure.py result, or the transport half of a saved calibration.json, as measure.py writes it."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise PlanError(f"--calibration {path}: cannot read it as JSON ({error})") from None
    if isinstance(data.get("allreduce"), list):
        return data
    if isinstance(data.get("allreduce"), dict):
        cal = Calibration.model_validate(data)
        net: dict[str, Any] = {
            "loopback": cal.allreduce.loopback,
            "cores": cal.cores,
            "master_host": cal.allreduce.where,
        }
        net["allreduce"] = cal.allreduce.points
        net["round_s"] = cal.round_s
        if cal.table_steps_s:
            net["table_steps"] = dict(cal.table_steps_s)
        if cal.ps is not None:
            net["ps"] = {"dense_pull": cal.ps.points}
            net["apply"] = {
                k: getattr(cal, k) for k in ("dense_apply_Bps", "sparse_apply_rows_s", "sparse_pull_rows_s")
            }
            net["apply"]["optimizer"] = cal.optimizer
        return net
    raise PlanError(f"--calibration {path} holds neither fleet/plan/measure.py's output nor a calibration.json.")


# --------------------------------------------------------------------------- the report


def _mode_of(strategy_path: Path | None) -> str | None:
    if strategy_path is None:
        return None
    from fleet.strategy import DistributedStrategy

    s = DistributedStrategy.from_file(strategy_path)
    if s.mode == "collective":
        return "collective"
    if s.mode != "ps":
        return None
    # the planner's labels are "ps_" + the update mode's name; backup workers (sync only) are their own
    return "ps_backup" if s.backup_workers else f"ps_{s.update}"


def recommend(preds: list[Prediction]) -> tuple[str, int, str]:
    """(mode, up to how many workers, why): the fastest synchronous mode while it scales at >= 50 % efficiency.

    Synchronous modes compute what one process would (or, with backups, nearly), so they are
    preferred; async and geo are named as the alternative when they are much faster, with
    their cost (stale or local updates), which the throughput table cannot show.
    """
    counts = sorted({p.workers for p in preds})
    best: dict[int, Prediction] = {}
    for r in counts:
        candidates = [p for p in preds if p.workers == r and p.mode in SYNC_MODES]
        best[r] = max(candidates, key=lambda p: p.speedup)
    usable = [r for r in counts if best[r].speedup >= 0.5 * r]
    top = max(usable) if usable else 1
    mode = best[top].mode
    why = (
        f"{LABELS[mode]}: the highest predicted speed-up among the synchronous modes, "
        f"{best[top].speedup:.1f}x at {top} workers with at least half of the ideal speed-up"
    )
    beyond = [r for r in counts if r > top]
    if beyond:
        r = beyond[0]
        why += f"; at {r} workers it would be {best[r].speedup:.1f}x ({best[r].speedup / r:.0%} efficiency)"
    fast = [p for p in preds if p.mode in ("ps_async", "ps_geo") and p.workers == counts[-1]]
    if fast:
        alt = max(fast, key=lambda p: p.speedup)
        if alt.speedup > 1.5 * best[counts[-1]].speedup:
            why += (
                f". {LABELS[alt.mode]} reaches {alt.speedup:.0f}x at {alt.workers} workers in samples/s, but its "
                "updates are stale (async) or local (geo): worth it only if your model still converges per sample"
            )
    return mode, top, why


def _cell(p: Prediction) -> Text:
    text = f"{p.speedup:,.1f}x" if p.speedup < 100 else f"{p.speedup:,.0f}x"
    if p.holds is False:
        return Text(text + " !", style="yellow")
    return Text(text)


def report(cal: Calibration, preds: list[Prediction], setup_note: str, chosen: str | None, console: Console) -> str:
    """Print the plan; returns the recommended mode."""
    console.print(Text("fleet plan: predicted speed-up over one process running the script alone", style="bold"))
    lines = [
        f"calibrated: {cal.script}",
        f"  computation {cal.t_comp_s * 1e3:.1f} ms per step (log-normal sigma {cal.step_sigma:.2f}, {cal.steps_timed} steps"
        f"{', batch ' + str(cal.batch) if cal.batch else ''}), {cal.threads} thread(s), {cal.device}, "
        f"{cal.cores} cores, load average {cal.load_average or 0:.1f}",
        f"  gradients {cal.dense_bytes / 2**20:,.2f} MB dense"
        + (f", {cal.sparse_rows:,.0f} sparse rows of {cal.sparse_dim}" if cal.sparse_rows else "")
        + " per step",
        f"  all-reduce ({cal.allreduce.where}): {cal.allreduce.latency_s * 1e6:,.0f} us per message, "
        f"{cal.allreduce.bandwidth_Bps / 1e6:,.0f} MB/s",
    ]
    if cal.ps is not None:
        lines.append(
            f"  parameter server: {cal.ps.latency_s * 1e6:,.0f} us per request, {cal.ps.bandwidth_Bps / 1e6:,.0f} MB/s; "
            f"applies {(cal.dense_apply_Bps or 0) / 1e9:,.1f} GB/s dense ({cal.optimizer}), "
            f"{(cal.sparse_apply_rows_s or 0) / 1e6:,.1f} M sparse rows/s"
        )
    lines.append(f"  {setup_note}")
    for line in lines:
        console.print(line)
    modes = [m for m in MODES if any(p.mode == m for p in preds)]
    table = Table(show_edge=False, pad_edge=False, title_justify="left")
    table.add_column("workers", justify="right")
    for m in modes:
        table.add_column(LABELS[m] + (" (yours)" if m == chosen else ""), justify="right")
    table.add_column("samples/s (best sync)", justify="right")
    for r in sorted({p.workers for p in preds}):
        row = {p.mode: p for p in preds if p.workers == r}
        sync = max((row[m] for m in modes if m in SYNC_MODES), key=lambda p: p.speedup)
        rate = "-" if sync.samples_per_s is None else f"{sync.samples_per_s:,.0f}"
        table.add_row(str(r), *[_cell(row[m]) for m in modes], rate)
    console.print(table)
    console.print(Text("!: the speed-up condition T_sync < (R-1)/R x T_comp fails there", style="dim"))
    for m in modes:
        at = breaks_at(preds, m)
        if at is None:
            console.print(
                f"  {LABELS[m]}: the speed-up condition holds up to {max(p.workers for p in preds):,} workers"
            )
        else:
            p = next(p for p in preds if p.mode == m and p.workers == at)
            console.print(
                f"  {LABELS[m]}: the speed-up condition breaks at {at:,} workers "
                f"(T_sync {p.t_sync_s * 1e3:,.1f} ms >= {p.condition['bound_s'] * 1e3:,.1f} ms; "
                f"largest part: {max(((k, v) for k, v in p.parts.items() if k != 'compute'), key=lambda kv: kv[1])[0]})"
            )
    mode, top, why = recommend(preds)
    console.print(Text(f"recommended: {why}.", style="bold green"))
    console.print("assumptions:")
    for a in cal.assumptions:
        console.print(f"  - {a}")
    return mode


def plan(
    config: Any,
    log_dir: Path,
    calibration: str | None = None,
    counts: tuple[int, ...] | None = None,
    console: Console | None = None,
    say: Callable[[str], None] | None = None,
) -> int:
    """fleetrun --plan: returns the exit status (0 on success).

    ``config`` is fleetrun's checked launch configuration (its ``script``, ``script_args``,
    ``workers``, ``servers`` and ``strategy``); the launcher makes ``log_dir``, so planning
    never imports the launcher.
    """
    console = console or Console(highlight=False)
    say = say or (lambda text: console.print(Text(f"[fleetrun] {text}", style="dim")))
    counts = counts or DEFAULT_COUNTS
    script = Path(config.script)
    try:
        chosen = _mode_of(config.strategy.path if config.strategy is not None else None)
        say(f"plan: timing {script.name} as one worker (up to {PROBE_STEPS} steps or {PROBE_SECONDS:.0f} s)")
        started = time.monotonic()
        probe = run_probe(script, tuple(config.script_args), log_dir, PROBE_STEPS, PROBE_SECONDS)
        if calibration is not None:
            net = load_transport(Path(calibration))
            say(f"plan: transports from {calibration}")
        else:
            say("plan: measuring all-reduce and the parameter-server transport (2 workers on this host)")
            net = run_measure(log_dir, probe)
        cal = build(probe, net, " ".join([script.name, *config.script_args]))
    except (PlanError, ValueError) as error:
        console.print(Text(f"fleetrun --plan: {error}", style="bold red"))
        return 1
    path = cal.save(log_dir / "calibration.json")
    say(f"plan: calibrated in {time.monotonic() - started:.0f} s; {path}")
    predict_and_report(cal, counts, config.workers, config.servers, chosen, console)
    return 0


def predict_and_report(
    cal: Calibration,
    counts: tuple[int, ...],
    workers_per_host: int = 1,
    servers_per_host: int = 0,
    chosen: str | None = None,
    console: Console | None = None,
) -> str:
    """Predict every mode at every count and print the plan; returns the recommended mode."""
    console = console or Console(highlight=False)
    given = servers_per_host
    servers_per_host = servers_per_host or 1
    model = Model(cal)
    preds = []
    for r in counts:
        hosts = -(-r // workers_per_host)
        setup = Setup(workers=r, servers=servers_per_host * hosts, workers_per_host=workers_per_host)
        for m in MODES:
            if m == "collective" or cal.ps is not None:
                preds.append(model.predict(m, setup))
    note = (
        f"setup: {workers_per_host} worker(s) per host, {servers_per_host} server(s) per host"
        + ("" if given else " (not given: 1)")
        + ", hosts idle otherwise"
        + "; PS sync + backup: b = 4 % of the workers, rounded up"
    )
    mode = report(cal, preds, note, chosen, console)
    if any(t.ids_per_step for t in cal.tables):
        _, top, _ = recommend(preds)
        r = max(2, top)
        cluster = Cluster(
            workers=r,
            workers_per_host=min(r, workers_per_host),
            servers=servers_per_host * -(-r // workers_per_host),
            worker_memory_bytes=(memory_bytes() or 8 * 2**30) / (workers_per_host + servers_per_host),
        )
        report_placement(cal, workload_from(cal), cluster, console, sizes_given=False)
    return mode


def report_placement(
    cal: Calibration, work: Workload, cluster: Cluster, console: Console, sizes_given: bool = True
) -> Recommendation:
    """Print every placement's memory and predicted samples/s, and the recommended strategy with its reason."""
    rec = recommend_placement(cal, work, cluster, cal.batch)
    console.print(
        Text(
            f"placement at {cluster.workers} workers ({cluster.workers_per_host} per host), {cluster.servers} "
            f"server(s), {gb(cluster.worker_memory_bytes)} per worker: tables {gb(work.table_bytes())} "
            f"(optimizer state x{work.state:g} and id index included), {work.ids_per_step:,.0f} unique ids "
            f"per worker-step, dense {gb(work.dense_bytes)}",
            style="bold",
        )
    )
    table = Table(show_edge=False, pad_edge=False)
    for title in ("placement", "memory per worker", "step ms", "samples/s" if cal.batch else "steps/s", "note"):
        table.add_column(title, justify="left" if title in ("placement", "note") else "right")
    for c in rec.candidates:
        rate = c.samples_per_s if cal.batch else (cluster.workers / c.step_s if c.step_s else None)
        note = "recommended" if c is rec.best else (c.ruled_out or "")
        table.add_row(
            c.label,
            gb(c.worker_bytes),
            "-" if c.step_s is None else f"{c.step_s * 1e3:,.1f}",
            "-" if rate is None else f"{rate:,.0f}",
            Text(note, style="bold green" if c is rec.best else ("yellow" if c.ruled_out else "")),
        )
    console.print(table)
    console.print(Text(f"recommended placement: {rec.best.strategy}", style="bold green"))
    console.print(f"  why: {rec.reason}")
    if not sizes_given:
        console.print(
            "  table sizes: the rows the calibration run touched, a lower bound; give the real ones with "
            "python -m fleet.plan placement --calibration <log dir>/calibration.json --table-rows N,N,..."
        )
    return rec
