"""Data-parallel scaling of W1 and W2 at 1, 2 and 4 workers: measured vs predicted speedup.

    python benchmarks/scaling.py            # W1 20 timed steps, W2 40 timed steps per point
    python benchmarks/scaling.py --quick    # fewer steps

Each point is a real fleetrun job of benchmarks/_common.py with weak scaling (fixed batch per
worker): W1 = benchmarks/README.md W1 exactly (6.3 M-parameter MLP, batch 256/worker, collective sync,
SGD 0.01, 1 thread per process), W2 = benchmarks/README.md W2 (CTR model, batch 512/worker) on a parameter
server in async mode with 1 server. Scaled down in length only: a few dozen steps per point.

Per point: T_comp and T_sync per step (averaged over workers and steps after warm-up; T_sync is
the communication / wait: collective from fleet's own recorder, PS = time in opt.step() push+pull
plus the sparse pull in the embedding's forward), throughput = sum over workers of batch / step.
Measured speedup = throughput(R) / throughput(1). Predicted speedup from the model behind the
condition T_sync < (R-1)/R x T_comp: R x (T_comp(1) + T_sync(1)) / (T_comp(1) + T_sync(R)) (see
_common.predicted_speedup), i.e. what R workers would give if computation did not slow down when
R processes share the machine. fleet's own verdict (fleet.step_report.speedup_condition, as in
fleetrun's report) uses the T_comp measured at R.

On a 2-core machine 4 workers (and 2 workers + a server) oversubscribe the cores: T_comp grows
with R and the measured speedup falls below the prediction; the table says so per point.
Writes docs/figures/scaling.{csv,json,png}.
"""

from __future__ import annotations

import argparse
import json
import os

import _common as c

from fleet.step_report import speedup_condition

