"""W2: CTR model on the parameter server (see benchmarks/README.md): samples/s and loss at 300 steps.

    python benchmarks/w2_ctr.py [--steps 300] [--modes async,sync,geo] [--servers 1,2]
    python benchmarks/w2_ctr.py --peers [--rounds 3] [--steps 300] [--json FILE] [--no-record]

Each fleet configuration is one ``fleetrun --servers S --workers 2 --strategy ...`` run of
examples/single_to_multi/train_ctr.py (the W2 model: 26 slots of uniform ids in
[0, 1e6), one shared SparseEmbedding of dim 16, 13 dense features, MLP 400-400-400-1,
BCE, SGD lr 0.1, batch 512 per worker). Figure: total samples/s over both workers
after 10 warm-up steps, the job's CPU seconds per 1,000 samples over those steps
(``benchmarks/job_cpu.py``), and each worker's loss at the last step.

``--peers``: fleet's PS async and sync with 1 and 2 servers, PS async with the dense layers
all-reduced among the workers (``async-dense-ar``: ``dense_placement="allreduce"``), and the table
sharded across the 2 workers with no server (``sharded``: ``mode="collective"``,
``table_placement="sharded"``; ``--modes``/``--servers`` narrow them; ``sharded`` also runs in the
fleet-only mode when named in ``--modes``), alternately with TorchRec's configurations
(benchmarks/peers/w2_torchrec.py) and PaddlePaddle's Fleet parameter server
(benchmarks/peers/w2_paddle.py) on the same workload, each peer from its own venv
(``bash benchmarks/peers/setup.sh``; a missing one is skipped with a note). Every round runs every
configuration once, fleet's and the peers' interleaved (the order reversed on odd rounds), so load
drift hits them alike; the load average is recorded beside each sample. Printed: a table (median
samples/s over rounds, the range, the job's CPU seconds per 1,000 samples over the timed steps,
every process of the job counted: ``benchmarks/job_cpu.py``, the load, each worker's first and last
loss, whether the loss fell on every worker), then the ratios, each with the check of both sides
beside it (``benchmarks/gate.py``: a configuration counts only when its loss at the last step, the
mean over the workers, ends within 0.01 of fleet's PS sync with 1 server, which is exactly one
process on the union of the batches; those that do not are named on a ``not counted`` line):
``ratio vs TorchRec best`` and ``ratio vs Paddle`` (fleet's best over the peer's best),
``fleet PS async: ratio vs TorchRec best`` (target >= 1.2), ``... vs Paddle`` (>= 3) and ``... vs
limit`` (>= 0.75), ``fleet PS async dense-ar: ratio vs TorchRec best`` (>= 1.2) and ``... vs limit``
(>= 0.6), ``fleet tables sharded: ratio vs TorchRec best``, and ``CPU per 1,000 samples, fleet best
vs TorchRec best`` (target <= 1.0). The limit is W2's MLP alone in 2 processes with no table and no
communication (benchmarks/peers/w2_limit.py, run in the same rounds): a bound on the rate, not a
trainer of W2's stream, so it is not checked.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import gate
import job_cpu
from _common import record_result

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "single_to_multi", "train_ctr.py")
PEERS = os.path.join(ROOT, "benchmarks", "peers")
STRATEGIES = {
    "async": 'mode = "ps"\nupdate = "async"\n',
    "async-noprefetch": 'mode = "ps"\nupdate = "async"\n',  # the same, without SparseEmbedding.prefetch
    "sync": 'mode = "ps"\nupdate = "sync"\n',
    "geo": 'mode = "ps"\nupdate = "geo"\nk_steps = 100\n',
    # the server holds only the table; the workers all-reduce the MLP (PERSIA's hybrid)
    "async-dense-ar": 'mode = "ps"\nupdate = "async"\ndense_placement = "allreduce"\n',
    "sync-dense-ar": 'mode = "ps"\nupdate = "sync"\ndense_placement = "allreduce"\n',
    # no server: the table's rows sharded across the 2 workers (all-to-all), the MLP all-reduced
    "sharded": 'mode = "collective"\ntable_placement = "sharded"\n',
}
SERVERLESS = ("sharded",)  # modes that run with no server (whatever --servers says)
REFERENCE = "PS sync, 1 server"  # exactly one process on the union of the workers' batches: the gate's reference
TORCHREC_CONFIGS = "tw-fused,rw-fused,dp"
PADDLE_CONFIGS = "async-1-run,async-1-dataset,async-2-run,async-2-dataset"
_STEP0 = re.compile(r"worker (\d+) step 0 loss ([-+0-9.eEnaif]+)")


class RunFailed(RuntimeError):
    pass


def _run_job(
    cmd: list[str], report: str, timeout: float, cwd: str | None = None
) -> tuple[list[dict], str, dict | None]:
    """Run one job to its end: (each worker's JSON result line, by worker; the job's stdout; its CPU over the
    timed steps, :func:`job_cpu.job_cpu`, None when a worker did not report its own)."""
    try:
        done, sampled = job_cpu.run_job(cmd, timeout, cwd=cwd)
    except subprocess.TimeoutExpired as e:
        raise RunFailed(f"{' '.join(cmd)} timed out after {timeout:.0f} s") from e
    if done.returncode != 0 or not os.path.exists(report):
        raise RunFailed(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    with open(report) as f:
        results = sorted((json.loads(line) for line in f if line.strip()), key=lambda r: r["worker"])
    cpu = job_cpu.job_cpu(results, sampled["series"])
    if cpu is not None:
        cpu["total_cpu_s"] = sampled["total_cpu_s"]
    return results, done.stdout, cpu


def _fleetrun(
    mode: str, servers: int, steps: int, workers: int = 2, timeout: float = 1800
) -> tuple[list[dict], dict | None]:
    """One fleetrun job of train_ctr.py: (each worker's JSON result, with ``first_loss``, its step-0 loss; the
    job's CPU). ``servers`` 0 (or a :data:`SERVERLESS` mode): no server."""
    with tempfile.TemporaryDirectory() as tmp:
        strategy = os.path.join(tmp, f"{mode}.toml")
        with open(strategy, "w") as f:
            f.write(STRATEGIES[mode])
        report = os.path.join(tmp, "report.jsonl")
        cmd = [
            sys.executable,  # fleetrun, from this interpreter: no need for its bin/ on PATH
            "-m",
            "fleet.launch",
            *([] if servers == 0 or mode in SERVERLESS else ["--servers", str(servers)]),
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
            *(["--no-prefetch"] if mode.endswith("-noprefetch") else []),
        ]
        results, stdout, cpu = _run_job(cmd, report, timeout)
    first = {int(w): float(v) for w, v in _STEP0.findall(stdout)}
    for r in results:
        r.setdefault("first_loss", first.get(r["worker"], float("nan")))
    return results, cpu


def run(mode: str, servers: int, steps: int, workers: int = 2) -> tuple[list[dict], dict | None]:
    """fleet's W2 under fleetrun (and its CPU); exits with fleetrun's output when the job fails."""
    try:
        return _fleetrun(mode, servers, steps, workers)
    except RunFailed as e:
        sys.exit(str(e))


def main_fleet_only(args: argparse.Namespace) -> None:
    rows = []
    modes = (args.modes or "async,sync,geo").split(",")
    runs = [(m, int(s)) for s in args.servers.split(",") for m in modes if m not in SERVERLESS]
    runs += [(m, 0) for m in modes if m in SERVERLESS]  # once, with no server
    for mode, servers in runs:
        results, cpu = run(mode, servers, args.steps)
        total = sum(r["samples_per_s"] for r in results)
        losses = " / ".join(f"{r['loss']:.4f}" for r in results)
        per_1k = cpu["cpu_per_1k"] if cpu else float("nan")
        rows.append((mode, servers, total, losses, per_1k))
        print(
            f"{mode:6s} servers={servers}: {total:9.0f} samples/s, CPU {per_1k:.3f} s per 1,000 samples, "
            f"loss at step {args.steps}: {losses}",
            flush=True,
        )
    print(f"\nW2, 2 workers, batch 512/worker, {args.steps} steps (samples/s after 10 warm-up steps)")
    print("| mode  | servers | samples/s (total) | CPU s / 1k samples | loss per worker |")
    print("|-------|---------|-------------------|--------------------|-----------------|")
    for mode, servers, total, losses, per_1k in rows:
        print(f"| {mode:5s} | {servers:7d} | {total:17.0f} | {per_1k:18.3f} | {losses} |")
    for mode, servers, total, losses, per_1k in rows if args.record else ():
        variant = fleet_label(mode, servers)
        record_result(
            "w2_ctr",
            variant=variant,
            figure=f"total samples/s over 2 workers after 10 warm-up steps; loss at step {args.steps} per worker",
            units="samples/s",
            fleet=round(total, 1),
            target=">= 10,000 samples/s with 1 server; loss falls on every worker",
            summary=f"{variant}: {total:,.0f} samples/s; loss at step {args.steps} {losses}",
            headline=mode == "async" and servers == 1,
            details={
                "loss_per_worker": losses,
                "servers": servers,
                "workers": 2,
                "steps": args.steps,
                "cpu_per_1k": per_1k,
            },
        )


# --------------------------------------------------------------------------- --peers


def peer_python(peer: str) -> str:
    """The peer venv's interpreter (benchmarks/peers/setup.sh; FLEET_PEERS_VENVS moves the venvs)."""
    venvs = os.environ.get("FLEET_PEERS_VENVS") or os.path.join(PEERS, ".venvs")
    return os.path.join(venvs, peer, "bin", "python")


def _peer_job(peer: str, script: str, extra: list[str], steps: int, timeout: float) -> tuple[list[dict], dict | None]:
    with tempfile.TemporaryDirectory(prefix=f"w2-{peer}-") as tmp:
        report = os.path.join(tmp, "report.jsonl")
        cmd = [peer_python(peer), os.path.join(PEERS, script), *extra, "--steps", str(steps), "--report", report]
        cmd += ["--timeout", str(timeout)]
        results, _, cpu = _run_job(cmd, report, timeout + 60, cwd=tmp)
        return results, cpu


@dataclass
class Config:
    system: str  # fleet | torchrec | paddle | limit
    name: str
    launch: object  # (steps, timeout) -> (list of worker results, the job's CPU or None)
    samples: list[dict] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.system} {self.name}"

    def median(self) -> float:
        values = [s["samples_per_s"] for s in self.samples]
        return statistics.median(values) if values else float("nan")

    def cpu(self, part: str = "cpu_s") -> float:
        """The job's CPU seconds per 1,000 samples over the timed steps (median over rounds; NaN if unmeasured).

        ``part``: ``cpu_s`` (every process), ``others_cpu_s`` (the processes that are not workers: servers, launchers).
        """
        values = [1000 * s["cpu"][part] / s["cpu"]["timed_samples"] for s in self.samples if s.get("cpu")]
        return statistics.median(values) if values else float("nan")

    def last_losses(self) -> list[float]:
        """The mean over the workers of the loss at the last step (= the loss on the union of their batches), per round."""
        return [statistics.fmean(w["loss"] for w in s["workers"]) for s in self.samples]


