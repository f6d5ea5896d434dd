"""Data-parallel scaling you can trust: W1 and W2 at 1, 2, 4 workers and W1 over 2 emulated hosts, against fleet.plan.

    python benchmarks/scaling.py                 # 5 interleaved rounds, local points and 2 namespace hosts
    python benchmarks/scaling.py --no-netns      # local points only (no root needed)
    python benchmarks/scaling.py --quick         # 2 rounds, fewer steps (files get a -quick suffix)
    python benchmarks/scaling.py --replot        # recompute the predictions and redraw from the JSON

Measurements. Every point is a real fleetrun job of benchmarks/_common.py, weak scaling (fixed
batch per worker): W1 = benchmarks/README.md W1 (6.3 M-parameter MLP, batch 256/worker, collective
sync through gloo: ``shared_memory=False``, the path between hosts), W2 = W2's CTR model (batch
512/worker) on one parameter server in async mode. The 1-worker point of both is the script alone
(one process, no server): the reference of every speed-up. Each point is measured ``--rounds`` times
*interleaved*: a round runs every point once (1, 2, 4 workers, then the 2-host points), the order
reversed on odd rounds, so that the load of this shared machine drifts over all points alike. A
point's figure is the median over rounds, with its range; its speed-up is the median of the
per-round ratios to the 1-worker run of the same round. Beside every sample: the 1-minute load
average before and after, and the background demand during the job (busy CPU not used by the
job, from /proc/stat and the job's own rusage; see :class:`fleet.plan.host.CpuMeter`).

Honesty rule (:func:`refusal`): a point whose speed-up exceeds min(R, cores) by more than 5 % is
not drawn: R compute-bound workers of one thread each cannot beat R, nor the cores they share;
such a figure means the baseline ran slow (a load spike), and the script says so instead.

Prediction. Before the rounds, each workload is calibrated as ``fleetrun --plan`` does
(fleet.plan: the script timed as one worker, the all-reduce and PS transport measured by two
workers on this host), and fleet.plan.model predicts every point from that calibration and the
background demand measured during the point. The 2-host points (benchmarks/netns.py: a veth
pair, and a delay line adding 1 ms and 5 ms each way, all at ``--rate`` Mbit/s) are calibrated
by fleet/plan/measure.py run across the two namespaces, as on a real cluster. At the start of every
round each workload is timed as one worker again (a separate probe run, not a sample) and that
round's points are predicted from it: T_comp taken once, at another load than the samples', was
what made the 1-worker points miss by +29 % / -30 % before (``--probe-once`` does that again).
Writes docs/figures/scaling.{csv,json,png}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common as c
import netns

from fleet.plan.host import CpuMeter

WORKLOADS = {
    "W1": {
        "workload": "w1",
        "batch": 256,
        "strategy": {"mode": "collective", "shared_memory": False},
        "servers": 0,
        "steps": (16, 6),
        "mode": "collective",
        "title": "W1: collective sync (gloo), batch 256/worker",
    },
    "W2": {
        "workload": "ctr",
        "batch": 512,
        "strategy": {"mode": "ps", "update": "async"},
        "servers": 1,
        "steps": (40, 12),
        "mode": "ps_async",
        "title": "W2: PS async, 1 server, batch 512/worker",
    },
}
LINKS = [("veth", 0.0), ("delay", 1.0), ("delay", 5.0)]
TOLERANCE = 0.05
ERROR_BOUND = 0.15


def refusal(speedup: float, workers: int, cores: int, tolerance: float = TOLERANCE) -> str | None:
    """Why a measured speed-up cannot be drawn, or None when it is physically possible.

    Weak scaling of a compute-bound job with one thread per worker: R workers do at most R
    times the work of one, and never more than the cores they share allow. Beyond
    min(R, cores) x (1 + tolerance) the baseline must have run slow (a load spike).
    """
    limit = min(workers, cores)
    if speedup > limit * (1 + tolerance):
        return (
            f"not drawn: {speedup:.2f}x at R={workers} exceeds what {workers} worker(s) on {cores} cores can do "
            f"({limit}x): the 1-worker baseline ran slow"
        )
    return None


# --------------------------------------------------------------------------- measuring


def _worker_args(spec: dict, quick: bool) -> list[str]:
    timed = spec["steps"][1 if quick else 0]
    warmup = 2 if quick else 4
    return ["--workload", spec["workload"], "--batch", str(spec["batch"]), "--steps", str(timed + warmup)] + [
        "--warmup",
        str(warmup),
    ]


def _summary(results: list[dict], batch: int) -> dict[str, float]:
    return {
        "t_comp_s": c.mean([w["step_mean_s"] - w["comm_mean_s"] for w in results]),
        "t_sync_s": c.mean([w["comm_mean_s"] for w in results]),
        "samples_per_s": sum(batch / w["step_mean_s"] for w in results),
    }


def sample_local(name: str, workers: int, quick: bool) -> dict[str, Any]:
    spec = WORKLOADS[name]
    # The baseline is the script alone: one process, no server (what the speed-up is over, and what
    # cannot be beaten by more than min(R, cores)).
    servers = spec["servers"] if workers > 1 else 0
    strategy = spec["strategy"] if workers > 1 else {"mode": "collective"}
    with CpuMeter() as meter:
        job = c.fleetrun(workers=workers, servers=servers, strategy=strategy, args=_worker_args(spec, quick))
    return {
        "point": f"{name} R={workers}",
        "workload": name,
        "workers": workers,
        "link": "local",
        **_summary(job["workers"], spec["batch"]),
        "load_before": meter.load_before,
        "load_after": meter.load_after,
        "background": meter.background(workers + servers),
        "time": time.time(),
    }


def _two_host_job(hosts, spec: dict, worker_args: list[str], port: int, timeout: float = 600) -> list[dict]:
    """W1 as one worker on each namespace host (fleetrun --nnodes 2); the workers' result records."""
    with tempfile.TemporaryDirectory(prefix="fleet-2hosts-") as tmp:
        out = Path(tmp, "results")
        out.mkdir()
        strategy = Path(tmp, "strategy.json")
        strategy.write_text(json.dumps(spec["strategy"]))
        master = f"{hosts.addresses[0]}:{port}"
        env = {**os.environ, "FLEET_SECRET": secrets.token_hex(16), "PYTHONUNBUFFERED": "1"}
        procs = []
        for rank in (0, 1):
            argv = [sys.executable, "-m", "fleet.launch", "--nnodes", "2", "--node-rank", str(rank)]
            argv += ["--master", master, "--host", hosts.addresses[rank], "--workers", "1"]
            argv += ["--strategy", str(strategy), "--log-dir", str(Path(tmp, f"logs{rank}"))]
            argv += [str(c.WORKER), "--out", str(out), *worker_args]
            procs.append(hosts.popen(rank, argv, env=env, text=False))
        outputs = [p.communicate(timeout=timeout)[0].decode(errors="replace") for p in procs]
        for p, text in zip(procs, outputs, strict=True):
            if p.returncode != 0:
                raise SystemExit(f"2-host job failed ({p.returncode}):\n{text[-3000:]}")
        return sorted((json.loads(p.read_text()) for p in out.glob("worker-*.json")), key=lambda r: r["worker"])


