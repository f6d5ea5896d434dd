"""W2: CTR model on the parameter server (see benchmarks/README.md): samples/s and loss at 300 steps.

    python benchmarks/w2_ctr.py [--steps 300] [--modes async,sync,geo] [--servers 1,2]
    python benchmarks/w2_ctr.py --peers [--rounds 3] [--steps 300] [--json FILE]

Each fleet configuration is one ``fleetrun --servers S --workers 2 --strategy ...`` run of
examples/single_to_multi/train_ctr.py (the W2 model: 26 slots of uniform ids in
[0, 1e6), one shared SparseEmbedding of dim 16, 13 dense features, MLP 400-400-400-1,
BCE, SGD lr 0.1, batch 512 per worker). Figure: total samples/s over both workers
after 10 warm-up steps, and each worker's loss at the last step.

``--peers``: fleet's PS async and sync with 1 and 2 servers, and PS async with the dense layers
all-reduced among the workers (``async-dense-ar``: ``dense_placement="allreduce"``; ``--modes``/``--servers`` narrow
them), alternately with TorchRec's configurations (benchmarks/peers/w2_torchrec.py) and
PaddlePaddle's Fleet parameter server (benchmarks/peers/w2_paddle.py) on the same workload, each
peer from its own venv (``bash benchmarks/peers/setup.sh``; a missing one is skipped with a note).
Every round runs every configuration once, fleet's and the peers' interleaved (the order reversed
on odd rounds), so load drift hits them alike; the load average is recorded beside each sample.
Printed: a table (median samples/s over rounds, the range, the load, each worker's first and
last loss, whether the loss fell on every worker), then ``ratio vs TorchRec best: X`` and
``ratio vs Paddle: Y`` (fleet's best PS configuration over the peer's best, by median), and the
same ratios for fleet's PS async alone (targets: >= 1.2 x TorchRec's best, >= 3 x Paddle), and
``ratio vs limit: Z``: fleet's PS async over W2's MLP alone in 2 processes with no table and no
communication (benchmarks/peers/w2_limit.py, run in the same rounds; target >= 0.75).
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
}
TORCHREC_CONFIGS = "tw-fused,rw-fused,dp"
PADDLE_CONFIGS = "async-1-run,async-1-dataset,async-2-run,async-2-dataset"
_STEP0 = re.compile(r"worker (\d+) step 0 loss ([-+0-9.eEnaif]+)")


class RunFailed(RuntimeError):
    pass


def _run_job(cmd: list[str], report: str, timeout: float, cwd: str | None = None) -> tuple[list[dict], str]:
    """Run one job to its end: (each worker's JSON result line, by worker; the job's stdout)."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    except subprocess.TimeoutExpired as e:
        raise RunFailed(f"{' '.join(cmd)} timed out after {timeout:.0f} s") from e
    if done.returncode != 0 or not os.path.exists(report):
        raise RunFailed(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    with open(report) as f:
        return sorted((json.loads(line) for line in f if line.strip()), key=lambda r: r["worker"]), done.stdout


def _fleetrun(mode: str, servers: int, steps: int, workers: int = 2, timeout: float = 1800) -> list[dict]:
    """One fleetrun job of train_ctr.py: each worker's JSON result, with ``first_loss`` (its step-0 loss)."""
    with tempfile.TemporaryDirectory() as tmp:
        strategy = os.path.join(tmp, f"{mode}.toml")
        with open(strategy, "w") as f:
            f.write(STRATEGIES[mode])
        report = os.path.join(tmp, "report.jsonl")
        cmd = [
            sys.executable,  # fleetrun, from this interpreter: no need for its bin/ on PATH
            "-m",
            "fleet.launch",
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
            *(["--no-prefetch"] if mode.endswith("-noprefetch") else []),
        ]
        results, stdout = _run_job(cmd, report, timeout)
    first = {int(w): float(v) for w, v in _STEP0.findall(stdout)}
    for r in results:
        r.setdefault("first_loss", first.get(r["worker"], float("nan")))
    return results


def run(mode: str, servers: int, steps: int, workers: int = 2) -> list[dict]:
    """fleet's W2 under fleetrun; exits with fleetrun's output when the job fails."""
    try:
        return _fleetrun(mode, servers, steps, workers)
    except RunFailed as e:
        sys.exit(str(e))


def main_fleet_only(args: argparse.Namespace) -> None:
    rows = []
    for servers in (int(s) for s in args.servers.split(",")):
        for mode in (args.modes or "async,sync,geo").split(","):
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
    for mode, servers, total, losses in rows:
        variant = f"PS {mode}, {servers} server{'s' if servers > 1 else ''}"
        record_result(
            "w2_ctr",
            variant=variant,
            figure=f"total samples/s over 2 workers after 10 warm-up steps; loss at step {args.steps} per worker",
            units="samples/s",
            fleet=round(total, 1),
            target=">= 10,000 samples/s with 1 server; loss falls on every worker",
            summary=f"{variant}: {total:,.0f} samples/s; loss at step {args.steps} {losses}",
            headline=mode == "async" and servers == 1,
            details={"loss_per_worker": losses, "servers": servers, "workers": 2, "steps": args.steps},
        )


# --------------------------------------------------------------------------- --peers


def peer_python(peer: str) -> str:
    """The peer venv's interpreter (benchmarks/peers/setup.sh; FLEET_PEERS_VENVS moves the venvs)."""
    venvs = os.environ.get("FLEET_PEERS_VENVS") or os.path.join(PEERS, ".venvs")
    return os.path.join(venvs, peer, "bin", "python")


def _peer_job(peer: str, script: str, extra: list[str], steps: int, timeout: float) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix=f"w2-{peer}-") as tmp:
        report = os.path.join(tmp, "report.jsonl")
        cmd = [peer_python(peer), os.path.join(PEERS, script), *extra, "--steps", str(steps), "--report", report]
        cmd += ["--timeout", str(timeout)]
        return _run_job(cmd, report, timeout + 60, cwd=tmp)[0]