def fleet_label(mode: str, servers: int) -> str:
    """``PS async, 1 server``; a serverless mode: ``collective, tables sharded``."""
    if mode in SERVERLESS or servers == 0:
        return "collective, tables sharded" if mode == "sharded" else mode
    return f"PS {mode}, {servers} server{'s' if servers > 1 else ''}"


def fleet_configs(modes: list[str], servers: list[int]) -> list[Config]:
    runs = [(m, s) for s in servers for m in modes if m not in SERVERLESS] + [(m, 0) for m in modes if m in SERVERLESS]
    return [
        Config("fleet", fleet_label(mode, s), lambda st, to, m=mode, s=s: _fleetrun(m, s, st, timeout=to))
        for mode, s in runs
    ]


def limit_config() -> Config:
    """W2's MLP alone in 2 processes (peers/w2_limit.py): the rate distribution at no cost would give."""

    def launch(steps: int, timeout: float) -> list[dict]:
        with tempfile.TemporaryDirectory() as tmp:
            report = os.path.join(tmp, "report.jsonl")
            cmd = [sys.executable, os.path.join(PEERS, "w2_limit.py"), "--steps", str(steps), "--report", report]
            results, _, cpu = _run_job(cmd, report, timeout)
            return results, cpu

    return Config("limit", "MLP alone, 2 processes", launch)