def sample_two_hosts(hosts, label: str, port: int, quick: bool) -> dict[str, Any]:
    spec = WORKLOADS["W1"]
    before = hosts.counters()
    with CpuMeter() as meter:
        results = _two_host_job(hosts, spec, _worker_args(spec, quick), port)
    moved = hosts.counters() - before
    return {
        "point": f"W1 {label}",
        "workload": "W1",
        "workers": 2,
        "link": label,
        "link_bytes": {"rx": moved.rx, "tx": moved.tx},  # what crossed the link (host 0's end): the proof
        **_summary(results, spec["batch"]),
        "load_before": meter.load_before,
        "load_after": meter.load_after,
        "background": meter.background(2),
        "time": time.time(),
    }


# --------------------------------------------------------------------------- calibrating


def probe_local(name: str, log_dir: Path) -> dict:
    """The script timed as one worker (T_comp and its spread), as ``fleetrun --plan`` does it."""
    from fleet.plan import planner

    spec = WORKLOADS[name]
    out = log_dir / f"{name}-worker-out"
    out.mkdir(parents=True, exist_ok=True)
    args = ("--out", str(out), "--workload", spec["workload"], "--batch", str(spec["batch"]), "--steps", "100000")
    return planner.run_probe(c.WORKER, args, log_dir / name, planner.PROBE_STEPS, planner.PROBE_SECONDS)


def calibrate_local(name: str, log_dir: Path) -> tuple[dict, dict]:
    """(probe record, transport record) for a workload, as ``fleetrun --plan`` takes them."""
    from fleet.plan import planner

    probe = probe_local(name, log_dir)
    return probe, planner.run_measure(log_dir / name, probe)


