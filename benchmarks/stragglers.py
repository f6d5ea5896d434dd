"""W4: one straggler among 4 workers; wall time to a fixed training loss per mode (benchmarks/README.md W4).

    python benchmarks/stragglers.py            # full: target loss 0.35, ~5 minutes on 2 busy cores
    python benchmarks/stragglers.py --quick    # smoke run: target loss 0.66

Workload: W2's CTR model (examples/single_to_multi/train_ctr.py: 26 sparse slots, one
SparseEmbedding of dim 16, MLP 400-400-400-1, SGD lr 0.1), scaled down to batch 128 per worker
so that 4 workers + 1 server fit on a 2-core machine. Every mode is a real ``fleetrun --workers
4`` job of benchmarks/_common.py with the same seeds (model 0, data 1 + worker, delays 0).

First a reference job (PS sync, nobody slowed) measures a normal step. Then worker 3 is slowed
with fleet's injector: each step it sleeps log-normal(mu, 0.5) seconds with exp(mu) = 2x that
step, so its median step is about 3x the others'. Modes: collective sync, PS sync, PS sync with 1
backup worker, PS async, PS geo (k_steps 100, as in W2).

Time to target: the first time worker 0's training loss averaged over its last 10 steps is at or
below the target (worker 0 is never the straggler), counted from a barrier before step 0.
Dropped gradients: stale pushes the servers dropped (one per table per server), all workers.
Writes docs/figures/stragglers.{csv,json,png}.
"""

from __future__ import annotations

import argparse
import json
import math

import _common as c

MODES = [
    ("collective sync", {"mode": "collective"}, 0),
    ("PS sync", {"mode": "ps", "update": "sync"}, 1),
    ("PS sync + 1 backup", {"mode": "ps", "update": "sync", "backup_workers": 1}, 1),
    ("PS async", {"mode": "ps", "update": "async"}, 1),
    ("PS geo (k=100)", {"mode": "ps", "update": "geo", "k_steps": 100}, 1),
]
STRAGGLER = 3


def smoothed(losses: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(losses)):
        recent = losses[max(0, i - window + 1) : i + 1]
        out.append(sum(recent) / len(recent))
    return out


def time_to_target(worker0: dict, target: float, window: int) -> tuple[float | None, int | None]:
    smooth = smoothed(worker0["loss"], window)
    for i, value in enumerate(smooth):
        if i + 1 >= window and value <= target:
            return worker0["t"][i], i + 1
    return None, None


def run_mode(name: str, strategy: dict, servers: int, args, delay: dict | None) -> dict:
    worker_args = ["--workload", "ctr", "--batch", str(args.batch), "--steps", str(args.max_steps)]
    worker_args += ["--target-loss", str(args.target), "--window", str(args.window), "--max-seconds", str(args.max_s)]
    if delay:
        worker_args += ["--delay", json.dumps(delay)]
    job = c.fleetrun(workers=4, servers=servers, strategy=strategy, args=worker_args)
    w0 = job["workers"][0]
    reached_s, reached_steps = time_to_target(w0, args.target, args.window)
    fast = [w for w in job["workers"] if w["worker"] != STRAGGLER]
    slow = next(w for w in job["workers"] if w["worker"] == STRAGGLER)
    row = {
        "mode": name,
        "strategy": strategy,
        "time_to_target_s": reached_s,
        "steps_to_target": reached_steps,
        "steps_worker0": w0["steps"],
        "steps_straggler": slow["steps"],
        "dropped": sum(w["dropped"] for w in job["workers"]),
        "final_loss": smoothed(w0["loss"], args.window)[-1],
        "step_ms_fast": 1e3 * c.mean([w["step_mean_s"] for w in fast]),
        "comm_ms_fast": 1e3 * c.mean([w["comm_mean_s"] for w in fast]),
        "step_ms_straggler": 1e3 * slow["step_mean_s"],
        "curve_t": w0["t"],
        "curve_loss": smoothed(w0["loss"], args.window),
    }
    print(
        f"{name:20s} time to {args.target}: {fmt(reached_s)} s, steps {reached_steps}, step {row['step_ms_fast']:.0f} ms"
        f" (straggler {row['step_ms_straggler']:.0f} ms), dropped {row['dropped']}, final loss {row['final_loss']:.4f}",
        flush=True,
    )
    return row