def torchrec_configs(names: list[str]) -> list[Config]:
    return [
        Config(
            "torchrec", name, lambda st, to, n=name: _peer_job("torchrec", "w2_torchrec.py", ["--config", n], st, to)
        )
        for name in names
    ]


def paddle_configs(names: list[str]) -> list[Config]:
    configs = []
    for name in names:
        mode, servers, feed = name.split("-")  # e.g. async-1-run
        extra = ["--mode", mode, "--servers", servers, "--feed", feed]
        label = f"PS {mode}, {servers} server{'s' if int(servers) > 1 else ''}, {feed}"
        configs.append(Config("paddle", label, lambda st, to, e=extra: _peer_job("paddle", "w2_paddle.py", e, st, to)))
    return configs


def interleave(fleet: list[Config], peers: list[Config]) -> list[Config]:
    """fleet, peer, fleet, peer, ...: the longer list's tail at the end."""
    out = []
    for a, b in itertools.zip_longest(fleet, peers):
        out += [c for c in (a, b) if c is not None]
    return out


def loss_fell(sample: dict) -> bool:
    return all(w["loss"] < w["first_loss"] for w in sample["workers"])


def run_peers(args: argparse.Namespace) -> int:
    modes = (args.modes or "async,sync,async-dense-ar,sharded").split(",")
    servers = [int(s) for s in args.servers.split(",")]
    fleet = fleet_configs(modes, servers)
    peer_lists, skipped = [], []
    for peer, names, make, label in (
        ("torchrec", args.torchrec, torchrec_configs, "TorchRec"),
        ("paddle", args.paddle, paddle_configs, "PaddlePaddle"),
    ):
        if not names:
            continue
        if not os.path.exists(peer_python(peer)):
            skipped.append(
                f"{label} skipped: no venv at {os.path.dirname(os.path.dirname(peer_python(peer)))}; "
                f"create it with `{'FLEET_PEERS_VENVS=' + os.environ['FLEET_PEERS_VENVS'] + ' ' if os.environ.get('FLEET_PEERS_VENVS') else ''}"
                f"bash benchmarks/peers/setup.sh {peer}`"
            )
            continue
        peer_lists.append(make(names.split(",")))
    for line in skipped:
        print(line, flush=True)
    # the peers' configurations alternate between the peers too: torchrec, paddle, torchrec, ...
    peers = [c for group in itertools.zip_longest(*peer_lists) for c in group if c is not None]
    if not args.no_limit:
        peers.append(limit_config())
    order = interleave(fleet, peers)
    configs = fleet + peers
    print(
        f"W2 --peers: {len(order)} configurations x {args.rounds} round(s), {args.steps} steps each, "
        f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at the start",
        flush=True,
    )
    for rnd in range(args.rounds):
        for config in order if rnd % 2 == 0 else order[::-1]:
            load_before = os.getloadavg()[0]
            started = time.perf_counter()
            try:
                workers, cpu = config.launch(args.steps, args.timeout)
            except RunFailed as e:
                config.failures.append(str(e))
                print(f"round {rnd + 1}: {config.label}: FAILED ({str(e).splitlines()[0][:200]})", flush=True)
                continue
            load = (load_before + os.getloadavg()[0]) / 2
            sample = {
                "round": rnd + 1,
                "samples_per_s": sum(w["samples_per_s"] for w in workers),
                "cpu": cpu,
                "load": load,
                "wall_s": time.perf_counter() - started,
                "workers": [
                    {k: w.get(k) for k in ("worker", "first_loss", "loss", "samples_per_s", "cpu_s", "timed_samples")}
                    for w in workers
                ],
            }
            config.samples.append(sample)
            losses = " / ".join(f"{w['first_loss']:.3f}->{w['loss']:.3f}" for w in sample["workers"])
            per_1k = f"{cpu['cpu_per_1k']:5.3f}" if cpu else "  n/a"
            print(
                f"round {rnd + 1}: {config.label:42s} {sample['samples_per_s']:8.0f} samples/s  CPU {per_1k} s/1k"
                f"  load {load:4.1f}  loss {losses}",
                flush=True,
            )
    report(args, configs, skipped)
    ran = {c.system for c in configs if c.samples}
    if not ran - {"fleet"}:
        print("no peer ran: nothing to compare with", file=sys.stderr)
        return 1
    return 0 if "fleet" in ran else 1


