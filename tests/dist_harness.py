"""Run a function in N fresh worker processes, as fleetrun would start them, over gloo on 127.0.0.1.

Children are forked from a forkserver that has already imported torch, torch._dynamo, fleet's
modules and torch's FSDP2 and checkpoint packages (about 1.3 s a process otherwise, most of a small test),
so a test pays the imports once, and frozen the objects they made (tests/forkserver_freeze.py). Every run has a deadline: a hang fails the test instead of the suite.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import secrets
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(
    [
        "torch",
        # Every torch.optim optimizer's __init__ imports torch._dynamo on first use (torch._compile):
        # about 1 s a process, more than most tests' training.
        "torch._dynamo",
        "torch.distributed.checkpoint",
        "torch.distributed.fsdp",
        "torch.distributed.tensor",
        "fleet",
        "fleet.api",
        "fleet.metrics",
        "fleet.ps.server.loop",
        "fleet.ps.worker.optimizer",
        "fleet.strategies.collective",
        "fleet.strategies.parameter_server",
        "fleet.strategies.sharding",
        # Last: freezes what the imports above made. By package path: the forkserver's sys.path is the
        # interpreter's own (its working directory, the repository root), not this process's.
        "tests.forkserver_freeze",
    ]
)


# Variables of every launcher fleet detects: a test that starts its own launch must not inherit them.
LAUNCHER_PREFIXES = (
    "FLEET_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "OMPI_", "PMI_", "SLURM_", "PADDLE_", "TORCHELASTIC",
)  # fmt: skip
LAUNCHER_NAMES = ("TRAINING_ROLE", "POD_IP", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher's variables, plus ``extra``."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES) and k not in LAUNCHER_NAMES}
    environ.update(extra)
    return environ


def fleetrun_command(*options: str, script: str, args: tuple[str, ...] = ()) -> list[str]:
    """``python -m fleet.launch OPTIONS SCRIPT ARGS`` with this interpreter."""
    return [sys.executable, "-m", "fleet.launch", *options, str(script), *args]


def run_fleetrun(
    *args: object, cwd: Path | str, timeout: float = 60.0, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``python -m fleet.launch ARGS`` to completion, plain (uncoloured, wide) output captured."""
    return subprocess.run(
        [sys.executable, "-m", "fleet.launch", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "NO_COLOR": "1", "COLUMNS": "200", **(extra_env or {})},
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fleetrun_env(rank: int, workers: int, master_port: int, **extra: str) -> dict[str, str]:
    env = {
        "FLEET_ROLE": "worker",
        "FLEET_WORKER_INDEX": str(rank),
        "FLEET_WORKER_NUM": str(workers),
        "FLEET_MASTER": f"127.0.0.1:{master_port}",
        "FLEET_SERVER_NUM": "0",
    }
    env.update(extra)
    return env


def _child(fn, rank, env, args, results):
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)
    try:
        value = fn(rank, *args)
        buffer = io.BytesIO()
        torch.save(value, buffer)  # plain bytes: tensors shared by fd would die with this process
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException as error:  # noqa: BLE001 - reported to the parent with its traceback
        results.put((rank, "error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))


def run_processes(
    fn: Callable[..., Any],
    envs: list[dict[str, str]],
    *args: Any,
    timeout: float = 60.0,
    wait_for: list[int] | None = None,
) -> list[tuple[str, Any]]:
    """Run fn(rank, *args) in one process per env; return [(status, value)] by rank.

    ``wait_for``: the ranks whose result matters (others may die or hang on purpose; they are
    killed once those are in).
    """
    wanted = set(range(len(envs)) if wait_for is None else wait_for)
    results = _CTX.Queue()
    procs = [_CTX.Process(target=_child, args=(fn, rank, env, args, results)) for rank, env in enumerate(envs)]
    for proc in procs:
        proc.start()
    outcome: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while not wanted <= set(outcome):
            if wait_for is None and any(status != "ok" for status, _ in outcome.values()):
                # One failed: its peers would wait for it until their timeout; give them a moment, then stop.
                deadline = min(deadline, time.monotonic() + 5)
            left = deadline - time.monotonic()
            if left <= 0 and any(status != "ok" for status, _ in outcome.values()):
                for r in range(len(procs)):
                    outcome.setdefault(r, ("stopped", "stopped after a peer failed"))
                break
            if left <= 0:
                missing = sorted(set(range(len(procs))) - set(outcome))
                raise AssertionError(f"processes {missing} did not finish within {timeout} s")
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
                outcome[rank] = (status, value)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in outcome and p.exitcode not in (None, 0)]
                dead = [r for r in dead if r in wanted or wait_for is None]
                if dead:
                    time.sleep(0.5)  # its result may still be in the pipe
                    while not results.empty():
                        rank, status, value = results.get()
                        outcome[rank] = (status, value)
                    for r in dead:
                        outcome.setdefault(r, ("died", procs[r].exitcode))
    finally:
        for r, proc in enumerate(procs):
            if r not in wanted:
                proc.kill()
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    for r, proc in enumerate(procs):
        outcome.setdefault(r, ("died", proc.exitcode))
    return [outcome[r] for r in range(len(procs))]


def run_workers(fn: Callable[..., Any], workers: int, *args: Any, timeout: float = 60.0, **extra_env: str) -> list[Any]:
    """fn(rank, *args) on `workers` collective workers; raise with the first worker's error."""
    port = free_port()
    secret = secrets.token_hex(16)
    envs = [fleetrun_env(r, workers, port, FLEET_SECRET=secret, **extra_env) for r in range(workers)]
    outcome = run_processes(fn, envs, *args, timeout=timeout)
    for rank, (status, value) in enumerate(outcome):
        if status != "ok":
            raise AssertionError(f"worker {rank} {status}: {value}")
    import torch

    return [torch.load(io.BytesIO(value), weights_only=False) for _, value in outcome]