def fmt(value: float | None, digits: int = 1) -> str:
    return "not reached" if value is None else f"{value:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: higher target loss, fewer steps")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--target", type=float, default=None)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--sigma", type=float, default=0.5)
    args = parser.parse_args()
    args.target = args.target or (0.66 if args.quick else 0.35)
    args.max_steps = 200 if args.quick else 600
    args.max_s = 60.0 if args.quick else 150.0

    print(f"W4 (W2 CTR scaled to batch {args.batch}/worker), 4 workers, target loss {args.target}; {c.machine_note()}")
    reference = run_mode("PS sync, no straggler", MODES[1][1], 1, args, None)
    base_ms = reference["step_ms_fast"]
    mu = math.log(2 * base_ms / 1e3)
    delay = {"ranks": [STRAGGLER], "delay": {"mu": mu, "sigma": args.sigma}, "seed": 0}
    print(
        f"normal step {base_ms:.0f} ms -> worker {STRAGGLER} sleeps log-normal(mu={mu:.2f}, sigma={args.sigma}) s per step"
        f" (median {2 * base_ms:.0f} ms: its median step is about 3x)",
        flush=True,
    )
    rows = [reference]
    for name, strategy, servers in MODES:
        rows.append(run_mode(name, strategy, servers, args, delay))

    sync = next(r for r in rows if r["mode"] == "PS sync")["time_to_target_s"]
    header = [
        "mode",
        "time to target (s)",
        "vs PS sync",
        "steps to target",
        "steps (worker 0 / straggler)",
        "step ms (others / straggler)",
        "dropped gradients",
        "final loss",
    ]
    table = []
    for r in rows:
        ratio = r["time_to_target_s"] / sync if r["time_to_target_s"] and sync else None
        r["ratio_vs_ps_sync"] = ratio
        table.append(
            [
                r["mode"],
                fmt(r["time_to_target_s"]),
                fmt(ratio, 2),
                r["steps_to_target"] or "-",
                f"{r['steps_worker0']} / {r['steps_straggler']}",
                f"{r['step_ms_fast']:.0f} / {r['step_ms_straggler']:.0f}",
                r["dropped"],
                f"{r['final_loss']:.4f}",
            ]
        )
    print(
        f"\nW4: wall time to a smoothed training loss of {args.target} (worker 0, mean of its last {args.window} steps)"
    )
    print(c.markdown_table(header, table))
    backup = next(r for r in rows if r["mode"] == "PS sync + 1 backup")["ratio_vs_ps_sync"]
    verdict = "meets" if backup is not None and backup <= 0.6 else "misses"
    print(f"\nPS sync + 1 backup / PS sync = {fmt(backup, 2)} (target <= 0.6: {verdict})")

    suffix = "-quick" if args.quick else ""
    c.write_csv(c.FIGURES / f"stragglers{suffix}.csv", header, table)
    meta = {
        "workload": f"W2 CTR, batch {args.batch}/worker, 4 workers, 1 server (PS modes), SGD lr 0.1",
        "target_loss": args.target,
        "window": args.window,
        "straggler": STRAGGLER,
        "delay": delay,
        "normal_step_ms": base_ms,
        "machine": c.machine_note(),
        "command": "python benchmarks/stragglers.py" + (" --quick" if args.quick else ""),
        "backup_over_sync": backup,
        "rows": rows,
    }
    c.write_json(c.FIGURES / f"stragglers{suffix}.json", meta)
    sync_row = next(r for r in rows if r["mode"] == "PS sync")
    backup_row = next(r for r in rows if r["mode"] == "PS sync + 1 backup")
    c.record_result(
        "stragglers",
        variant="single run" + (" (quick)" if args.quick else ""),
        figure="wall time to the target loss, PS sync + 1 backup worker / plain PS sync, one of 4 workers slowed",
        units="s",
        fleet=backup_row["time_to_target_s"],
        peer="plain PS sync",
        peer_value=sync_row["time_to_target_s"],
        ratio=None if backup is None else round(backup, 4),
        ratio_means="sync + backup / sync wall time to the target (lower is better)",
        target="<= 0.6",
        summary=f"{fmt(backup, 2)} (sync + 1 backup / sync wall time to loss {args.target})",
        headline=not args.quick,
        details={
            r["mode"]: {"time_to_target_s": r["time_to_target_s"], "ratio_vs_ps_sync": r["ratio_vs_ps_sync"]}
            for r in rows
        },
    )
    plt = c.pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        for r in rows:
            style = ":" if "no straggler" in r["mode"] else "-"
            ax.plot(r["curve_t"], r["curve_loss"], style, label=r["mode"])
        ax.axhline(args.target, color="grey", linestyle="--", linewidth=0.8, label=f"target {args.target}")
        ax.set_xlabel("wall time (s)")
        ax.set_ylabel(f"training loss, worker 0 (mean of last {args.window} steps)")
        ax.set_title(f"W4: 1 of 4 workers slowed ~3x (log-normal, sigma {args.sigma})")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        c.save_figure(fig, f"stragglers{suffix}")


if __name__ == "__main__":
    main()
