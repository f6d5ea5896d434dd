"""W5: the sparse-table life cycle on a drifting CTR stream: table rows, memory and AUC over a long run.

    python benchmarks/w5_lifecycle.py [--steps 20000] [--configs none,count2,count5,ttl,cap] [--parallel 2]

The stream (benchmarks/README.md, W5): 26 slots of ids drawn from a Zipf(1.1) law over
ranks; the 100,000 most popular ranks map to ids that drift (every 1,000 steps 20 % of
them get ids never seen before), the rest to ids of their own (a cold tail: over 20,000
steps the stream holds tens of millions of distinct ids). Each id has a hidden weight (a
hash of the id); the label is 1 when the sum of a sample's hidden weights plus
``dense @ w_true`` is above 0, with 5 % of the labels flipped, so only learned embeddings
give a good AUC.

Each configuration trains the same model from the same seed in one process (the local
table runs the same SparseTable code as a parameter server's shard): SparseEmbedding(16)
with Adagrad rows, an MLP, batch 512. Every ``--every`` steps it records the table's
rows, the process RSS and the AUC (``fleet.metrics.AUC``) on held-out batches drawn from
the stream at that step. The MLP is narrower than W2's (``--width``, 64) so that a
20,000-step run of every configuration fits in an hour on 2 cores; the table, where the
life cycle acts, is W2's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
from _common import machine_note, record_result

import fleet
from fleet.metrics import AUC

SLOTS, DIM, DENSE, BATCH = 26, 16, 13, 512
TOP, DRIFT_EVERY, DRIFT_SHARE, NOISE = 100_000, 1_000, 0.2, 0.05
MAX_RANK = 1 << 25  # ranks past it wrap around: a cold tail of ~33 M ids, most seen a few times
CONFIGS = {
    "none": {},
    "count2": {"entry": ("count", 2)},
    "count5": {"entry": ("count", 5)},
    "ttl": {"ttl_steps": 2_000},
    "cap": {"max_rows": 1_000_000},
}
_M = (0x9E3779B97F4A7C15 - (1 << 64), 0xBF58476D1CE4E5B9 - (1 << 64), 0x94D049BB133111EB - (1 << 64))


def _mix(x: torch.Tensor, salt: int) -> torch.Tensor:
    h = (x ^ salt) * _M[0]
    h = (h ^ ((h >> 30) & ((1 << 34) - 1))) * _M[1]
    h = (h ^ ((h >> 27) & ((1 << 37) - 1))) * _M[2]
    return h ^ ((h >> 31) & ((1 << 33) - 1))


class Stream:
    """W5's samples at a given step (deterministic in the seed and the step)."""

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.generation = torch.zeros(TOP, dtype=torch.int64)
        self.drifts = 0
        self.w_true = torch.randn(DENSE, generator=torch.Generator().manual_seed(0))

    def advance_to(self, step: int) -> None:
        while self.drifts < step // DRIFT_EVERY:
            self.drifts += 1
            g = torch.Generator().manual_seed(10_000 + self.drifts)
            self.generation[torch.randperm(TOP, generator=g)[: int(DRIFT_SHARE * TOP)]] += 1

    def ids_of(self, ranks: torch.Tensor) -> torch.Tensor:
        hot = ranks < TOP
        generation = torch.where(hot, self.generation[ranks.clamp(max=TOP - 1)], -1)
        return _mix(ranks * 1_000_003 + generation, 0x5EED) & ((1 << 62) - 1)

    @staticmethod
    def hidden_weight(ids: torch.Tensor) -> torch.Tensor:
        u = (_mix(ids, 0xABCD) >> 11 & ((1 << 53) - 1)).to(torch.float64) / float(1 << 53)
        return (2 * u - 1).to(torch.float32)

    def batch(self, step: int, stream: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.advance_to(step)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 7 + stream)
        u = torch.rand(BATCH, SLOTS, generator=g, dtype=torch.float64)
        ranks = (u.pow(-1 / 0.1) - 1).clamp(max=2.0**62).to(torch.int64) % MAX_RANK  # Zipf(1.1): P(rank > r) ~ r^-0.1
        ids = self.ids_of(ranks)
        dense = torch.randn(BATCH, DENSE, generator=g)
        score = self.hidden_weight(ids).sum(1) + 0.5 * (dense @ self.w_true)  # the ids carry most of it
        label = (score > 0).float()
        flip = torch.rand(BATCH, generator=g) < NOISE
        return ids, dense, torch.where(flip, 1 - label, label)


