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
from typing import Any


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


class TimedWindow:
    """A worker's side of the job's CPU figure (``benchmarks/job_cpu.py``): its own CPU over its timed steps.

    :meth:`start` at the first timed step, :meth:`stop` after the last (or leave it to :meth:`fields`);
    :meth:`fields` gives ``pid``, ``window`` (``time.time()`` at both ends: the driver reads the other
    processes' CPU between them), ``cpu_s`` (``time.process_time()``: every thread of this process)
    and ``timed_samples``.
    """

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        self.wall, self.cpu = time.time(), time.process_time()
        self.end: tuple[float, float] | None = None

    def stop(self) -> None:
        self.end = (time.time(), time.process_time())

    def fields(self, timed_samples: int) -> dict[str, Any]:
        wall, cpu = self.end if self.end is not None else (time.time(), time.process_time())
        return {
            "pid": os.getpid(),
            "window": [self.wall, wall],
            "cpu_s": cpu - self.cpu,
            "timed_samples": timed_samples,
        }


def report_result(
    args: argparse.Namespace,
    worker: int,
    losses: list[float],
    elapsed: float,
    window: TimedWindow | None = None,
    **labels: str,
) -> None:
    """Print (and append to ``--report``) a worker's JSON line, as examples/single_to_multi/train_ctr.py does."""
    timed = max(args.steps - args.warmup, 0)
    result = {
        "worker": worker,
        "loss": losses[-1] if losses else float("nan"),
        "first_loss": losses[0] if losses else float("nan"),
        "samples_per_s": timed * args.batch / elapsed,
        **(window.fields(timed * args.batch) if window is not None else {}),
        **labels,
    }
    print(json.dumps(result), flush=True)
    if args.report:
        with open(args.report, "a") as f:
            f.write(json.dumps(result) + "\n")
