"""W2: CTR model on the parameter server (see benchmarks/README.md): samples/s and loss at 300 steps.

    python benchmarks/w2_ctr.py [--steps 300] [--modes async,sync,geo] [--servers 1,2]

Each configuration is one ``fleetrun --servers S --workers 2 --strategy ...`` run of
examples/single_to_multi/train_ctr.py (the W2 model: 26 slots of uniform ids in
[0, 1e6), one shared SparseEmbedding of dim 16, 13 dense features, MLP 400-400-400-1,
BCE, SGD lr 0.1, batch 512 per worker). Figure: total samples/s over both workers
after 10 warm-up steps, and each worker's loss at the last step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "single_to_multi", "train_ctr.py")
STRATEGIES = {
    "async": 'mode = "ps"\nupdate = "async"\n',
    "sync": 'mode = "ps"\nupdate = "sync"\n',
    "geo": 'mode = "ps"\nupdate = "geo"\nk_steps = 100\n',
}


def run(mode: str, servers: int, steps: int, workers: int = 2) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        strategy = os.path.join(tmp, f"{mode}.toml")
        with open(strategy, "w") as f:
            f.write(STRATEGIES[mode])
        report = os.path.join(tmp, "report.jsonl")
        cmd = [
            "fleetrun",
            "--servers",
            str(servers),
            "--workers",
            str(workers),
            "--strategy",
            strategy,
            "--log-dir",
            os.path.join(tmp, "logs"),
            SCRIPT,
            "--steps",
            str(steps),
            "--report",
            report,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        with open(report) as f:
            return sorted((json.loads(line) for line in f), key=lambda r: r["worker"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--modes", default="async,sync,geo")
    parser.add_argument("--servers", default="1,2")
    args = parser.parse_args()
    rows = []
    for servers in (int(s) for s in args.servers.split(",")):
        for mode in args.modes.split(","):
            results = run(mode, servers, args.steps)
            total = sum(r["samples_per_s"] for r in results)
            losses = " / ".join(f"{r['loss']:.4f}" for r in results)
            rows.append((mode, servers, total, losses))
            print(
                f"{mode:6s} servers={servers}: {total:9.0f} samples/s, loss at step {args.steps}: {losses}", flush=True
            )
    print(f"\nW2, 2 workers, batch 512/worker, {args.steps} steps (samples/s after 10 warm-up steps)")
    print("| mode  | servers | samples/s (total) | loss per worker |")
    print("|-------|---------|-------------------|-----------------|")
    for mode, servers, total, losses in rows:
        print(f"| {mode:5s} | {servers:7d} | {total:17.0f} | {losses} |")


if __name__ == "__main__":
    main()