class Model(torch.nn.Module):
    def __init__(self, width: int, **lifecycle):
        super().__init__()
        self.embedding = fleet.nn.SparseEmbedding(DIM, seed=0, optimizer={"kind": "adagrad", "lr": 0.1}, **lifecycle)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(SLOTS * DIM + DENSE, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, 1),
        )

    def forward(self, ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([self.embedding(ids).flatten(1), dense], 1)).squeeze(1)


def _lifecycle(config: dict) -> dict:
    out = dict(config)
    if "entry" in out:
        kind, value = out.pop("entry")
        out["entry"] = fleet.CountFilterEntry(value) if kind == "count" else fleet.ProbabilityEntry(value)
    return out


def _rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run(name: str, steps: int, every: int, width: int, eval_batches: int, out: Path | None = None) -> dict:
    torch.manual_seed(0)
    stream = Stream(seed=1)
    model = Model(width, **_lifecycle(CONFIGS[name]))
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    distinct = set() if steps <= 2_000 else None  # exact distinct count only for short runs
    points, started = [], time.perf_counter()
    for step in range(1, steps + 1):
        ids, dense, label = stream.batch(step)
        if distinct is not None:
            distinct.update(ids.view(-1).tolist())
        optimizer.zero_grad()
        loss = loss_fn(model(ids, dense), label)
        loss.backward()
        model.embedding.record_clicks(label)
        optimizer.step()
        if step % every == 0 or step == steps:
            auc = AUC()
            model.eval()
            with torch.no_grad():
                for b in range(eval_batches):  # held out: other samples of the stream as it is now
                    e_ids, e_dense, e_label = stream.batch(step, stream=1 + b)
                    auc.update(torch.sigmoid(model(e_ids, e_dense)), e_label)
            model.train()
            point = {
                "step": step,
                "rows": model.embedding.num_rows(),
                "rss_mib": round(_rss_mib(), 1),
                "auc": round(auc.compute(), 4),
                "loss": round(loss.item(), 4),
                "s": round(time.perf_counter() - started, 1),
            }
            points.append(point)
            print(name, json.dumps(point), flush=True)
            if out is not None:  # a long run leaves what it measured so far (--replot draws it)
                out.write_text(json.dumps(_result(name, model, points, distinct)) + "\n")
    return _result(name, model, points, distinct)


def _result(name: str, model: Model, points: list[dict], distinct: set | None) -> dict:
    table = model.embedding.local.table
    return {
        "config": name,
        "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in CONFIGS[name].items()},
        "points": points,
        "counts": table.counts if table is not None else {},
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "distinct_ids": len(distinct) if distinct is not None else None,
    }


def plot(results: list[dict], path: Path) -> None:
    from _common import pyplot

    plt = pyplot()
    if plt is None:
        return
    fig, (rows_ax, auc_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for result in results:
        steps = [p["step"] for p in result["points"]]
        rows_ax.plot(steps, [p["rows"] / 1e6 for p in result["points"]], label=result["config"])
        auc_ax.plot(steps, [p["auc"] for p in result["points"]], label=result["config"])
    rows_ax.set(xlabel="step", ylabel="rows in the table (millions)", title="W5: table size")
    auc_ax.set(xlabel="step", ylabel="AUC, held-out samples of the current stream", title="W5: AUC")
    rows_ax.legend()
    auc_ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"figure: {path}")


