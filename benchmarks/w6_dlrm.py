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
- ``fleet-table-wise``: ``mode="collective"`` with ``table_placement="table_wise"``: each table whole
  on one of the 2 workers (4 each, by width), the bags pooled where their table lives, only ids and
  pooled vectors (and their gradients) exchanged, the MLPs all-reduced;
- ``fleet-sharding``: ``mode="sharding"`` (tables sharded by default, the MLPs sharded by FSDP2);
- ``torchrec-tw-fused``, ``torchrec-rw-fused``, ``torchrec-auto`` (``torchrec-dp`` on request):
  TorchRec 1.8's ``EmbeddingBagCollection`` under ``DistributedModelParallel``, 2 ranks, from the
  peers' venv (``bash benchmarks/peers/setup.sh torchrec``; skipped with a note when missing);
- ``ddp``: plain ``DistributedDataParallel`` with replicated ``nn.EmbeddingBag`` tables, 2 ranks.

A one-process configuration trains on the union of the 2 workers' batches (512 samples a step),
so its loss is the one a synchronous 2-worker job must have: fleet's PS sync equals fleet in one
process. Every round runs every configuration once (the order reversed on odd rounds). Printed:

- a table: samples/s (median over rounds, the range), the job's **CPU seconds per 1,000 samples**
  (median over rounds; ``benchmarks/job_cpu.py``: user + system time of every process of the job,
  workers, servers, ranks and launchers, over the timed steps only: each worker measures its own
  CPU, the driver samples the others'), the load, the loss at the first and last step;
- the ratios, each with the check of both sides beside it (``benchmarks/gate.py``: **a ratio counts
  only a configuration that trains**, one whose loss at the last step ends within 0.01 of
  ``fleet-1p``'s in every round; those that do not are left out of every "best" and named on a
  ``not counted`` line): ``ratio vs PyTorch one-process`` (fleet-1p over torch-1p, target >= 0.9),
  ``ratio vs TorchRec best`` (fleet's fastest 2-worker configuration that trains over TorchRec's,
  target >= 1.2), ``tables sharded ... ratio vs TorchRec best`` (the best of fleet-sharded,
  fleet-table-wise and fleet-sharding, target >= 1.2), ``PS async dense-ar ... ratio vs TorchRec best`` (target >= 1.0),
  ``ratio vs DDP``, and ``CPU per 1,000 samples, fleet best vs TorchRec best`` (target <= 1.0);
- with ``--memory`` (fleet-1p, torch-1p, fleet-sharded, fleet-sharding): every table's every row is
  created before training (:func:`fill_tables`; the math is unchanged) and each process reports the
  resident memory the rows added (:func:`_memory`); printed per worker, and
  ``memory of the tables per worker, sharded over 2 / one process`` (the larger worker of
  fleet-sharded over fleet-1p, target <= 0.55);
- the loss curves side by side (the mean over workers at each step, round 1).

``--json`` writes every sample (each worker's result, the job's ``cpu``) and ``figures``: the
checks, the "best" configurations, the ratios and the memory figure.

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
import gate  # noqa: E402
import job_cpu  # noqa: E402
from peer_procs import TimedWindow  # noqa: E402

WORKERS = 2
ALL_CONFIGS = (
    "fleet-1p",
    "torch-1p",
    "fleet-ps-sync",
    "fleet-ps-async",
    "fleet-ps-async-dense-ar",
    "fleet-ps-sync-dense-ar",
    "fleet-sharded",
    "fleet-table-wise",
    "fleet-sharding",
    "torchrec-tw-fused",
    "torchrec-rw-fused",
    "torchrec-auto",
    "torchrec-dp",
    "ddp",
)
TABLES_SHARDED = ("fleet-sharded", "fleet-table-wise", "fleet-sharding")
# --memory: the configurations whose processes hold the tables (fleet's PS workers hold none)
MEMORY_CONFIGS = ("fleet-1p", "torch-1p", *TABLES_SHARDED)
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
        # nn.EmbeddingBag's (ids, offsets) as they are: fleet takes each bag's start as torch does
        return {name: {"ids": ids, "offsets": offsets} for name, (ids, offsets) in zip(names, feats, strict=True)}

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
    window = TimedWindow()
    for step in range(args.steps):
        if step == args.warmup:
            start = time.perf_counter()
            window.start()
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
    window.stop()
    timed = max(args.steps - args.warmup, 0) * samples
    return {"losses": losses, "samples_per_s": timed / elapsed, **window.fields(timed)}


def rss_bytes() -> int:
    """This process's resident memory now (VmRSS), after handing freed heap memory back to the system.

    ``malloc_trim`` first: the temporaries of filling the tables (each piece's ids and values) are
    freed, but glibc keeps freed heap pages resident until trimmed, and they are not the tables'.
    """
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the figure keeps what the allocator caches
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (ru_maxrss, KiB on Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def fill_tables(model: Any, spec: W.Spec) -> None:
    """Every row of every table (``--memory``), with the values its initializer would give it on first touch.

    fleet creates a row when an id is first looked up; TorchRec and ``nn.EmbeddingBag`` allocate
    the whole table. Loading each table's every id (``load_rows``, in pieces) makes fleet hold
    what they hold (13.7 M rows at the ``full`` sizes) without changing the math: a loaded row
    has the value its first lookup would create, and SGD keeps no per-row state. With tables
    sharded across the workers every worker is given every row and keeps the ones it owns.
    """
    import torch

    from fleet.sparse.optim import initial_rows

    piece = 1 << 20
    for table, (rows, dim) in zip(model.tables, spec.tables, strict=True):
        for first in range(0, rows, piece):
            ids = torch.arange(first, min(rows, first + piece))
            table.load_rows(ids, initial_rows(ids, dim, table.initializer, table.seed))


def _memory(args: argparse.Namespace, fill: Any) -> dict:
    """``--memory``: the resident memory ``fill()`` adds to this process (the tables' rows), and its peak.

    The peak is this process's high-water mark after ``fill`` minus the resident memory before it:
    an upper bound when something before ``fill`` (imports, the model's build) peaked higher.
    """
    if not getattr(args, "memory", False):
        return {}
    before = rss_bytes()
    fill()
    return {"tables_rss_bytes": rss_bytes() - before, "tables_peak_rss_bytes": peak_rss_bytes() - before}


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
        memory = _memory(args, lambda: fill_tables(model, spec))
    else:
        built = []  # nn.EmbeddingBag allocates and initializes every table whole when the model is built
        memory = _memory(args, lambda: built.append(W.TorchDLRM(spec)))
        model = built[0] if built else W.TorchDLRM(spec)
        opt = torch.optim.SGD(model.parameters(), lr=W.LR)

    def batch_of(step: int) -> tuple:
        return W.union([W.make_batch(spec, w, step) for w in range(WORKERS)])

    result = _train(model, opt, batch_of, args, WORKERS * args.batch)
    _report(args, {"worker": 0, **result, **memory})


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
    memory = _memory(args, lambda: fill_tables(model, spec))  # the driver asks only where workers hold tables
    fleet.barrier_worker()
    result = _train(model, opt, lambda step: W.make_batch(spec, rank, step), args, args.batch)
    _report(args, {"worker": rank, **result, **memory})
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


def _job(cmd: list[str], report: str, timeout: float, expect: int) -> tuple[list[dict], dict | None]:
    """Run one job to its end: (each worker's result, the job's CPU over the timed steps: :func:`job_cpu.job_cpu`)."""
    try:
        done, sampled = job_cpu.run_job(cmd, timeout)
    except subprocess.TimeoutExpired as e:
        raise RunFailed(f"timed out after {timeout:.0f} s: {' '.join(cmd)}") from e
    results = []
    if os.path.exists(report):
        with open(report) as f:
            results = sorted((json.loads(line) for line in f if line.strip()), key=lambda r: r["worker"])
    if done.returncode != 0 or len(results) != expect:
        raise RunFailed(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    cpu = job_cpu.job_cpu(results, sampled["series"])
    if cpu is not None:
        cpu["total_cpu_s"] = sampled["total_cpu_s"]
    return results, cpu


def launch(config: str, args: argparse.Namespace) -> tuple[list[dict], dict | None]:
    """Run one configuration to its end: each worker's (or the one process's) result, and the job's CPU."""
    with tempfile.TemporaryDirectory(prefix=f"w6-{config}-") as tmp:
        report = os.path.join(tmp, "report.jsonl")
        me = [os.path.abspath(__file__), *_common(args), "--report", report, "--fleet-model", args.fleet_model]
        me += ["--memory"] if args.memory and config in MEMORY_CONFIGS else []
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
    """The strategy file of a ``fleet-sharded``, ``fleet-table-wise``, ``fleet-sharding`` or
    ``fleet-ps-UPDATE[-dense-ar]`` configuration."""
    if config == "fleet-sharded":
        return 'mode = "collective"\ntable_placement = "sharded"\n'
    if config == "fleet-table-wise":
        return 'mode = "collective"\ntable_placement = "table_wise"\n'
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

    def cpu(self, part: str = "cpu_s") -> float:
        """The job's CPU seconds per 1,000 samples over the timed steps (median over rounds; NaN if unmeasured).

        ``part``: ``cpu_s`` (every process), ``others_cpu_s`` (the processes that are not workers: servers, launchers).
        """
        values = [1000 * s["cpu"][part] / s["cpu"]["timed_samples"] for s in self.samples if s.get("cpu")]
        return statistics.median(values) if values else float("nan")

    def curve(self, rnd: int = 0) -> list[float]:
        """A round's loss at each step, the mean over workers (= the loss on the union of their batches)."""
        workers = self.samples[rnd]["workers"]
        return [statistics.fmean(step) for step in zip(*(w["losses"] for w in workers), strict=True)]

    def last_losses(self) -> list[float]:
        """The loss at the last step in each round."""
        return [self.curve(i)[-1] for i in range(len(self.samples))]

    def memory(self) -> list[dict] | None:
        """Each worker's ``tables_rss_bytes`` and ``tables_peak_rss_bytes`` (the largest over rounds)."""
        if not self.samples or "tables_rss_bytes" not in self.samples[0]["workers"][0]:
            return None
        keys = ("tables_rss_bytes", "tables_peak_rss_bytes")
        return [
            {k: max(s["workers"][w][k] for s in self.samples) for k in keys}
            for w in range(len(self.samples[0]["workers"]))
        ]


def _fmt(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}"


def _mb(n: float) -> str:
    return f"{n / 2**20:,.0f} MB"


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
                workers, cpu = launch(config.name, args)
            except RunFailed as e:
                config.failures.append(str(e))
                print(f"round {rnd + 1}: {config.name}: FAILED ({str(e)[:1500]})", flush=True)
                continue
            sample = {
                "round": rnd + 1,
                "samples_per_s": sum(w["samples_per_s"] for w in workers),
                "cpu": cpu,
                "load": (load + os.getloadavg()[0]) / 2,
                "wall_s": time.perf_counter() - started,
                "workers": workers,
            }
            config.samples.append(sample)
            curve = config.curve(len(config.samples) - 1)
            per_1k = f"{cpu['cpu_per_1k']:5.3f}" if cpu else "  n/a"
            print(
                f"round {rnd + 1}: {config.name:23s} {sample['samples_per_s']:8.0f} samples/s  CPU {per_1k} s/1k"
                f"  load {sample['load']:4.1f}  loss {curve[0]:.4f} -> {curve[-1]:.4f}  ({sample['wall_s']:.0f} s)",
                flush=True,
            )
    return report(args, configs, notes)


def figures(ran: dict[str, Config]) -> dict[str, Any]:
    """The checks, the "best" configurations and the ratio lines of a run (printed by :func:`report`, in --json)."""
    ref = ran.get("fleet-1p")
    reference = ref.last_losses()[0] if ref else None
    checks = {n: gate.check(n, c.last_losses(), reference) for n, c in ran.items()}
    rates = {n: c.median() for n, c in ran.items()}
    cpus = {n: c.cpu() for n, c in ran.items()}
    distributed = [n for n in ran if n.startswith("fleet-") and n != "fleet-1p"]
    torchrec = [n for n in ran if n.startswith("torchrec-")]
    trec = gate.best(rates, checks, torchrec)
    fleet_best = gate.best(rates, checks, distributed)
    sharded = gate.best(rates, checks, [n for n in TABLES_SHARDED if n in ran])
    dense_ar = gate.best(rates, checks, [n for n in ("fleet-ps-async-dense-ar",) if n in ran])
    no_trec = "TorchRec did not run" if not torchrec else "no TorchRec configuration trains"
    lines, ratios = [], {}
    for key, label, num, den, target, missing in (
        ("fleet_1p_vs_torch_1p", "ratio vs PyTorch one-process", "fleet-1p" if ref else None,
         "torch-1p" if "torch-1p" in ran else None, ">= 0.9", "fleet-1p or torch-1p did not run"),
        ("fleet_best_vs_torchrec_best", "ratio vs TorchRec best", fleet_best, trec, ">= 1.2",
         no_trec if trec is None else "no distributed fleet configuration trains"),
        ("tables_sharded_vs_torchrec_best", "tables sharded (best of fleet-sharded/fleet-table-wise/fleet-sharding): ratio vs TorchRec best",
         sharded, trec, ">= 1.2", no_trec if trec is None else "no fleet-sharded, fleet-table-wise or fleet-sharding trains"),
        ("ps_async_dense_ar_vs_torchrec_best", "PS async dense-ar (fleet-ps-async-dense-ar): ratio vs TorchRec best",
         dense_ar, trec, ">= 1.0", no_trec if trec is None else "fleet-ps-async-dense-ar did not run or does not train"),
        ("fleet_best_vs_ddp", "ratio vs DDP", fleet_best, "ddp" if checks.get("ddp") and checks["ddp"].trains else None,
         "none", "ddp did not run or does not train"),
    ):  # fmt: skip
        line, ratios[key] = gate.ratio_line(label, num, den, rates, checks, target, missing)
        lines.append(line)
    # CPU: fleet's best (fastest distributed configuration that trains) against TorchRec's best, per sample
    line, ratios["cpu_fleet_best_vs_torchrec_best"] = gate.cpu_line(cpus, fleet_best, trec)
    lines.append(line)
    memory = None
    one, shard = ran.get("fleet-1p"), ran.get("fleet-sharded")
    if one and shard and one.memory() and shard.memory():
        base = one.memory()[0]["tables_rss_bytes"]
        per_worker = [w["tables_rss_bytes"] for w in shard.memory()]
        memory = {
            "one_process_tables_rss_bytes": base,
            "sharded_tables_rss_bytes": per_worker,
            "ratio": gate.ratio(max(per_worker), base),
        }
    out = [c for c in gate.excluded(checks, ran) if c.name != "fleet-1p"]
    return {
        "reference_loss": reference,
        "checks": {n: {"loss": c.loss, "trains": c.trains} for n, c in checks.items()},
        "best": {"fleet": fleet_best, "tables_sharded": sharded, "ps_async_dense_ar": dense_ar, "torchrec": trec},
        "ratios": ratios,
        "memory": memory,
        "not_counted": [c.note() for c in out],
        "lines": lines,
    }


def report(args: argparse.Namespace, configs: list[Config], notes: list[str]) -> int:
    from _common import record_result

    ran = {c.name: c for c in configs if c.samples}
    print(f"\nW6 DLRM, {args.steps} steps ({args.warmup} warm-up), {args.rounds} round(s): samples/s, all workers")
    print(
        "| configuration | samples/s (median) | range | CPU s / 1k samples (median) | of which not workers |"
        " load | loss first -> last |"
    )
    print("|---|---|---|---|---|---|---|")
    for c in configs:
        if not c.samples:
            print(f"| {c.name} | failed | | | | | {c.failures[0].splitlines()[0][:100] if c.failures else ''} |")
            continue
        values = [s["samples_per_s"] for s in c.samples]
        curve = c.curve()
        print(
            f"| {c.name} | {c.median():,.0f} | {min(values):,.0f}-{max(values):,.0f} | {c.cpu():.3f} |"
            f" {c.cpu('others_cpu_s'):.3f} |"
            f" {statistics.median(s['load'] for s in c.samples):.1f} | {curve[0]:.4f} -> {curve[-1]:.4f} |"
        )
    found = figures(ran)
    print()
    for line in notes:
        print(line)
    for label, name, prefix in (
        ("fleet best", found["best"]["fleet"], "fleet-"),
        ("TorchRec best", found["best"]["torchrec"], "torchrec-"),
    ):
        none = "none that trains" if any(n.startswith(prefix) and n != "fleet-1p" for n in ran) else "none ran"
        print(f"{label}: {f'{name} ({ran[name].median():,.0f} samples/s)' if name else none}")
    for n, c in ran.items():
        plan = c.samples[0]["workers"][0].get("plan")
        if plan and n.startswith("torchrec-"):
            print(f"{n} plan: " + ", ".join(f"{t} {how}" for t, how in plan.items()))
    for line in found["lines"]:
        print(line)
    if found["not_counted"]:
        print("not counted in any ratio: " + "; ".join(found["not_counted"]))
    memory = found["memory"]
    if memory:
        workers = ", ".join(f"worker {i} {_mb(b)}" for i, b in enumerate(memory["sharded_tables_rss_bytes"]))
        print(
            f"memory of the tables per worker, sharded over {WORKERS} / one process: {_fmt(memory['ratio'])} "
            f"(fleet-sharded: {workers}; fleet-1p {_mb(memory['one_process_tables_rss_bytes'])}; target <= 0.55)"
        )
    elif args.memory:
        print("memory of the tables: n/a (needs fleet-1p and fleet-sharded)")
    for n, c in ran.items():
        if args.memory and c.memory():
            shown = ", ".join(
                f"{_mb(w['tables_rss_bytes'])} (peak +{_mb(w['tables_peak_rss_bytes'])})" for w in c.memory()
            )
            print(f"  {n}: resident memory the tables added, per worker: {shown}")

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
            summary = {n: {"samples_per_s": c.median(), "cpu_per_1k": c.cpu()} for n, c in ran.items()}
            json.dump(
                {"args": vars(args), "configs": [c.__dict__ for c in configs], "summary": summary, "figures": found}, f
            )
    f1, t1 = ran.get("fleet-1p"), ran.get("torch-1p")
    r_1p = found["ratios"]["fleet_1p_vs_torch_1p"]
    fbest, trec = found["best"]["fleet"], found["best"]["torchrec"]
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
            target=">= 0.9 (issue 38)",
            headline=False,
            summary=f"one process: fleet {f1.median():,.0f} samples/s, nn.EmbeddingBag {t1.median():,.0f}: ratio {_fmt(r_1p)}",
            details={
                "steps": args.steps,
                "rounds": args.rounds,
                "sizes": args.sizes,
                "cpu_per_1k": {"fleet-1p": f1.cpu(), "torch-1p": t1.cpu()},
            },
        )
    if args.record and fbest and trec:
        r_trec = found["ratios"]["fleet_best_vs_torchrec_best"]
        record_result(
            "w6_dlrm",
            variant="fleet vs TorchRec",
            figure="total samples/s of fleet's best 2-worker configuration that trains over TorchRec's best (2 ranks)",
            units="samples/s",
            fleet=round(ran[fbest].median(), 1),
            peer=f"TorchRec 1.8 {trec.removeprefix('torchrec-')}",
            peer_value=round(ran[trec].median(), 1),
            ratio=r_trec,
            ratio_means="fleet samples/s / TorchRec samples/s (above 1: fleet is faster)",
            target=">= 1.2 (issue 38: tables sharded >= 1.2, PS async dense-ar >= 1.0; CPU per sample <= TorchRec's)",
            summary=(
                f"ratio vs TorchRec best ({trec.removeprefix('torchrec-')}): {_fmt(r_trec)} "
                f"({fbest.removeprefix('fleet-')}); ratio vs PyTorch one-process: {_fmt(r_1p)}"
            ),
            details={
                "samples_per_s": {n: round(c.median(), 1) for n, c in ran.items()},
                "cpu_per_1k": {n: c.cpu() for n, c in ran.items()},
                "ratios": found["ratios"],
                "checks": found["checks"],
                "memory": found["memory"],
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
    parser.add_argument(
        "--memory", action="store_true", help="fill every table's rows first; print the resident memory they take"
    )
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