def figures(configs: list[Config]) -> dict:
    """The checks (:mod:`gate`: against fleet's PS sync with 1 server), the "best" configurations and the ratio lines."""
    ran = {c.label: c for c in configs if c.samples}
    ref = ran.get(f"fleet {REFERENCE}")
    reference = ref.last_losses()[0] if ref else None
    label = f"PS sync ({REFERENCE.removeprefix('PS sync, ')})"
    # the limit trains 8 fixed batches of random rows, not W2's stream: a bound on the rate, checked by nothing
    checks = {n: gate.check(n, c.last_losses(), reference, label) for n, c in ran.items() if c.system != "limit"}
    rates = {n: c.median() for n, c in ran.items()}
    cpus = {n: c.cpu() for n, c in ran.items()}

    def best(system: str, prefix: str = "") -> str | None:
        names = [n for n, c in ran.items() if c.system == system and c.name.startswith(prefix)]
        return names[0] if system == "limit" and names else gate.best(rates, checks, names)

    fleet_best, fleet_async = best("fleet"), best("fleet", "PS async")
    dense_ar, sharded = best("fleet", "PS async-dense-ar"), best("fleet", "collective, tables sharded")
    trec, paddle, limit = best("torchrec"), best("paddle"), best("limit")
    lines, ratios = [], {}
    for key, text, num, den, target in (
        ("fleet_best_vs_torchrec_best", "ratio vs TorchRec best", fleet_best, trec, "none (fleet's best)"),
        ("fleet_best_vs_paddle", "ratio vs Paddle", fleet_best, paddle, "none (fleet's best)"),
        ("async_vs_torchrec_best", "fleet PS async: ratio vs TorchRec best", fleet_async, trec, ">= 1.2"),
        ("async_vs_paddle", "fleet PS async: ratio vs Paddle", fleet_async, paddle, ">= 3"),
        ("async_vs_limit", "fleet PS async: ratio vs limit (the MLP alone in 2 processes)", fleet_async, limit, ">= 0.75"),
        ("async_dense_ar_vs_torchrec_best", "fleet PS async dense-ar: ratio vs TorchRec best", dense_ar, trec, ">= 1.2"),
        ("async_dense_ar_vs_limit", "fleet PS async dense-ar: ratio vs limit", dense_ar, limit, ">= 0.6"),
        ("sharded_vs_torchrec_best", "fleet tables sharded: ratio vs TorchRec best", sharded, trec, "none"),
    ):  # fmt: skip
        missing = (
            "a side did not run, or does not train"
            if reference is not None
            else f"no reference: {REFERENCE} did not run"
        )
        line, ratios[key] = gate.ratio_line(text, num, den, rates, checks, target, missing)
        lines.append(line)
    line, ratios["cpu_fleet_best_vs_torchrec_best"] = gate.cpu_line(cpus, fleet_best, trec)
    lines.append(line)
    return {
        "reference": f"fleet {REFERENCE}",
        "reference_loss": reference,
        "checks": {n: {"loss": c.loss, "trains": c.trains} for n, c in checks.items()},
        "best": {"fleet": fleet_best, "fleet_async": fleet_async, "async_dense_ar": dense_ar, "sharded": sharded,
                 "torchrec": trec, "paddle": paddle, "limit": limit},
        "ratios": ratios,
        "not_counted": [c.note() for c in gate.excluded(checks, checks) if c.name != f"fleet {REFERENCE}"],
        "lines": lines,
    }  # fmt: skip