def _run_children(args: argparse.Namespace, out: Path) -> list[dict]:
    names = args.configs.split(",")
    parts = {name: out.with_name(f"{out.stem}.{name}.json") for name in names}
    pending: list[str] = list(names)
    running: list[tuple[str, subprocess.Popen]] = []
    while pending or running:
        while pending and len(running) < args.parallel:
            name = pending.pop(0)
            cmd = [sys.executable, __file__, "--child", name, "--out", str(parts[name])]
            cmd += ["--steps", str(args.steps), "--every", str(args.every), "--width", str(args.width)]
            cmd += ["--eval-batches", str(args.eval_batches)]
            running.append((name, subprocess.Popen(cmd)))
        name, child = running.pop(0)
        if child.wait() != 0:
            sys.exit(f"configuration {name} failed ({child.returncode})")
    return [json.loads(parts[name].read_text()) for name in names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--every", type=int, default=500)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--eval-batches", type=int, default=4)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--out", default=str(Path(__file__).parent.parent / "docs" / "figures" / "w5_lifecycle.json"))
    parser.add_argument("--replot", action="store_true", help="redraw the figure from --out")
    parser.add_argument("--parallel", type=int, default=1, help="configurations run at once (one process each)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    if args.child:  # one configuration in a process of its own, so its RSS is its own
        run(args.child, args.steps, args.every, args.width, args.eval_batches, out)
        return
    if args.replot:  # the finished run, or what each configuration wrote so far
        parts = [out.with_name(f"{out.stem}.{name}.json") for name in args.configs.split(",")]
        done = json.loads(out.read_text())["results"] if out.exists() else None
        results = done or [json.loads(p.read_text()) for p in parts if p.exists()]
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        results = _run_children(args, out)
        out.write_text(
            json.dumps({"steps": args.steps, "machine": machine_note(), "results": results}, indent=1) + "\n"
        )
    print(f"\nW5, {args.steps} steps, batch {BATCH}, MLP width {args.width}")
    print(
        "| config | rows at the end | peak RSS MiB | AUC at the end | mean AUC, last quarter | evicted | dropped grads |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        last = r["points"][-1]
        tail = [p["auc"] for p in r["points"][3 * len(r["points"]) // 4 :]]
        c = r["counts"]
        print(
            f"| {r['config']} | {last['rows']:,} | {r['peak_rss_mib']:.0f} | {last['auc']:.4f} | "
            f"{sum(tail) / len(tail):.4f} | {c.get('evicted', 0):,} | {c.get('dropped_gradients', 0):,} |"
        )
    plot(results, Path(__file__).parent.parent / "docs" / "figures" / "w5_lifecycle.png")
    if not args.replot:
        _record(results, args)


def _record(results: list[dict], args: argparse.Namespace) -> None:
    """One result per run: each configuration's rows, memory and AUC at the end, against the unbounded table."""
    ends = {
        r["config"]: {
            "rows": r["points"][-1]["rows"],
            "peak_rss_mib": round(r["peak_rss_mib"], 1),
            "auc": r["points"][-1]["auc"],
            "distinct_ids": r.get("distinct_ids"),
        }
        for r in results
    }
    base = ends.get("none")
    main = ends.get("count2") or next(iter(ends.values()))
    parts = [
        f"{name}: {e['rows'] / 1e6:.2f} M rows / {e['peak_rss_mib'] / 1024:.1f} GiB, AUC {e['auc']:.4f}"
        for name, e in ends.items()
    ]
    record_result(
        "w5_lifecycle",
        variant=f"{args.steps:,} steps, configurations {','.join(ends)}",
        figure="sparse-table life cycle on a drifting stream: rows, peak RSS and AUC at the end, per configuration",
        units="rows",
        fleet=main["rows"],
        peer="unbounded table" if base else None,
        peer_value=base["rows"] if base else None,
        ratio=round(main["rows"] / base["rows"], 4) if base else None,
        ratio_means="rows with count filter 2 / rows of the unbounded table" if base else None,
        target="bounded tables, AUC close",
        summary="; ".join(parts),
        details={"configs": ends, "width": args.width},
    )


if __name__ == "__main__":
    main()