@dataclass
class Config:
    system: str  # fleet | torchrec | paddle | limit
    name: str
    launch: object  # (steps, timeout) -> list of worker results
    samples: list[dict] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.system} {self.name}"

    def median(self) -> float:
        values = [s["samples_per_s"] for s in self.samples]
        return statistics.median(values) if values else float("nan")


def fleet_configs(modes: list[str], servers: list[int]) -> list[Config]:
    return [
        Config(
            "fleet",
            f"PS {mode}, {s} server{'s' if s > 1 else ''}",
            lambda st, to, m=mode, s=s: _fleetrun(m, s, st, timeout=to),
        )
        for s in servers
        for mode in modes
    ]


def limit_config() -> Config:
    """W2's MLP alone in 2 processes (peers/w2_limit.py): the rate distribution at no cost would give."""

    def launch(steps: int, timeout: float) -> list[dict]:
        with tempfile.TemporaryDirectory() as tmp:
            report = os.path.join(tmp, "report.jsonl")
            cmd = [sys.executable, os.path.join(PEERS, "w2_limit.py"), "--steps", str(steps), "--report", report]
            return _run_job(cmd, report, timeout)[0]

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
    modes = (args.modes or "async,sync,async-dense-ar").split(",")
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
                workers = config.launch(args.steps, args.timeout)
            except RunFailed as e:
                config.failures.append(str(e))
                print(f"round {rnd + 1}: {config.label}: FAILED ({str(e).splitlines()[0][:200]})", flush=True)
                continue
            load = (load_before + os.getloadavg()[0]) / 2
            sample = {
                "round": rnd + 1,
                "samples_per_s": sum(w["samples_per_s"] for w in workers),
                "load": load,
                "wall_s": time.perf_counter() - started,
                "workers": [{k: w.get(k) for k in ("worker", "first_loss", "loss", "samples_per_s")} for w in workers],
            }
            config.samples.append(sample)
            losses = " / ".join(f"{w['first_loss']:.3f}->{w['loss']:.3f}" for w in sample["workers"])
            print(
                f"round {rnd + 1}: {config.label:42s} {sample['samples_per_s']:8.0f} samples/s"
                f"  load {load:4.1f}  loss {losses}",
                flush=True,
            )
    report(args, configs, skipped)
    ran = {c.system for c in configs if c.samples}
    if not ran - {"fleet"}:
        print("no peer ran: nothing to compare with", file=sys.stderr)
        return 1
    return 0 if "fleet" in ran else 1


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b == b and b > 0 and a == a else "n/a"


