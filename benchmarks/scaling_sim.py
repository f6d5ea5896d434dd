"""fleet.plan's discrete-event simulation: W4 reproduced at 4 workers, then sync vs sync+backup vs async at 16 to 1,024.

    python benchmarks/scaling_sim.py            # calibrate W4's workload here (~30 s), simulate (~1 min), figure
    python benchmarks/scaling_sim.py --replot   # simulate and draw again from the saved calibration

1. **Calibration**, as ``fleetrun --plan`` takes it, of W4's workload (benchmarks/_common.py
   ``--workload ctr --batch 128``: W2's CTR model at batch 128, benchmarks/stragglers.py): the
   computation per step and its spread (log-normal sigma), and the script's parameter-server step
   replayed without computation (the worker's wait, the server's CPU per worker-step).
2. **W4 at 4 workers** (1 server, this host's cores shared as fleet.plan.model computes it): a
   reference sync run without a straggler gives the normal step; worker 3 then sleeps
   log-normal(ln(2 x normal step), 0.5) per step, exactly as stragglers.py injects it, in plain
   sync and in sync with 1 backup worker. W4's measured steps to the target loss were equal in
   both modes (150), so the time-to-loss ratio is the ratio of step times (the convergence
   model's noise scale is 0 here). Compared with W4's measured 0.42 (docs/figures/stragglers.json).
3. **16, 64, 256, 1,024 workers** (and Chen et al.'s 100 + 4), one worker per host, one server
   per 4 workers (W4's ratio), b = ceil(4 % of R) backups: the time to a target loss of sync +
   backup and of async relative to plain sync, for two straggler scenarios (the calibrated
   spread only; and 1 % of the workers slowed like W4's straggler) and for a range of gradient
   noise scales (fleet.plan.simulation.Convergence: the assumption, stated there).
Writes docs/figures/scaling_sim.{csv,json,png}.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path
from typing import Any

import _common as c

from fleet.plan import planner
from fleet.plan.lognormal import LogNormal
from fleet.plan.model import Model, Setup
from fleet.plan.simulation import Convergence, SimConfig, simulate

W4_BATCH = 128
W4_SIGMA = 0.5
COUNTS = (16, 64, 100, 256, 1024)
NOISE_SCALES = (0.0, 16.0, 256.0)
STRAGGLER_FRACTION = 0.01


def calibrate(log_dir: Path) -> dict[str, Any]:
    out = log_dir / "worker-out"
    out.mkdir(parents=True, exist_ok=True)
    args = ("--out", str(out), "--workload", "ctr", "--batch", str(W4_BATCH), "--steps", "100000")
    probe = planner.run_probe(c.WORKER, args, log_dir, planner.PROBE_STEPS, planner.PROBE_SECONDS)
    net = planner.run_measure(log_dir, probe)
    return {"probe": probe, "net": net}


def measure_w4(rounds: int) -> list[dict[str, Any]]:
    """W4's two modes again, interleaved over ``rounds`` (stragglers.py's jobs, target loss 0.35).

    Each round: a reference PS sync job without straggler (the normal step, from which the
    straggler's delay is set as stragglers.py does), then PS sync and PS sync + 1 backup with
    worker 3 slowed, their order reversed on odd rounds. The load average is kept beside each.
    """
    import os

    import stragglers

    args = argparse.Namespace(batch=W4_BATCH, target=0.35, window=10, sigma=W4_SIGMA, max_steps=600, max_s=150.0)
    modes = [
        ("PS sync", {"mode": "ps", "update": "sync"}),
        ("PS sync + 1 backup", {"mode": "ps", "update": "sync", "backup_workers": 1}),
    ]
    out = []
    for i in range(rounds):
        load = os.getloadavg()[0]
        try:
            reference = stragglers.run_mode("PS sync, no straggler", modes[0][1], 1, args, None)
            mu = math.log(2 * reference["step_ms_fast"] / 1e3)
            delay = {"ranks": [stragglers.STRAGGLER], "delay": {"mu": mu, "sigma": W4_SIGMA}, "seed": i}
            got = {}
            for name, strategy in modes if i % 2 == 0 else modes[::-1]:
                got[name] = stragglers.run_mode(name, strategy, 1, args, delay)
        except SystemExit as failed:  # a job failed (the machine is shared, and so is the working tree)
            print(f"W4 round {i} failed, left out: {str(failed)[-300:]}", flush=True)
            continue
        sync, backup = got["PS sync"], got["PS sync + 1 backup"]
        ratio = (
            backup["time_to_target_s"] / sync["time_to_target_s"]
            if backup["time_to_target_s"] and sync["time_to_target_s"]
            else None
        )
        out.append(
            {
                "round": i,
                "load_before": load,
                "load_after": os.getloadavg()[0],
                "normal_step_ms": reference["step_ms_fast"],
                "sync_step_ms": sync["step_ms_fast"],
                "backup_step_ms": backup["step_ms_fast"],
                "sync_steps_to_target": sync["steps_to_target"],
                "backup_steps_to_target": backup["steps_to_target"],
                "ratio": ratio,
            }
        )
        print(f"W4 round {i}: sync+backup / sync = {ratio}, load {load:.1f}", flush=True)
        c.write_json(c.FIGURES / "scaling_sim-w4-partial.json", out)
    return out


def sim_inputs(cal, setup: Setup) -> dict[str, Any]:
    """The simulation's per-step costs for ``setup``, from the calibration and the model's core sharing."""
    model = Model(cal)
    pred = model.predict("ps_sync", setup)
    alone = model._compute(1.0, ps=True).mean
    stretch = pred.t_comp_s / alone
    client = max(0.0, cal.ps_step_s - cal.ps_server_step_s) * stretch
    requests = min(cal.ps_server_step_s, 4 * cal.ps_request_s)
    server = (requests + (cal.ps_server_step_s - requests) / setup.servers) * stretch
    # The server's work splits into answering the pull (rows looked up or created: what the replayed
    # sparse pull waited for beyond the wire) and taking the pushes (the rest).
    pull = min(server, max(0.0, (cal.ps_sparse_pull_s or 0.0) - cal.ps.latency_s) * stretch / setup.servers)
    return {
        "compute": LogNormal.with_mean(pred.t_comp_s, cal.step_sigma),
        "push_s": client / 2,
        "pull_s": client / 2,
        "server_s": server,
        "push_service_s": server - pull,
        "pull_service_s": pull,
        "stretch": stretch,
    }


def _config(inputs: dict, workers: int, mode: str = "sync", **over) -> SimConfig:
    split = {"apply_s": inputs["push_service_s"], "pull_service_s": inputs["pull_service_s"]}
    return SimConfig(
        workers=workers,
        compute=inputs["compute"],
        mode=mode,
        push_s=inputs["push_s"],
        pull_s=inputs["pull_s"],
        **split,
        **over,
    )


def w4(cal, remeasured: list[dict] | None = None) -> dict[str, Any]:
    inputs = sim_inputs(cal, Setup(workers=4, servers=1, workers_per_host=4, background=cal.background))
    reference = simulate(_config(inputs, 4, steps=400))
    normal = reference.update_s
    delay = LogNormal(math.log(2 * normal), W4_SIGMA)
    sync = simulate(_config(inputs, 4, straggler_ranks=(3,), straggler_delay=delay, steps=400))
    backup = simulate(_config(inputs, 4, backup=1, straggler_ranks=(3,), straggler_delay=delay, steps=400))
    conv = Convergence(noise_scale=0.0)
    ratio = conv.time_to_loss(backup) / conv.time_to_loss(sync)
    measured = json.loads((c.FIGURES / "stragglers.json").read_text())
    rows = {r["mode"]: r for r in measured["rows"]}
    return {
        "normal_step_ms": 1e3 * normal,
        "sync_step_ms": 1e3 * sync.update_s,
        "backup_step_ms": 1e3 * backup.update_s,
        "backup_dropped": backup.dropped,
        "straggler_steps": backup.worker_steps[3],
        "fast_steps": backup.worker_steps[0],
        "simulated_ratio": ratio,
        "measured_ratio": measured["backup_over_sync"],
        "measured_steps_ms": {
            "normal": measured["normal_step_ms"],
            "sync": rows["PS sync"]["step_ms_fast"],
            "backup": rows["PS sync + 1 backup"]["step_ms_fast"],
        },
        "measured_load": measured["machine"],
        "error": ratio / measured["backup_over_sync"] - 1,
        "stretch": inputs["stretch"],
        **_remeasured(ratio, remeasured or []),
    }


def _remeasured(ratio: float, rounds: list[dict]) -> dict[str, Any]:
    ratios = [r["ratio"] for r in rounds if r["ratio"] is not None]
    if not ratios:
        return {}
    ratios.sort()
    median = (
        ratios[len(ratios) // 2] if len(ratios) % 2 else (ratios[len(ratios) // 2 - 1] + ratios[len(ratios) // 2]) / 2
    )
    return {
        "remeasured_ratios": ratios,
        "remeasured_median": median,
        "remeasured_loads": [round(r["load_before"], 1) for r in rounds],
        "error_vs_remeasured": ratio / median - 1,
    }


def large(cal) -> list[dict[str, Any]]:
    rows = []
    for r in COUNTS:
        b = 4 if r == 100 else math.ceil(0.04 * r)
        inputs = sim_inputs(cal, Setup(workers=r, servers=max(1, r // 4), workers_per_host=1))
        normal = simulate(_config(inputs, r, steps=60)).update_s
        for scenario in ("spread", "stragglers"):
            over: dict[str, Any] = {}
            if scenario == "stragglers":
                count = max(1, round(STRAGGLER_FRACTION * r))
                over = {
                    "straggler_ranks": tuple(range(0, r, r // count))[:count],
                    "straggler_delay": LogNormal(math.log(2 * normal), W4_SIGMA),
                }
            steps = 60 if r <= 256 else 30
            sync = simulate(_config(inputs, r, steps=steps, **over))
            backup = simulate(_config(inputs, r, backup=b, steps=steps, **over))
            asyn = simulate(_config(inputs, r, mode="async", steps=max(8, steps // 4), **over))
            for noise in NOISE_SCALES:
                conv = Convergence(noise_scale=noise)
                base = conv.time_to_loss(sync)
                # The staleness cost c at which async would only tie sync + backup: above it, sync wins.
                tie = (conv.time_to_loss(backup) / asyn.update_s - 1 - noise) / max(asyn.staleness, 1e-9)
                rows.append(
                    {
                        "workers": r,
                        "backups": b,
                        "scenario": scenario,
                        "noise_scale": noise,
                        "sync_step_ms": 1e3 * sync.update_s,
                        "backup_step_ms": 1e3 * backup.update_s,
                        "async_update_ms": 1e3 * asyn.update_s,
                        "async_staleness": asyn.staleness,
                        "backup_vs_sync": conv.time_to_loss(backup) / base,
                        "async_vs_sync": conv.time_to_loss(asyn) / base,
                        "staleness_cost_tie": tie,
                    }
                )
        print(f"simulated R={r}", flush=True)
    return rows


def render(saved: dict) -> None:
    cal = planner.build(saved["calibration"]["probe"], saved["calibration"]["net"], "W4 workload")
    result = w4(cal, saved.get("w4_measured"))
    rows = large(cal)
    saved.update(w4=result, rows=rows)
    print(
        f"\nW4 at 4 workers: simulated sync+1 backup / sync = {result['simulated_ratio']:.2f}, measured "
        f"{result['measured_ratio']:.2f} (error {100 * result['error']:+.0f} %, bound 15 %); simulated steps "
        f"{result['normal_step_ms']:.0f} / {result['sync_step_ms']:.0f} / {result['backup_step_ms']:.0f} ms "
        f"(normal / sync / backup), measured {result['measured_steps_ms']['normal']:.0f} / "
        f"{result['measured_steps_ms']['sync']:.0f} / {result['measured_steps_ms']['backup']:.0f} ms"
    )
    if "remeasured_median" in result:
        print(
            f"W4 measured again, {len(result['remeasured_ratios'])} interleaved rounds at load "
            f"{min(result['remeasured_loads'])}-{max(result['remeasured_loads'])}: ratios "
            + ", ".join(f"{x:.2f}" for x in result["remeasured_ratios"])
            + f"; median {result['remeasured_median']:.2f}: simulation error {100 * result['error_vs_remeasured']:+.0f} %"
        )
    header = ["R", "backups", "stragglers", "noise scale B_noise/B", "sync step ms", "backup step ms",
              "async update ms", "async staleness", "sync+backup / sync", "async / sync",
              "c at which async ties sync+backup"]  # fmt: skip
    table = [
        [
            r["workers"],
            r["backups"],
            "calibrated spread" if r["scenario"] == "spread" else "+1 % slowed like W4",
            f"{r['noise_scale']:g}",
            f"{r['sync_step_ms']:.1f}",
            f"{r['backup_step_ms']:.1f}",
            f"{r['async_update_ms']:.3f}",
            f"{r['async_staleness']:.0f}",
            f"{r['backup_vs_sync']:.2f}",
            f"{r['async_vs_sync']:.2f}",
            f"{r['staleness_cost_tie']:.2f}",
        ]
        for r in rows
    ]
    print("\nTime to a target loss relative to plain sync (simulated; < 1 is faster)")
    print(c.markdown_table(header, table))
    c.write_csv(c.FIGURES / "scaling_sim.csv", header, table)
    c.write_json(c.FIGURES / "scaling_sim.json", saved)
    _plot(result, rows)


def _plot(result: dict, rows: list[dict]) -> None:
    plt = c.pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [1, 2.2]})
    names = ["W4 as published\n(1 run, load ~10)", "simulated\n(fleet.plan)"]
    values = [result["measured_ratio"], result["simulated_ratio"]]
    colors = ["C0", "C1"]
    if "remeasured_median" in result:
        loads = result["remeasured_loads"]
        names.insert(1, f"W4 again: {len(loads)} interleaved\nrounds, load {min(loads):g}-{max(loads):g}")
        values.insert(1, result["remeasured_median"])
        colors.insert(1, "C0")
        ratios = result["remeasured_ratios"]
        left.plot([1] * len(ratios), ratios, "k.", label="re-measured rounds (bar: median)")
    left.bar(names, values, color=colors)
    sim = result["simulated_ratio"]
    left.axhspan(0.85 * sim, 1.15 * sim, color="C1", alpha=0.15, label="simulated ±15 %")
    for x, y in enumerate(values):
        left.annotate(f"{y:.2f}", (x, y), ha="left", textcoords="offset points", xytext=(6, 2), fontsize=8)
    left.tick_params(axis="x", labelsize=7)
    left.set_ylabel("time to target: sync + 1 backup / sync")
    left.set_title("W4: 1 of 4 workers slowed ~3x", fontsize=9)
    left.legend(fontsize=7)
    styles = {0.0: ":", 16.0: "--", 256.0: "-"}
    for scenario, color in (("spread", "C0"), ("stragglers", "C3")):
        sub = [r for r in rows if r["scenario"] == scenario and r["workers"] != 100]
        xs = sorted({r["workers"] for r in sub})
        backup = [next(r for r in sub if r["workers"] == x)["backup_vs_sync"] for x in xs]
        name = "calibrated spread" if scenario == "spread" else "+1 % slowed like W4"
        right.plot(xs, backup, "o-", color=color, label=f"sync + 4 % backups ({name})")
        for noise in NOISE_SCALES:
            ys = [next(r for r in sub if r["workers"] == x and r["noise_scale"] == noise)["async_vs_sync"] for x in xs]
            right.plot(xs, ys, styles[noise], color=color, alpha=0.7, label=f"async, B_noise/B = {noise:g} ({name})")
    right.axhline(1.0, color="grey", linewidth=0.8)
    right.set_xscale("log", base=2)
    right.set_yscale("log", base=2)
    right.get_yaxis().set_major_formatter(plt.matplotlib.ticker.FormatStrFormatter("%.2f"))
    right.set_xticks(list(sorted({r["workers"] for r in rows if r["workers"] != 100})))
    right.get_xaxis().set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
    right.set_xlabel("workers R (one per host; one server per 4 workers)")
    right.set_ylabel("time to target loss / plain sync's")
    right.set_title("simulated at scale (async staleness cost: (1 + tau) on the curvature-limited part)", fontsize=9)
    right.grid(alpha=0.3, which="both")
    right.legend(fontsize=6, ncol=2)
    c.save_figure(fig, "scaling_sim")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replot", action="store_true")
    parser.add_argument("--w4-rounds", type=int, default=3, help="W4 measured again, interleaved (0: not)")
    args = parser.parse_args()
    path = c.FIGURES / "scaling_sim.json"
    if args.replot:
        saved = json.loads(path.read_text())
    else:
        print(f"scaling_sim: calibrating W4's workload; {c.machine_note()}", flush=True)
        saved = {
            "machine": c.machine_note(),
            "command": "python benchmarks/scaling_sim.py",
            "calibration": calibrate(Path(tempfile.mkdtemp(prefix="fleet-sim-"))),
            "w4_measured": measure_w4(args.w4_rounds),
        }
    render(saved)
    if not args.replot:
        _record(saved["w4"])


def _record(result: dict) -> None:
    """The simulation against W4 as measured; W4 itself when it was measured again here."""
    measured = result.get("remeasured_median", result["measured_ratio"])
    c.record_result(
        "scaling_sim",
        variant="W4 simulated",
        figure="fleet.plan.simulation of W4: sync + 1 backup / sync at 4 workers",
        units="ratio",
        fleet=round(result["simulated_ratio"], 4),
        peer="W4 measured" + (" again (median of interleaved rounds)" if "remeasured_median" in result else ""),
        peer_value=round(measured, 4),
        ratio=round(result["simulated_ratio"] / measured, 4),
        ratio_means="simulated / measured",
        target="within 15 % of W4",
        summary=f"simulated {result['simulated_ratio']:.2f} for W4 against {measured:.2f} measured",
        details={k: v for k, v in result.items() if isinstance(v, (int, float, str, list, dict))},
    )
    if "remeasured_median" in result:
        loads = result["remeasured_loads"]
        c.record_result(
            "stragglers",
            variant=f"median of {len(result['remeasured_ratios'])} interleaved rounds",
            figure="wall time to the target loss, PS sync + 1 backup worker / plain PS sync, one of 4 workers slowed "
            "(interleaved rounds of stragglers.py's jobs)",
            units="ratio",
            fleet=None,
            ratio=round(result["remeasured_median"], 4),
            ratio_means="sync + backup / sync wall time (lower is better)",
            target="<= 0.6",
            summary=f"{result['remeasured_median']:.2f} (sync + 1 backup / sync; median of "
            f"{len(result['remeasured_ratios'])} rounds, {min(result['remeasured_ratios']):.2f}-"
            f"{max(result['remeasured_ratios']):.2f}, load {min(loads):g}-{max(loads):g})",
            details={"ratios": result["remeasured_ratios"], "loads": loads},
        )


if __name__ == "__main__":
    main()