def _fmt(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}"


def _best_part(fleet_best: Config | None, fleet_async: Config, ratios: dict) -> str:
    """The headline's tail: fleet's best configuration that trains, when it is not the PS async one, and the CPU ratio."""
    part = ""
    if fleet_best is not None and fleet_best is not fleet_async and ratios.get("fleet_best_vs_torchrec_best"):
        part += f"; fleet best ({fleet_best.name}) {ratios['fleet_best_vs_torchrec_best']:.2f} x TorchRec"
    if ratios.get("cpu_fleet_best_vs_torchrec_best"):
        part += f"; CPU per sample {ratios['cpu_fleet_best_vs_torchrec_best']:.2f} x TorchRec's"
    return part


def report(args: argparse.Namespace, configs: list[Config], skipped: list[str]) -> None:
    print(
        f"\nW2, 2 workers, batch 512/worker, {args.steps} steps, {args.rounds} round(s): total samples/s after"
        " 10 warm-up steps (median over rounds; range), the job's CPU per 1,000 samples, load average beside each sample"
    )
    print(
        "| system | configuration | samples/s (median) | range | CPU s / 1k samples (median) | of which not workers |"
        " load | loss per worker (first -> last) | loss fell on every worker |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for c in configs:
        if not c.samples:
            reason = c.failures[0].splitlines()[0][:120] if c.failures else "not run"
            print(f"| {c.system} | {c.name} | failed | | | | | {reason} | |")
            continue
        values = [s["samples_per_s"] for s in c.samples]
        last = c.samples[-1]
        losses = " / ".join(f"{w['first_loss']:.3f} -> {w['loss']:.3f}" for w in last["workers"])
        fell = sum(loss_fell(s) for s in c.samples)
        failed = f" ({len(c.failures)} failed)" if c.failures else ""
        print(
            f"| {c.system} | {c.name} | {c.median():,.0f} | {min(values):,.0f}-{max(values):,.0f}{failed} |"
            f" {c.cpu():.3f} | {c.cpu('others_cpu_s'):.3f} | {statistics.median(s['load'] for s in c.samples):.1f} |"
            f" {losses} |"
            f" {'yes' if fell == len(c.samples) else 'no'} ({fell}/{len(c.samples)} rounds) |"
        )
    found = figures(configs)
    ran = {c.label: c for c in configs if c.samples}
    print()
    for text, key in (
        ("fleet best", "fleet"),
        ("fleet PS async best", "fleet_async"),
        ("TorchRec best", "torchrec"),
        ("Paddle best", "paddle"),
    ):
        name, system = found["best"][key], key.partition("_")[0]
        none = "none that trains" if any(c.system == system for c in ran.values()) else "none ran"
        print(f"{text}: {name + f' ({ran[name].median():,.0f} samples/s)' if name else none}")
    for line in skipped:
        print(line)
    print(f"the check: every configuration in a ratio ends within {gate.TOLERANCE} of {found['reference']}'s loss")
    for line in found["lines"]:
        print(line)
    if found["not_counted"]:
        print("not counted in any ratio: " + "; ".join(found["not_counted"]))
    best = found["best"]
    fleet_async, torchrec_best = ran.get(best["fleet_async"] or ""), ran.get(best["torchrec"] or "")
    paddle_best, fleet_best = ran.get(best["paddle"] or ""), ran.get(best["fleet"] or "")
    ratios = found["ratios"]
    if fleet_async and torchrec_best and getattr(args, "record", True):
        a_med, t_med = fleet_async.median(), torchrec_best.median()
        ratio_t, ratio_p = ratios["async_vs_torchrec_best"], ratios["async_vs_paddle"]
        p_med = paddle_best.median() if paddle_best else float("nan")
        paddle_part = f", {ratio_p:.2f} x Paddle" if ratio_p is not None else ""
        paddle_value = f", Paddle {p_med:,.0f}" if ratio_p is not None else ""
        record_result(
            "w2_peers",
            variant=f"{fleet_async.name} vs TorchRec {torchrec_best.name}" + (" / Paddle" if paddle_best else ""),
            figure=f"median total samples/s over {args.rounds} alternating rounds x {args.steps} steps",
            units="samples/s",
            fleet=round(a_med, 1),
            peer=f"TorchRec {torchrec_best.name}",
            peer_value=round(t_med, 1),
            ratio=round(ratio_t, 4),
            ratio_means="fleet PS async / TorchRec best (samples/s, higher is better); details.ratio_vs_paddle: fleet / Paddle",
            target="async >= 1.2 x TorchRec, >= 3 x Paddle, >= 0.75 x the MLP alone; async dense-ar >= 1.2 x TorchRec, >= 0.6 x the MLP alone",
            summary=f"PS async ({fleet_async.name}): {ratio_t:.2f} x TorchRec{paddle_part} (fleet {a_med:,.0f}, TorchRec"
            f" {t_med:,.0f}{paddle_value} samples/s)" + _best_part(fleet_best, fleet_async, ratios),
            details={
                "ratio_vs_paddle": ratio_p,
                "ratio_vs_limit": ratios["async_vs_limit"],
                "ratios": ratios,
                "checks": found["checks"],
                "paddle": None if paddle_best is None else {"name": paddle_best.name, "samples_per_s": p_med},
                "fleet_best": {"name": fleet_best.name, "samples_per_s": fleet_best.median()} if fleet_best else None,
                "configs": {
                    c.label: {
                        "median": c.median(),
                        "cpu_per_1k": c.cpu(),
                        "rounds": [s["samples_per_s"] for s in c.samples],
                        "loss_fell": all(loss_fell(s) for s in c.samples),
                        "failures": len(c.failures),
                    }
                    for c in configs
                },
            },
        )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(
                {
                    "steps": args.steps,
                    "rounds": args.rounds,
                    "cpu_count": os.cpu_count(),
                    "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "configs": [
                        {
                            "system": c.system,
                            "name": c.name,
                            "median_samples_per_s": c.median(),
                            "median_cpu_per_1k": c.cpu(),
                            "samples": c.samples,
                            "failures": c.failures,
                        }
                        for c in configs
                    ],
                    "ratio_vs_torchrec_best": ratios["fleet_best_vs_torchrec_best"],
                    "ratio_vs_paddle": ratios["fleet_best_vs_paddle"],
                    "async_ratio_vs_torchrec_best": ratios["async_vs_torchrec_best"],
                    "async_ratio_vs_paddle": ratios["async_vs_paddle"],
                    "async_ratio_vs_limit": ratios["async_vs_limit"],
                    "figures": found,
                },
                f,
                indent=1,
            )
        print(f"wrote {args.json}")


