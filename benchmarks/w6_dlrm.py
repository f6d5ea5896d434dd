"""W6: a DLRM-shaped model (benchmarks/README.md): fleet against plain PyTorch and TorchRec, in one run.

    python benchmarks/w6_dlrm.py [--rounds 2] [--steps 100] [--configs ...] [--sizes full] [--json FILE]

The workload (``benchmarks/peers/dlrm_workload.py``): 8 tables of 10 k to 10 M rows, dims 16 to 64,
multi-hot bags of about 10 Zipf-distributed ids, 13 dense features, DLRM's dot interaction and
MLPs, BCE, SGD lr 0.5, batch 256 per worker. Configurations (``--configs``, comma-separated):

- ``fleet-1p``: fleet in one process (``fleet.nn.SparseEmbeddingBag`` per table, its local tables);
- ``torch-1p``: the same model with ``nn.EmbeddingBag`` tables (sparse gradients), plain PyTorch;
- ``fleet-ps-sync``, ``fleet-ps-async``: fleet's parameter server, 1 server + 2 workers
  (``python -m fleet.launch``);
- ``fleet-ps-async-dense-ar`` (``fleet-ps-sync-dense-ar`` on request): the same with
  ``dense_placement="allreduce"``: the server holds only the tables, the workers all-reduce the MLPs;
- ``fleet-sharded``: ``mode="collective"`` with ``table_placement="sharded"``: each table's rows split
  across the 2 workers, ids and rows exchanged by all-to-all, the MLPs all-reduced;
- ``fleet-sharding``: ``mode="sharding"`` (tables sharded by default, the MLPs sharded by FSDP2);
- ``torchrec-tw-fused``, ``torchrec-rw-fused``, ``torchrec-auto`` (``torchrec-dp`` on request):
  TorchRec 1.8's ``EmbeddingBagCollection`` under ``DistributedModelParallel``, 2 ranks, from the
  peers' venv (``bash benchmarks/peers/setup.sh torchrec``; skipped with a note when missing);
- ``ddp``: plain ``DistributedDataParallel`` with replicated ``nn.EmbeddingBag`` tables, 2 ranks.

A one-process configuration trains on the union of the 2 workers' batches (512 samples a step),
so its loss is the one a synchronous 2-worker job must have: fleet's PS sync equals fleet in one
process. Every round runs every configuration once (the order reversed on odd rounds). Printed:
a table of samples/s (median over rounds), ``ratio vs PyTorch one-process: X`` (fleet-1p over
torch-1p), ``ratio vs TorchRec best: Y`` (fleet's best PS configuration over TorchRec's best), and
the loss curves side by side (the mean over workers at each step, round 1).

``--fleet-model collection`` (default) builds one ``fleet.nn.SparseFeatureCollection`` for all tables
(one pull and one push per server a step); ``bags`` one ``SparseEmbeddingBag`` per table (:func:`build_fleet_model`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS = os.path.join(HERE, "peers")
sys.path.insert(0, PEERS)

import dlrm_workload as W  # noqa: E402

WORKERS = 2
ALL_CONFIGS = (
    "fleet-1p",
    "torch-1p",
    "fleet-ps-sync",
    "fleet-ps-async",
    "fleet-ps-async-dense-ar",
    "fleet-ps-sync-dense-ar",
    "fleet-sharded",
    "fleet-sharding",
    "torchrec-tw-fused",
    "torchrec-rw-fused",
    "torchrec-auto",
    "torchrec-dp",
    "ddp",
)
# dp all-reduces every table, 1 GB a step; sync with the dense layers all-reduced is the same math as fleet-ps-sync
DEFAULT_CONFIGS = [c for c in ALL_CONFIGS if c not in ("torchrec-dp", "fleet-ps-sync-dense-ar")]


# --------------------------------------------------------------------------- fleet's model


def build_fleet_model(spec: W.Spec, kind: str = "bags") -> Any:
    """fleet's DLRM: its embedding tables (the one place that builds them) and W6's dense part.

    ``bags``: one ``fleet.nn.SparseEmbeddingBag(dim, mode="sum")`` per table (a pull and a push
    per table and server each step). ``collection``: ``fleet.nn.SparseFeatureCollection``, one
    module for all tables, once fleet has it. The module returned has ``forward(dense, feats)``
    (``feats``: per table ``(ids, offsets)``) and ``prefetch(feats)``.
    """
    import torch

    import fleet

    if kind == "collection":
        return _fleet_collection_model(spec)
    if kind != "bags":
        raise SystemExit(f"--fleet-model must be 'bags' or 'collection', got {kind!r}")

    class FleetDLRM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dense = W.dense_part(spec)
            self.tables = torch.nn.ModuleList(
                fleet.nn.SparseEmbeddingBag(dim, mode="sum", seed=i, initializer=spec.init)
                for i, (_, dim) in enumerate(spec.tables)
            )

        def forward(self, dense: torch.Tensor, feats: list) -> torch.Tensor:
            pooled = [t(ids, offsets) for t, (ids, offsets) in zip(self.tables, feats, strict=True)]
            return self.dense(dense, pooled)

        def prefetch(self, feats: list) -> None:
            """The next batch's rows (PS async: they arrive while this step computes; elsewhere a no-op)."""
            for table, (ids, _) in zip(self.tables, feats, strict=True):
                table.prefetch(ids)

    return FleetDLRM()