WORKLOADS = {
    "W1": {"workload": "w1", "batch": 256, "strategy": {"mode": "collective"}, "servers": 0, "steps": (20, 6)},
    "W2": {
        "workload": "ctr",
        "batch": 512,
        "strategy": {"mode": "ps", "update": "async"},
        "servers": 1,
        "steps": (40, 12),
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--workloads", default="W1,W2")
    parser.add_argument("--replot", action="store_true", help="redo table and figure from docs/figures/scaling.json")
    args = parser.parse_args()
    counts = [int(n) for n in args.workers.split(",")]
    cores = os.cpu_count() or 1
    print(f"scaling: {c.machine_note()}")
    suffix = "-quick" if args.quick else ""
    if args.replot:
        replot(c.FIGURES / f"scaling{suffix}.json", args.quick, cores)
        return
    rows = []
    for name in args.workloads.split(","):
        spec = WORKLOADS[name]
        timed = spec["steps"][1 if args.quick else 0]
        warmup = 2 if args.quick else 4
        base = None
        for n in counts:
            strategy = spec["strategy"] if n > 1 or spec["servers"] else {"mode": "collective"}
            job = c.fleetrun(
                workers=n,
                servers=spec["servers"],
                strategy=strategy,
                args=["--workload", spec["workload"], "--batch", str(spec["batch"]), "--steps", str(timed + warmup)]
                + ["--warmup", str(warmup)],
            )
            ws = job["workers"]
            t_sync = c.mean([w["comm_mean_s"] for w in ws])
            t_comp = c.mean([w["step_mean_s"] - w["comm_mean_s"] for w in ws])
            throughput = sum(spec["batch"] / w["step_mean_s"] for w in ws)
            if base is None:
                base = {"t_comp": t_comp, "t_sync": t_sync, "throughput": throughput}
            condition = speedup_condition(t_sync, t_comp, n)
            processes = n + spec["servers"]
            row = {
                "workload": name,
                "workers": n,
                "servers": spec["servers"],
                "processes": processes,
                "oversubscribed": processes > cores,
                "t_comp_ms": 1e3 * t_comp,
                "t_sync_ms": 1e3 * t_sync,
                "bound_ms": 1e3 * condition["bound_s"],
                "condition_holds": condition["holds"],
                "samples_per_s": throughput,
                "measured_speedup": throughput / base["throughput"],
                "predicted_speedup": c.predicted_speedup(base["t_comp"], t_sync, n, base["t_sync"]),
                "comp_inflation": t_comp / base["t_comp"],
                "report_condition": (job["report"] or {}).get("speedup_condition"),
            }
            rows.append(row)
            print(
                f"{name} R={n}: T_comp {row['t_comp_ms']:.1f} ms, T_sync {row['t_sync_ms']:.1f} ms, "
                f"{throughput:,.0f} samples/s, speedup {row['measured_speedup']:.2f} (predicted {row['predicted_speedup']:.2f})",
                flush=True,
            )

    render(rows, args.quick, cores)


def replot(path, quick: bool, cores: int) -> None:
    """Recompute the predictions and redraw from a previous run's JSON (no new measurements)."""
    saved = json.loads(path.read_text())
    rows = saved["rows"]
    for name in dict.fromkeys(r["workload"] for r in rows):
        sub = [r for r in rows if r["workload"] == name]
        t_comp_1, t_sync_1 = sub[0]["t_comp_ms"] / 1e3, sub[0]["t_sync_ms"] / 1e3
        for r in sub:
            r["predicted_speedup"] = c.predicted_speedup(t_comp_1, r["t_sync_ms"] / 1e3, r["workers"], t_sync_1)
    render(rows, quick, cores, machine=saved.get("machine"))  # the conditions of the measurement, not of now


def render(rows: list[dict], quick: bool, cores: int, machine: str | None = None) -> None:
    args = argparse.Namespace(quick=quick)
    header = [
        "workload",
        "R",
        "processes / cores",
        "T_comp ms",
        "T_sync ms",
        "(R-1)/R x T_comp ms",
        "condition",
        "samples/s",
        "measured speedup",
        "predicted speedup",
        "T_comp(R)/T_comp(1)",
    ]
    table = [
        [
            r["workload"],
            r["workers"],
            f"{r['processes']} / {cores}" + (" (oversubscribed)" if r["oversubscribed"] else ""),
            f"{r['t_comp_ms']:.1f}",
            f"{r['t_sync_ms']:.1f}",
            f"{r['bound_ms']:.1f}",
            {None: "n/a", True: "holds", False: "fails"}[r["condition_holds"]],
            f"{r['samples_per_s']:,.0f}",
            f"{r['measured_speedup']:.2f}",
            f"{r['predicted_speedup']:.2f}",
            f"{r['comp_inflation']:.2f}",
        ]
        for r in rows
    ]
    print("\nScaling (weak: fixed batch per worker). W1 collective sync; W2 PS async, 1 server")
    print(c.markdown_table(header, table))
    suffix = "-quick" if args.quick else ""
    c.write_csv(c.FIGURES / f"scaling{suffix}.csv", header, table)
    c.write_json(
        c.FIGURES / f"scaling{suffix}.json",
        {
            "machine": machine or c.machine_note(),
            "command": "python benchmarks/scaling.py" + (" --quick" if args.quick else ""),
            "rows": rows,
        },
    )
    plt = c.pyplot()
    if plt is not None:
        names = list(dict.fromkeys(r["workload"] for r in rows))
        fig, axes = plt.subplots(1, len(names), figsize=(5.2 * len(names), 4.0), squeeze=False)
        for ax, name in zip(axes[0], names, strict=True):
            sub = [r for r in rows if r["workload"] == name]
            xs = [r["workers"] for r in sub]
            ax.plot(xs, xs, ":", color="grey", label="ideal (R)")
            ax.plot(
                xs, [r["predicted_speedup"] for r in sub], "s--", label="predicted: R T_1 / (T_comp(1) + T_sync(R))"
            )
            ax.plot(xs, [r["measured_speedup"] for r in sub], "o-", label="measured (samples/s ratio)")
            for r in sub:
                if r["oversubscribed"]:
                    ax.annotate(
                        "oversubscribed",
                        (r["workers"], r["measured_speedup"]),
                        fontsize=7,
                        textcoords="offset points",
                        xytext=(-30, -12),
                    )
            ax.set_xticks(xs)
            ax.set_xlabel(f"workers R ({cores} cores)")
            ax.set_ylabel("speedup over 1 worker")
            title = "W1 collective sync" if name == "W1" else "W2 PS async, 1 server"
            ax.set_title(title)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        c.save_figure(fig, f"scaling{suffix}")


if __name__ == "__main__":
    main()