def calibrate_two_hosts(hosts, port: int, log_dir: Path, max_bytes: int) -> dict:
    """fleet/plan/measure.py across the two namespace hosts: the network half of a cluster calibration."""
    from fleet.plan import measure_path

    out = log_dir / f"net-{port}.json"
    env = {**os.environ, "FLEET_SECRET": secrets.token_hex(16)}
    procs = []
    for rank in (0, 1):
        argv = [sys.executable, "-m", "fleet.launch", "--nnodes", "2", "--node-rank", str(rank)]
        argv += ["--master", f"{hosts.addresses[0]}:{port}", "--host", hosts.addresses[rank], "--workers", "1"]
        argv += ["--log-dir", str(log_dir / f"net-{port}-{rank}"), str(measure_path()), "--out", str(out)]
        argv += ["--no-ps", "--max-bytes", str(max_bytes), "--reps", "7"]
        procs.append(hosts.popen(rank, argv, env=env, text=False))
    for p in procs:
        text = p.communicate(timeout=300)[0].decode(errors="replace")
        if p.returncode != 0:
            raise SystemExit(f"measure.py across the hosts failed:\n{text[-3000:]}")
    return json.loads(out.read_text())


# --------------------------------------------------------------------------- predicting


def round_probe(cal_data: dict, point: dict[str, Any]) -> dict:
    """T_comp as timed at the start of the point's round (not with ``--probe-once``), else the first calibration."""
    return cal_data.get("round_probes", {}).get(str(point.get("round")), cal_data["probe"])


def predict(saved: dict, point: dict[str, Any]) -> dict[str, float]:
    """The model's samples/s, computation and communication for one measured sample."""
    from fleet.plan import planner
    from fleet.plan.model import Model, Setup

    name, r = point["workload"], point["workers"]
    spec = WORKLOADS[name]
    cal_data = saved["calibrations"][name]
    net = cal_data["net"] if point["link"] == "local" else saved["links"][point["link"]]["net"]
    cal = planner.build(round_probe(cal_data, point), net, name).model_copy(update={"batch": spec["batch"]})
    setup = Setup(workers=r, workers_per_host=r, servers=max(1, spec["servers"]), background=point["background"])
    p = Model(cal).predict(spec["mode"] if r > 1 else "collective", setup)
    return {"samples_per_s": p.samples_per_s, "t_comp_s": p.t_comp_s, "t_sync_s": p.t_sync_s}


# --------------------------------------------------------------------------- aggregating and drawing


def aggregate(saved: dict, cores: int) -> list[dict[str, Any]]:
    samples = saved["samples"]
    for s in samples:
        s["predicted"] = predict(saved, s)
    rows = []
    for point in dict.fromkeys(s["point"] for s in samples):
        mine = [s for s in samples if s["point"] == point]
        first = mine[0]
        ratios, pred_ratios = [], []
        for s in mine:
            base = next(
                (
                    b
                    for b in samples
                    if b["round"] == s["round"] and b["workload"] == s["workload"] and b["workers"] == 1
                ),
                None,
            )
            if base is not None:
                ratios.append(s["samples_per_s"] / base["samples_per_s"])
                pred_ratios.append(s["predicted"]["samples_per_s"] / base["predicted"]["samples_per_s"])
        rate = [s["samples_per_s"] for s in mine]
        predicted = statistics.median(s["predicted"]["samples_per_s"] for s in mine)
        measured = statistics.median(rate)
        speedup = statistics.median(ratios) if ratios else None
        row = {
            "point": point,
            "workload": first["workload"],
            "workers": first["workers"],
            "link": first["link"],
            "rounds": len(mine),
            "samples_per_s": measured,
            "samples_per_s_min": min(rate),
            "samples_per_s_max": max(rate),
            "t_comp_ms": 1e3 * statistics.median(s["t_comp_s"] for s in mine),
            "t_sync_ms": 1e3 * statistics.median(s["t_sync_s"] for s in mine),
            "speedup": speedup,
            "speedup_min": min(ratios) if ratios else None,
            "speedup_max": max(ratios) if ratios else None,
            "predicted_samples_per_s": predicted,
            "predicted_speedup": statistics.median(pred_ratios) if pred_ratios else None,
            "predicted_t_comp_ms": 1e3 * statistics.median(s["predicted"]["t_comp_s"] for s in mine),
            "predicted_t_sync_ms": 1e3 * statistics.median(s["predicted"]["t_sync_s"] for s in mine),
            "error": predicted / measured - 1,
            "load": [round(s["load_before"], 1) for s in mine],
            "background": [round(s["background"], 2) for s in mine],
        }
        row["refused"] = refusal(speedup, row["workers"], cores) if speedup is not None else None
        row["miss"] = (
            _why_missed(
                row,
                round_probe(saved["calibrations"][row["workload"]], first),
                "round_probes" in saved["calibrations"][row["workload"]],
            )
            if abs(row["error"]) > ERROR_BOUND
            else None
        )
        rows.append(row)
    return rows