def main() -> None:
    parser = argparse.ArgumentParser(description="W2: CTR model on fleet's parameter server, and against its peers")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--modes",
        default=None,
        help="fleet modes (default async,sync,geo; with --peers async,sync,async-dense-ar,sharded; also "
        "sync-dense-ar, async-noprefetch; sharded: collective with the table sharded, no server)",
    )
    parser.add_argument("--servers", default="1,2")
    parser.add_argument("--peers", action="store_true", help="fleet alternately with TorchRec and PaddlePaddle")
    parser.add_argument("--rounds", type=int, default=3, help="--peers: every configuration once per round")
    parser.add_argument("--torchrec", default=TORCHREC_CONFIGS, help="--peers: TorchRec configurations ('' for none)")
    parser.add_argument(
        "--paddle", default=PADDLE_CONFIGS, help="--peers: Paddle configurations MODE-SERVERS-FEED ('' for none)"
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="--peers: seconds per job")
    parser.add_argument(
        "--no-limit", action="store_true", help="--peers: leave out W2's MLP alone (the no-distribution limit)"
    )
    parser.add_argument("--json", default=None, help="--peers: write every sample here")
    parser.add_argument(
        "--no-record", dest="record", action="store_false", help="do not write benchmarks/results/ (--peers)"
    )
    args = parser.parse_args()
    if args.peers:
        sys.exit(run_peers(args))
    main_fleet_only(args)


if __name__ == "__main__":
    main()