def _fleet_collection_model(spec: W.Spec) -> Any:
    """W6 with one ``fleet.nn.SparseFeatureCollection`` for all tables: one pull and one push per server a step."""
    import torch

    import fleet
    from fleet.nn import FeatureTable

    names = [f"t{i}" for i in range(len(spec.tables))]

    def jagged(feats: list) -> dict:
        out = {}
        for name, (ids, offsets) in zip(names, feats, strict=True):
            out[name] = (ids, torch.diff(offsets, append=offsets.new_tensor([ids.numel()])))
        return out

    class FleetDLRMCollection(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dense = W.dense_part(spec)
            self.tables = fleet.nn.SparseFeatureCollection(
                [FeatureTable(name, dim, seed=i, initializer=spec.init)
                 for i, (name, (_, dim)) in enumerate(zip(names, spec.tables, strict=True))]
            )  # fmt: skip

        def forward(self, dense: torch.Tensor, feats: list) -> torch.Tensor:
            pooled = self.tables(jagged(feats))
            return self.dense(dense, [pooled[name] for name in names])

        def prefetch(self, feats: list) -> None:
            """The next batch's rows (PS async: they arrive while this step computes; elsewhere a no-op)."""
            self.tables.prefetch(jagged(feats))

    return FleetDLRMCollection()


# --------------------------------------------------------------------------- one process / one worker


def _train(model: Any, opt: Any, batch_of: Any, args: argparse.Namespace, samples: int) -> dict:
    """Run ``args.steps`` steps; the losses and the samples/s after ``args.warmup`` steps."""
    import torch

    loss_fn = torch.nn.BCEWithLogitsLoss()
    prefetch = getattr(model, "prefetch", None)
    losses: list[float] = []
    upcoming = batch_of(0)
    start = time.perf_counter()
    for step in range(args.steps):
        if step == args.warmup:
            start = time.perf_counter()
        dense, feats, label = upcoming
        opt.zero_grad()
        loss = loss_fn(model(dense, feats), label)
        upcoming = batch_of(step + 1) if step + 1 < args.steps else None
        if prefetch is not None and upcoming is not None:
            prefetch(upcoming[1])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    elapsed = time.perf_counter() - start
    return {"losses": losses, "samples_per_s": max(args.steps - args.warmup, 0) * samples / elapsed}


def _report(args: argparse.Namespace, result: dict) -> None:
    with open(args.report, "a") as f:
        f.write(json.dumps(result) + "\n")


def local_main(args: argparse.Namespace) -> None:
    """One process on the union of the workers' batches: fleet's model or plain PyTorch's."""
    import torch

    torch.set_num_threads(1)
    spec = W.spec(args.sizes, args.batch, args.init)
    if args.system == "fleet":
        import fleet

        fleet.init()
        model = build_fleet_model(spec, args.fleet_model)
        opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=W.LR))
    else:
        model = W.TorchDLRM(spec)
        opt = torch.optim.SGD(model.parameters(), lr=W.LR)

    def batch_of(step: int) -> tuple:
        return W.union([W.make_batch(spec, w, step) for w in range(WORKERS)])

    result = _train(model, opt, batch_of, args, WORKERS * args.batch)
    _report(args, {"worker": 0, **result})