def _why_missed(row: dict, probe: dict, per_round: bool) -> str:
    comp = row["predicted_t_comp_ms"] / row["t_comp_ms"] - 1 if row["t_comp_ms"] else 0.0
    sync = row["predicted_t_sync_ms"] - row["t_sync_ms"]
    if abs(comp) >= abs(sync) / max(row["t_comp_ms"], 1e-9):
        when = "at the start of each round" if per_round else "once"
        why = (
            f"computation {row['t_comp_ms']:.0f} ms measured vs {row['predicted_t_comp_ms']:.0f} ms predicted: "
            f"T_comp was timed as one worker {when} (here at load {probe.get('load_average', 0):.1f}, "
            f"{probe.get('background', 0):.1f} other busy processes) over the script's first steps, "
            "and scaled to this point's background by processor sharing"
        )
        if row["link"] == "local" and row["workers"] > 1 and comp < 0:
            why += (
                f"; it gives each of the {row['workers']} workers its share of the cores, but measured they compute "
                "slower than that: memory traffic between them, and more that the background meter does not see "
                "(docs/scaling.md)"
            )
        return why
    return f"communication {row['t_sync_ms']:.0f} ms measured vs {row['predicted_t_sync_ms']:.0f} ms predicted"


def render(saved: dict, quick: bool, record: bool = False) -> None:
    cores = saved["cores"]
    rows = aggregate(saved, cores)
    header = [
        "point",
        "rounds",
        "samples/s median (range)",
        "predicted samples/s",
        "error",
        "speed-up median (range)",
        "predicted speed-up",
        "T_comp / T_sync ms (measured)",
        "T_comp / T_sync ms (predicted)",
        "load average per round",
        "background demand per round",
        "note",
    ]
    table = []
    for r in rows:
        speed = "-" if r["speedup"] is None else f"{r['speedup']:.2f} ({r['speedup_min']:.2f}-{r['speedup_max']:.2f})"
        pspeed = "-" if r["predicted_speedup"] is None else f"{r['predicted_speedup']:.2f}"
        table.append(
            [
                r["point"],
                r["rounds"],
                f"{r['samples_per_s']:,.0f} ({r['samples_per_s_min']:,.0f}-{r['samples_per_s_max']:,.0f})",
                f"{r['predicted_samples_per_s']:,.0f}",
                f"{100 * r['error']:+.0f} %",
                speed,
                pspeed,
                f"{r['t_comp_ms']:.0f} / {r['t_sync_ms']:.0f}",
                f"{r['predicted_t_comp_ms']:.0f} / {r['predicted_t_sync_ms']:.0f}",
                " ".join(f"{x:g}" for x in r["load"]),
                " ".join(f"{x:g}" for x in r["background"]),
                "; ".join(x for x in (r["refused"], r["miss"] and "miss: " + r["miss"]) if x) or "",
            ]
        )
    print(f"\nScaling, measured vs fleet.plan's prediction ({saved['machine']})")
    print(c.markdown_table(header, table))
    worst = max(abs(r["error"]) for r in rows)
    print(f"\nlargest prediction error: {100 * worst:.0f} % (bound {100 * ERROR_BOUND:.0f} %)")
    for r in rows:
        if r["refused"]:
            print(f"{r['point']}: {r['refused']}")
    suffix = "-quick" if quick else ""
    c.write_csv(c.FIGURES / f"scaling{suffix}.csv", header, table)
    c.write_json(c.FIGURES / f"scaling{suffix}.json", {**saved, "rows": rows})
    _plot(rows, saved, cores, suffix)
    if record:
        within = sum(abs(r["error"]) <= ERROR_BOUND for r in rows)
        c.record_result(
            "scaling",
            variant=f"{len(rows)} points" + (" (quick)" if quick else ""),
            figure="samples/s per point, median of interleaved rounds, against fleet.plan's prediction from a "
            "calibration taken first",
            units=f"points within {100 * ERROR_BOUND:.0f} %",
            fleet=within,
            peer="points measured",
            peer_value=len(rows),
            target=f"every point within {100 * ERROR_BOUND:.0f} %, or the miss explained",
            summary=f"{within} of {len(rows)} points within {100 * ERROR_BOUND:.0f} % of the prediction; "
            + ", ".join(f"{r['point']} {100 * r['error']:+.0f} %" for r in rows),
            headline=not quick,
            details={
                r["point"]: {k: r.get(k) for k in ("samples_per_s", "predicted_samples_per_s", "error", "speedup")}
                for r in rows
            },
        )


