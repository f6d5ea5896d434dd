"""The fan-out effect of synchronous steps: a sync step waits for the slowest of N workers.

    python benchmarks/fanout.py            # N = 2, 4, 8; sigma 0.5 and 1.0; 60 steps each
    python benchmarks/fanout.py --quick    # N = 2, 4, 8; sigma 0.5; 20 steps

Each point is a real ``fleetrun --workers N`` collective sync job (benchmarks/_common.py,
workload ``sleep``): a Linear(8, 1) whose "computation" is a sleep drawn by fleet's injector from
log-normal(mu, sigma) on every worker (independent, seeded per rank), followed by the gradient
all-reduce, which is a barrier. Measured: the mean step time over workers and steps (after 3
warm-up steps). Simulated: E[max of N log-normal(mu, sigma)] by Monte Carlo (200,000 draws),
the step time if synchronisation cost nothing but the wait for the slowest. Their gap is fleet's
own per-step cost (all-reduce and Python) on this machine. Writes docs/figures/fanout.{csv,json,png}.
"""

from __future__ import annotations

import argparse
import json
import math

import _common as c


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--median-ms", type=float, default=50.0, help="median per-step delay exp(mu)")
    parser.add_argument("--workers", default="2,4,8")
    args = parser.parse_args()
    sigmas = [0.5] if args.quick else [0.5, 1.0]
    steps = 20 if args.quick else 60
    mu = math.log(args.median_ms / 1e3)
    counts = [int(n) for n in args.workers.split(",")]
    print(f"fan-out: collective sync, log-normal delay per step, median {args.median_ms:.0f} ms; {c.machine_note()}")

    rows = []
    for sigma in sigmas:
        for n in counts:
            delay = {"ranks": list(range(n)), "delay": {"mu": mu, "sigma": sigma}, "seed": 0}
            job = c.fleetrun(
                workers=n,
                args=["--workload", "sleep", "--batch", "4", "--steps", str(steps), "--warmup", "3"]
                + ["--delay", json.dumps(delay)],
            )
            measured = c.mean([w["step_mean_s"] for w in job["workers"]])
            comm = c.mean([w["comm_mean_s"] for w in job["workers"]])
            simulated = c.expected_max_lognormal(n, mu, sigma)
            single = c.lognormal_mean(mu, sigma)
            report_step = None
            if job["report"]:
                per = [w["compute_s_per_step"] + w["comm_s_per_step"] for w in job["report"]["workers"]]
                report_step = c.mean(per)
            rows.append(
                {
                    "sigma": sigma,
                    "workers": n,
                    "measured_step_ms": 1e3 * measured,
                    "expected_max_ms": 1e3 * simulated,
                    "one_worker_mean_ms": 1e3 * single,
                    "overhead_ms": 1e3 * (measured - simulated),
                    "wait_ms": 1e3 * comm,
                    "report_step_ms": None if report_step is None else 1e3 * report_step,
                }
            )
            print(
                f"sigma {sigma}  N={n}: measured {1e3 * measured:6.1f} ms/step, E[max of {n}] {1e3 * simulated:6.1f} ms,"
                f" one worker's mean {1e3 * single:5.1f} ms",
                flush=True,
            )

    header = [
        "sigma",
        "N",
        "measured step ms",
        "E[max of N] ms (simulated)",
        "one worker mean ms",
        "gap ms",
        "fleet report step ms",
    ]
    table = [
        [
            r["sigma"],
            r["workers"],
            f"{r['measured_step_ms']:.1f}",
            f"{r['expected_max_ms']:.1f}",
            f"{r['one_worker_mean_ms']:.1f}",
            f"{r['overhead_ms']:.1f}",
            "-" if r["report_step_ms"] is None else f"{r['report_step_ms']:.1f}",
        ]
        for r in rows
    ]
    print(f"\nFan-out: mean sync step vs the expected maximum of N log-normal delays (median {args.median_ms:.0f} ms)")
    print(c.markdown_table(header, table))
    suffix = "-quick" if args.quick else ""
    c.write_csv(c.FIGURES / f"fanout{suffix}.csv", header, table)
    c.write_json(
        c.FIGURES / f"fanout{suffix}.json",
        {
            "mu": mu,
            "steps": steps,
            "machine": c.machine_note(),
            "command": "python benchmarks/fanout.py" + (" --quick" if args.quick else ""),
            "rows": rows,
        },
    )
    last = rows[-1]  # the largest N at the largest sigma: where fan-out costs most
    c.record_result(
        "fanout",
        variant=f"collective sync, N={args.workers}" + (" (quick)" if args.quick else ""),
        figure=f"mean sync step with a log-normal delay per step (median {args.median_ms:.0f} ms) vs the expected "
        "maximum of N delays",
        units="ms",
        fleet=round(last["measured_step_ms"], 2),
        peer=f"E[max of {last['workers']}] simulated",
        peer_value=round(last["expected_max_ms"], 2),
        ratio=round(last["measured_step_ms"] / last["expected_max_ms"], 4),
        ratio_means=f"measured / expected step at N={last['workers']}, sigma {last['sigma']}",
        summary="; ".join(
            f"sigma {r['sigma']} N={r['workers']}: {r['measured_step_ms']:.1f} ms vs E[max] {r['expected_max_ms']:.1f} ms"
            for r in rows
        ),
        headline=not args.quick,
        details={"rows": rows},
    )
    plt = c.pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for sigma, color in zip(sigmas, ["tab:blue", "tab:orange"], strict=False):
            sub = [r for r in rows if r["sigma"] == sigma]
            xs = [r["workers"] for r in sub]
            ax.plot(xs, [r["measured_step_ms"] for r in sub], "o-", color=color, label=f"measured, sigma {sigma}")
            ax.plot(
                xs,
                [r["expected_max_ms"] for r in sub],
                "s--",
                color=color,
                alpha=0.7,
                label=f"E[max of N] simulated, sigma {sigma}",
            )
            ax.axhline(
                sub[0]["one_worker_mean_ms"],
                color=color,
                linestyle=":",
                linewidth=0.8,
                label=f"one worker's mean delay, sigma {sigma}",
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(n) for n in counts])
        ax.set_xlabel("workers N (collective sync)")
        ax.set_ylabel("mean step time (ms)")
        ax.set_title(f"Fan-out: log-normal per-step delay, median {args.median_ms:.0f} ms")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        c.save_figure(fig, f"fanout{suffix}")


if __name__ == "__main__":
    main()