def worker_main(args: argparse.Namespace) -> None:
    """One worker of a fleet PS job (under ``fleet.launch``; a server serves inside ``fleet.init()``)."""
    import torch

    import fleet

    torch.set_num_threads(1)
    fleet.init()
    spec = W.spec(args.sizes, args.batch, args.init)
    rank = fleet.worker_index()
    model = build_fleet_model(spec, args.fleet_model)
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=W.LR))
    fleet.barrier_worker()
    result = _train(model, opt, lambda step: W.make_batch(spec, rank, step), args, args.batch)
    _report(args, {"worker": rank, **result})
    fleet.stop_worker()


# --------------------------------------------------------------------------- the driver


class RunFailed(RuntimeError):
    pass


def peer_python() -> str:
    """The TorchRec venv's interpreter (benchmarks/peers/setup.sh; FLEET_PEERS_VENVS moves the venvs)."""
    venvs = os.environ.get("FLEET_PEERS_VENVS") or os.path.join(PEERS, ".venvs")
    return os.path.join(venvs, "torchrec", "bin", "python")


def _common(args: argparse.Namespace) -> list[str]:
    return ["--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
            "--sizes", args.sizes, "--init", args.init]  # fmt: skip


def _job(cmd: list[str], report: str, timeout: float, expect: int) -> list[dict]:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise RunFailed(f"timed out after {timeout:.0f} s: {' '.join(cmd)}") from e
    results = []
    if os.path.exists(report):
        with open(report) as f:
            results = sorted((json.loads(line) for line in f if line.strip()), key=lambda r: r["worker"])
    if done.returncode != 0 or len(results) != expect:
        raise RunFailed(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return results


def launch(config: str, args: argparse.Namespace) -> list[dict]:
    """Run one configuration to its end: each worker's (or the one process's) result."""
    with tempfile.TemporaryDirectory(prefix=f"w6-{config}-") as tmp:
        report = os.path.join(tmp, "report.jsonl")
        me = [os.path.abspath(__file__), *_common(args), "--report", report, "--fleet-model", args.fleet_model]
        if config in ("fleet-1p", "torch-1p"):
            cmd = [sys.executable, *me, "--role", "local", "--system", config.split("-")[0]]
            return _job(cmd, report, args.timeout, 1)
        if config.startswith("fleet-") and config != "fleet-1p":
            strategy = os.path.join(tmp, "strategy.toml")
            with open(strategy, "w") as f:
                f.write(fleet_strategy(config))
            servers = ["--servers", "1"] if config.startswith("fleet-ps-") else []
            cmd = [sys.executable, "-m", "fleet.launch", *servers, "--workers", str(WORKERS)]
            cmd += ["--strategy", strategy, "--log-dir", os.path.join(tmp, "logs"), *me, "--role", "worker"]
            return _job(cmd, report, args.timeout, WORKERS)
        python = sys.executable if config == "ddp" else peer_python()
        peer = config.removeprefix("torchrec-")
        cmd = [python, os.path.join(PEERS, "w6_torchrec.py"), "--config", peer, *_common(args), "--report", report]
        return _job([*cmd, "--timeout", str(args.timeout)], report, args.timeout + 60, WORKERS)


def fleet_strategy(config: str) -> str:
    """The strategy file of a ``fleet-sharded``, ``fleet-sharding`` or ``fleet-ps-UPDATE[-dense-ar]`` configuration."""
    if config == "fleet-sharded":
        return 'mode = "collective"\ntable_placement = "sharded"\n'
    if config == "fleet-sharding":
        return 'mode = "sharding"\n'
    update, _, placement = config.removeprefix("fleet-ps-").partition("-")
    text = f'mode = "ps"\nupdate = "{update}"\n'
    return text + ('dense_placement = "allreduce"\n' if placement == "dense-ar" else "")


@dataclass
class Config:
    name: str
    samples: list[dict] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def median(self) -> float:
        values = [s["samples_per_s"] for s in self.samples]
        return statistics.median(values) if values else float("nan")

    def curve(self) -> list[float]:
        """The first round's loss at each step, the mean over workers (= the loss on the union of their batches)."""
        workers = self.samples[0]["workers"]
        return [statistics.fmean(step) for step in zip(*(w["losses"] for w in workers), strict=True)]


def _ratio(a: float, b: float) -> float | None:
    return a / b if a == a and b == b and b > 0 else None


def _fmt(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}"


def run(args: argparse.Namespace) -> int:
    names = [c for c in args.configs.split(",") if c]
    unknown = [c for c in names if c not in ALL_CONFIGS]
    if unknown:
        raise SystemExit(f"unknown --configs {', '.join(unknown)}: choose from {', '.join(ALL_CONFIGS)}")
    notes = []
    if any(c.startswith("torchrec-") for c in names) and not os.path.exists(peer_python()):
        notes.append(
            f"TorchRec skipped: no venv at {peer_python()}; create it with `bash benchmarks/peers/setup.sh torchrec`"
        )
        names = [c for c in names if not c.startswith("torchrec-")]
    configs = [Config(n) for n in names]
    tables = ", ".join(f"{rows:,}x{dim}" for rows, dim in W.spec(args.sizes).tables)
    print(
        f"W6 DLRM: {len(configs)} configurations x {args.rounds} round(s), {args.steps} steps each, batch "
        f"{args.batch}/worker, tables {tables}; {os.cpu_count()} CPU cores, load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    for line in notes:
        print(line, flush=True)
    for rnd in range(args.rounds):
        for config in configs if rnd % 2 == 0 else configs[::-1]:
            load = os.getloadavg()[0]
            started = time.perf_counter()
            try:
                workers = launch(config.name, args)
            except RunFailed as e:
                config.failures.append(str(e))
                print(f"round {rnd + 1}: {config.name}: FAILED ({str(e)[:1500]})", flush=True)
                continue
            sample = {
                "round": rnd + 1,
                "samples_per_s": sum(w["samples_per_s"] for w in workers),
                "load": (load + os.getloadavg()[0]) / 2,
                "wall_s": time.perf_counter() - started,
                "workers": workers,
            }
            config.samples.append(sample)
            print(
                f"round {rnd + 1}: {config.name:18s} {sample['samples_per_s']:8.0f} samples/s  load "
                f"{sample['load']:4.1f}  loss {config.curve()[0]:.4f} -> {config.curve()[-1]:.4f}"
                f"  ({sample['wall_s']:.0f} s)",
                flush=True,
            )
    return report(args, configs, notes)


def report(args: argparse.Namespace, configs: list[Config], notes: list[str]) -> int:
    from _common import record_result

    ran = {c.name: c for c in configs if c.samples}
    print(f"\nW6 DLRM, {args.steps} steps ({args.warmup} warm-up), {args.rounds} round(s): samples/s, all workers")
    print("| configuration | samples/s (median) | range | load | loss first -> last |")
    print("|---|---|---|---|---|")
    for c in configs:
        if not c.samples:
            print(f"| {c.name} | failed | | | {c.failures[0].splitlines()[0][:100] if c.failures else ''} |")
            continue
        values = [s["samples_per_s"] for s in c.samples]
        curve = c.curve()
        print(
            f"| {c.name} | {c.median():,.0f} | {min(values):,.0f}-{max(values):,.0f} |"
            f" {statistics.median(s['load'] for s in c.samples):.1f} | {curve[0]:.4f} -> {curve[-1]:.4f} |"
        )

    def best(prefix: str) -> Config | None:
        found = [c for n, c in ran.items() if n.startswith(prefix)]
        return max(found, key=Config.median) if found else None

    f1, t1 = ran.get("fleet-1p"), ran.get("torch-1p")
    fps, trec, ddp = best("fleet-ps-"), best("torchrec-"), ran.get("ddp")
    r_1p = _ratio(f1.median(), t1.median()) if f1 and t1 else None
    r_trec = _ratio(fps.median(), trec.median()) if fps and trec else None
    r_ddp = _ratio(fps.median(), ddp.median()) if fps and ddp else None
    print()
    for line in notes:
        print(line)
    for label, c in (("fleet PS best", fps), ("TorchRec best", trec)):
        print(f"{label}: {f'{c.name} ({c.median():,.0f} samples/s)' if c else 'none ran'}")
    for n, c in ran.items():
        plan = c.samples[0]["workers"][0].get("plan")
        if plan and n.startswith("torchrec-"):
            print(f"{n} plan: " + ", ".join(f"{t} {how}" for t, how in plan.items()))
    print(f"ratio vs PyTorch one-process: {_fmt(r_1p)} (target >= 0.8)")
    print(f"ratio vs TorchRec best: {_fmt(r_trec)} (target >= 1.2)")
    print(f"ratio vs DDP: {_fmt(r_ddp)}")

    curves = {n: c.curve() for n, c in ran.items()}
    if curves:
        steps = len(next(iter(curves.values())))
        every = max(1, steps // 10)
        shown = sorted({*range(0, steps, every), steps - 1})
        print("\nloss (mean over workers = the loss on the union of their batches), round 1")
        print("| step | " + " | ".join(curves) + " |")
        print("|---" * (len(curves) + 1) + "|")
        for s in shown:
            print(f"| {s} | " + " | ".join(f"{curve[s]:.4f}" for curve in curves.values()) + " |")
    sync_gap = None
    if "fleet-1p" in curves and "fleet-ps-sync" in curves:
        sync_gap = max(abs(a - b) for a, b in zip(curves["fleet-1p"], curves["fleet-ps-sync"], strict=True))
        print(
            f"PS sync against one process: largest loss difference {sync_gap:.2e} over {len(curves['fleet-1p'])} steps"
        )

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "configs": [c.__dict__ for c in configs]}, f)
    if args.record and f1 and t1:
        record_result(
            "w6_dlrm",
            variant="one process",
            figure="samples/s of fleet in one process (SparseEmbeddingBag tables) over the same model with nn.EmbeddingBag",
            units="samples/s",
            fleet=round(f1.median(), 1),
            peer="plain PyTorch nn.EmbeddingBag, one process",
            peer_value=round(t1.median(), 1),
            ratio=r_1p,
            ratio_means="fleet samples/s / PyTorch samples/s (above 1: fleet is faster)",
            target=">= 0.8 (issue 25)",
            headline=False,
            summary=f"one process: fleet {f1.median():,.0f} samples/s, nn.EmbeddingBag {t1.median():,.0f}: ratio {_fmt(r_1p)}",
            details={"steps": args.steps, "rounds": args.rounds, "sizes": args.sizes},
        )
    if args.record and fps and trec:
        record_result(
            "w6_dlrm",
            variant="PS vs TorchRec",
            figure="total samples/s of fleet's best PS configuration (1 server, 2 workers) over TorchRec's best (2 ranks)",
            units="samples/s",
            fleet=round(fps.median(), 1),
            peer=f"TorchRec 1.8 {trec.name.removeprefix('torchrec-')}",
            peer_value=round(trec.median(), 1),
            ratio=r_trec,
            ratio_means="fleet samples/s / TorchRec samples/s (above 1: fleet is faster)",
            target=">= 1.2 (issue 25)",
            summary=(
                f"ratio vs TorchRec best ({trec.name.removeprefix('torchrec-')}): {_fmt(r_trec)} "
                f"({fps.name.removeprefix('fleet-')}); ratio vs PyTorch one-process: {_fmt(r_1p)}"
            ),
            details={
                "samples_per_s": {n: round(c.median(), 1) for n, c in ran.items()},
                "ratio_vs_ddp": r_ddp,
                "ps_sync_vs_one_process_max_loss_diff": sync_gap,
                "steps": args.steps,
                "rounds": args.rounds,
                "sizes": args.sizes,
            },
        )
    return 0 if ran else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help="from: " + ", ".join(ALL_CONFIGS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=256, help="per worker (a one-process run trains on 2x)")
    parser.add_argument("--sizes", default="full", help="the tables: " + ", ".join(W.SIZES))
    parser.add_argument("--init", default="uniform", choices=["uniform", "zeros"], help="the rows' initial values")
    parser.add_argument("--fleet-model", default="collection", choices=["bags", "collection"])
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before a job is killed")
    parser.add_argument("--json", default=None, help="write every sample here")
    parser.add_argument("--no-record", dest="record", action="store_false", help="do not write benchmarks/results/")
    parser.add_argument("--role", choices=["driver", "local", "worker"], default="driver", help=argparse.SUPPRESS)
    parser.add_argument("--system", choices=["fleet", "torch"], default="fleet", help=argparse.SUPPRESS)
    parser.add_argument("--report", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "local":
        local_main(args)
    elif args.role == "worker":
        worker_main(args)
    else:
        sys.exit(run(args))


if __name__ == "__main__":
    main()
