"""Process plumbing shared by the peer drivers (stdlib only: it runs in every peer's own venv).

The drivers start a launcher (torchrun, Paddle's launcher) in a session of its own, read the
workers' JSON result lines, and end the whole session however the run went.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import time


def kill_group(proc: subprocess.Popen, settle_s: float = 0.3) -> None:
    """End the launcher and everything it started (they share its session: ``start_new_session``).

    SIGTERM first; then, whether or not the launcher left, SIGKILL for whatever is still in the
    session (a launcher may exit and leave its children behind).
    """
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            continue
        time.sleep(settle_s)


def read_report(path: str) -> list[dict]:
    """The workers' result lines (JSON, one per worker), by worker; empty when none was written."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return sorted((json.loads(line) for line in f if line.strip()), key=lambda r: r["worker"])


def member_argv(script: str, args: argparse.Namespace, report: str, *options: str) -> list[str]:
    """The command line of one rank of a peer driver: ``--role member``, the run's options, the report."""
    argv = [os.path.abspath(script), "--role", "member", *options]
    argv += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch), "--report", report]
    if args.profile:
        argv += ["--profile", os.path.abspath(args.profile), "--profile-steps", str(args.profile_steps)]
    return argv


def report_result(args: argparse.Namespace, worker: int, losses: list[float], elapsed: float, **labels: str) -> None:
    """Print (and append to ``--report``) a worker's JSON line, as examples/single_to_multi/train_ctr.py does."""
    timed = max(args.steps - args.warmup, 0)
    result = {
        "worker": worker,
        "loss": losses[-1] if losses else float("nan"),
        "first_loss": losses[0] if losses else float("nan"),
        "samples_per_s": timed * args.batch / elapsed,
        **labels,
    }
    print(json.dumps(result), flush=True)
    if args.report:
        with open(args.report, "a") as f:
            f.write(json.dumps(result) + "\n")