def _plot(rows: list[dict], saved: dict, cores: int, suffix: str) -> None:
    plt = c.pyplot()
    if plt is None:
        return
    local = [n for n in WORKLOADS if any(r["workload"] == n and r["link"] == "local" for r in rows)]
    hosts = [r for r in rows if r["link"] != "local"]
    panels = len(local) + (1 if hosts else 0)
    fig, axes = plt.subplots(1, panels, figsize=(5.6 * panels, 5.6), squeeze=False)
    for ax, name in zip(axes[0], local, strict=False):
        sub = [r for r in rows if r["workload"] == name and r["link"] == "local"]
        xs = [r["workers"] for r in sub]
        ax.plot(xs, [min(x, cores) for x in xs], ":", color="grey", label=f"limit: min(R, {cores} cores)")
        ax.plot(xs, [r["predicted_speedup"] for r in sub], "s--", color="C1", label="fleet.plan prediction")
        drawn = [r for r in sub if not r["refused"]]
        ax.errorbar(
            [r["workers"] for r in drawn],
            [r["speedup"] for r in drawn],
            yerr=[
                [r["speedup"] - r["speedup_min"] for r in drawn],
                [r["speedup_max"] - r["speedup"] for r in drawn],
            ],
            fmt="o-",
            color="C0",
            capsize=4,
            label="measured: median, range over rounds",
        )
        for r in sub:
            text = f"{100 * r['error']:+.0f} %"
            if r["refused"]:
                text = f"R={r['workers']} not drawn:\nspeed-up {r['speedup']:.2f} > {min(r['workers'], cores)}"
            elif r["miss"]:
                text += " (miss)"
            y = r["predicted_speedup"] if r["refused"] else r["speedup"]
            ax.annotate(text, (r["workers"], y), fontsize=7, textcoords="offset points", xytext=(6, -14))
        ax.set_xticks(xs)
        ax.set_xlabel(f"workers R on this host ({cores} cores)")
        ax.set_ylabel("speed-up over 1 worker (samples/s ratio)")
        ax.set_title(WORKLOADS[name]["title"], fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    if hosts:
        ax = axes[0][-1]
        labels = [r["link"] for r in hosts]
        xs = range(len(hosts))
        ax.bar(
            [x - 0.2 for x in xs],
            [r["samples_per_s"] for r in hosts],
            0.4,
            yerr=[
                [r["samples_per_s"] - r["samples_per_s_min"] for r in hosts],
                [r["samples_per_s_max"] - r["samples_per_s"] for r in hosts],
            ],
            capsize=4,
            label="measured: median, range",
        )
        ax.bar([x + 0.2 for x in xs], [r["predicted_samples_per_s"] for r in hosts], 0.4, label="fleet.plan prediction")
        for x, r in zip(xs, hosts, strict=True):
            ax.annotate(f"{100 * r['error']:+.0f} %", (x, r["samples_per_s_max"]), fontsize=7, ha="center")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([lbl.replace("2 hosts (", "").rstrip(")").replace(", ", "\n") for lbl in labels], fontsize=7)
        ax.set_ylabel("samples/s, both workers")
        ax.set_title("W1 over 2 namespace hosts, 1 worker each", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    notes = [f"{r['point']} misses ({100 * r['error']:+.0f} %): {r['miss']}" for r in rows if r["miss"]]
    if notes:
        import textwrap

        text = "\n".join(textwrap.fill(n, 230) for n in notes)
        fig.text(0.01, 0.01, text, fontsize=7, va="bottom")
        fig.subplots_adjust(bottom=0.12 + 0.035 * text.count("\n"))
    loads = [x for r in rows for x in r["load"]]
    fig.suptitle(
        f"Measured (median of {max(r['rounds'] for r in rows)} interleaved rounds) vs predicted; "
        f"load average {min(loads):.1f}-{max(loads):.1f}; percentages: prediction error",
        fontsize=9,
    )
    c.save_figure(fig, f"scaling{suffix}", tight=not notes)  # tight_layout would squeeze the axes around the footnote


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5, --quick 2)")
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--workloads", default="W1,W2")
    parser.add_argument("--no-netns", action="store_true", help="leave out the 2-host points")
    parser.add_argument("--rate", type=float, default=500.0, help="2-host link bandwidth, Mbit/s")
    parser.add_argument(
        "--probe-once",
        action="store_true",
        help="time each workload as one worker only before the rounds (default: again at the start of every "
        "round, and predict that round's points from it, so T_comp is calibrated at the load its samples see)",
    )
    parser.add_argument("--replot", action="store_true", help="recompute predictions and redraw from the JSON")
    args = parser.parse_args()
    suffix = "-quick" if args.quick else ""
    if args.replot:
        saved = json.loads((c.FIGURES / f"scaling{suffix}.json").read_text())
        saved.pop("rows", None)
        render(saved, args.quick)
        return
    rounds = args.rounds or (2 if args.quick else 5)
    counts = [int(n) for n in args.workers.split(",")]
    names = args.workloads.split(",")
    cores = os.cpu_count() or 1
    print(f"scaling: {c.machine_note()}; {rounds} interleaved rounds", flush=True)
    saved: dict[str, Any] = {
        "machine": c.machine_note(),
        "cores": cores,
        "command": " ".join(["python benchmarks/scaling.py", *sys.argv[1:]]),
        "calibrations": {},
        "links": {},
        "samples": [],
    }
    log_dir = Path(tempfile.mkdtemp(prefix="fleet-scaling-"))
    for name in names:
        probe, net = calibrate_local(name, log_dir)
        saved["calibrations"][name] = {"probe": probe, "net": net}
        print(f"calibrated {name}: {statistics.median(probe['compute_s']) * 1e3:.1f} ms per step alone", flush=True)
    with contextlib.ExitStack() as stack:
        links = []
        if not args.no_netns and "W1" in names:
            max_bytes = min(64 * 2**20, 2 * saved["calibrations"]["W1"]["probe"]["dense_bytes"])
            for i, (kind, delay) in enumerate(LINKS):
                hosts = stack.enter_context(netns.TwoHosts(kind, delay_ms=delay, rate_mbit=args.rate, subnet=200 + i))
                port = 29700 + 10 * i
                net = calibrate_two_hosts(hosts, port + 1, log_dir, max_bytes)
                saved["links"][hosts.label] = {"net": net, "kind": kind, "delay_ms": delay, "rate_mbit": args.rate}
                links.append((hosts, port))
                print(f"calibrated {hosts.label}", flush=True)
        for round_index in range(rounds):
            if not args.probe_once:
                for name in names:
                    probe = probe_local(name, log_dir)
                    saved["calibrations"][name].setdefault("round_probes", {})[str(round_index)] = probe
                    print(
                        f"round {round_index}: {name} {statistics.median(probe['compute_s']) * 1e3:.1f} ms per step "
                        f"alone, load {probe.get('load_average', 0):.1f}",
                        flush=True,
                    )
            order = [(n, r) for n in names for r in counts]
            plan = order if round_index % 2 == 0 else order[::-1]
            jobs = [("local", n, r) for n, r in plan] + [("hosts", h, p) for h, p in links]
            if round_index % 2:
                jobs = jobs[len(plan) :][::-1] + jobs[: len(plan)]
            for kind, a, b in jobs:
                if kind == "local":
                    s = sample_local(a, b, args.quick)
                else:
                    s = sample_two_hosts(a, a.label, b, args.quick)
                s["round"] = round_index
                saved["samples"].append(s)
                print(
                    f"round {round_index} {s['point']}: {s['samples_per_s']:,.0f} samples/s, T_comp "
                    f"{s['t_comp_s'] * 1e3:.0f} ms, T_sync {s['t_sync_s'] * 1e3:.0f} ms, load {s['load_before']:.1f}, "
                    f"background {s['background']:.2f}",
                    flush=True,
                )
            c.write_json(c.FIGURES / f"scaling{suffix}.json", saved)  # a crash keeps the rounds so far
    render(saved, args.quick, record=True)


if __name__ == "__main__":
    main()