def report(args: argparse.Namespace, configs: list[Config], skipped: list[str]) -> None:
    print(
        f"\nW2, 2 workers, batch 512/worker, {args.steps} steps, {args.rounds} round(s): total samples/s after"
        " 10 warm-up steps (median over rounds; range), load average beside each sample"
    )
    print(
        "| system | configuration | samples/s (median) | range | load | loss per worker (first -> last) | loss fell on every worker |"
    )
    print("|---|---|---|---|---|---|---|")
    for c in configs:
        if not c.samples:
            reason = c.failures[0].splitlines()[0][:120] if c.failures else "not run"
            print(f"| {c.system} | {c.name} | failed | | | {reason} | |")
            continue
        values = [s["samples_per_s"] for s in c.samples]
        last = c.samples[-1]
        losses = " / ".join(f"{w['first_loss']:.3f} -> {w['loss']:.3f}" for w in last["workers"])
        fell = sum(loss_fell(s) for s in c.samples)
        failed = f" ({len(c.failures)} failed)" if c.failures else ""
        print(
            f"| {c.system} | {c.name} | {c.median():,.0f} | {min(values):,.0f}-{max(values):,.0f}{failed} |"
            f" {statistics.median(s['load'] for s in c.samples):.1f} | {losses} |"
            f" {'yes' if fell == len(c.samples) else 'no'} ({fell}/{len(c.samples)} rounds) |"
        )

    def best(system: str, prefix: str = "") -> Config | None:
        ran = [c for c in configs if c.system == system and c.samples and c.name.startswith(prefix)]
        return max(ran, key=Config.median) if ran else None

    fleet_best, fleet_async = best("fleet"), best("fleet", "PS async")
    torchrec_best, paddle_best, limit = best("torchrec"), best("paddle"), best("limit")
    l_med = limit.median() if limit else float("nan")
    f_med = fleet_best.median() if fleet_best else float("nan")
    a_med = fleet_async.median() if fleet_async else float("nan")
    t_med = torchrec_best.median() if torchrec_best else float("nan")
    p_med = paddle_best.median() if paddle_best else float("nan")
    print()
    for label, c in (
        ("fleet best", fleet_best),
        ("fleet PS async best", fleet_async),
        ("TorchRec best", torchrec_best),
        ("Paddle best", paddle_best),
    ):
        print(f"{label}: {c.label + f' ({c.median():,.0f} samples/s)' if c else 'none ran'}")
    for line in skipped:
        print(line)
    print(f"ratio vs TorchRec best: {_ratio(f_med, t_med)}")
    print(f"ratio vs Paddle: {_ratio(f_med, p_med)}")
    print(
        f"fleet PS async: ratio vs TorchRec best: {_ratio(a_med, t_med)} (target >= 1.2);"
        f" ratio vs Paddle: {_ratio(a_med, p_med)} (target >= 3)"
    )
    print(f"ratio vs limit: {_ratio(a_med, l_med)} (fleet PS async over the MLP alone in 2 processes; target >= 0.75)")
    if fleet_async and torchrec_best:
        ratio_t, ratio_p = a_med / t_med, (a_med / p_med if p_med > 0 else None)
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
            target="async >= 1.2 x TorchRec, >= 3 x Paddle, >= 0.75 x the MLP alone",
            summary=f"{ratio_t:.2f} x TorchRec{paddle_part} (fleet {a_med:,.0f}, TorchRec {t_med:,.0f}{paddle_value} samples/s)",
            details={
                "ratio_vs_paddle": ratio_p,
                "ratio_vs_limit": a_med / l_med if l_med > 0 else None,
                "paddle": None if paddle_best is None else {"name": paddle_best.name, "samples_per_s": p_med},
                "fleet_best": {"name": fleet_best.name, "samples_per_s": f_med} if fleet_best else None,
                "configs": {
                    c.label: {
                        "median": c.median(),
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
                            "samples": c.samples,
                            "failures": c.failures,
                        }
                        for c in configs
                    ],
                    "ratio_vs_torchrec_best": f_med / t_med if t_med > 0 else None,
                    "ratio_vs_paddle": f_med / p_med if p_med > 0 else None,
                    "async_ratio_vs_torchrec_best": a_med / t_med if t_med > 0 else None,
                    "async_ratio_vs_paddle": a_med / p_med if p_med > 0 else None,
                    "async_ratio_vs_limit": a_med / l_med if l_med > 0 else None,
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
        help="fleet PS modes (default async,sync,geo; with --peers async,sync,async-dense-ar; also "
        "sync-dense-ar, async-noprefetch)",
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
    args = parser.parse_args()
    if args.peers:
        sys.exit(run_peers(args))
    main_fleet_only(args)


if __name__ == "__main__":
    main()
