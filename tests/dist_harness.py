"""Run a function in N fresh worker processes, as fleetrun would start them, over gloo on 127.0.0.1.

Children are forked from a forkserver that has already imported torch, torch._dynamo, fleet's
modules and torch's FSDP2 and checkpoint packages (about 1.3 s a process otherwise, most of a small test),
so a test pays the imports once, and frozen the objects they made (tests/forkserver_freeze.py). Every run has a deadline: a hang fails the test instead of the suite.

Every child's death explains itself: each writes its output to a file of its own, with faulthandler on
(a fatal signal dumps every thread's stack; so does the SIGUSR1 the harness sends a child it is about to
kill at the deadline), and a failed run reports every process -- its error or how it ended (exit status,
signal) and the last lines it wrote -- not only the first failure.
"""

from __future__ import annotations

import faulthandler
import io
import multiprocessing as mp
import os
import queue
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
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


# How many lines of a child's own output (its stderr and stdout, faulthandler's dumps among them) a report keeps.
TAIL_LINES = 120  # a hung child's dump of every thread: enough lines to see them all


def _child(fn, rank, env, args, results, log_path):
    # Everything the child writes, native code's and faulthandler's included, goes to its own file: the
    # forkserver's stdout and stderr are whatever pytest captured when it started (another test's).
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    faulthandler.enable(all_threads=True)  # a fatal signal (SIGSEGV, SIGABRT, SIGBUS...) dumps every thread
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent's "you hung": dump, then be killed
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)
    try:
        value = fn(rank, *args)
        buffer = io.BytesIO()
        torch.save(value, buffer)  # plain bytes: tensors shared by fd would die with this process
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException as error:  # noqa: BLE001 - reported to the parent with its traceback
        # As fleet's excepthook does for a script: the peers that find this process gone name this error.
        from fleet.runtime import last_words

        last_words.say(error)
        results.put((rank, "error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))


def how_it_ended(exitcode: int | None) -> str:
    """A child's end in words: its exit status, or the signal that killed it."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


def _tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def run_processes(
    fn: Callable[..., Any],
    envs: list[dict[str, str]],
    *args: Any,
    timeout: float = 60.0,
    wait_for: list[int] | None = None,
) -> list[tuple[str, Any]]:
    """Run fn(rank, *args) in one process per env; return [(status, value)] by rank.

    ``status``: "ok" (``value``: fn's result, saved by torch.save), "error" (the exception and its
    traceback), "died" (how the process ended) or "stopped" (killed after a peer failed, or at the
    deadline). Every value but "ok"'s ends with the process's end and the last lines it wrote (a
    faulthandler dump after a fatal signal, or after the deadline, of every thread).

    ``wait_for``: the ranks whose result matters (others may die or hang on purpose; they are
    killed once those are in). A rank of ``wait_for`` that has not finished by ``timeout`` raises
    :class:`AssertionError` with every process's report (:func:`describe`).
    """
    wanted = set(range(len(envs)) if wait_for is None else wait_for)
    results = _CTX.Queue()
    logs_dir = Path(tempfile.mkdtemp(prefix="fleet-test-children-"))
    logs = [logs_dir / f"rank-{rank}.log" for rank in range(len(envs))]
    procs = [
        _CTX.Process(target=_child, args=(fn, rank, env, args, results, str(logs[rank])))
        for rank, env in enumerate(envs)
    ]
    for proc in procs:
        proc.start()
    outcome: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    late: list[int] = []
    try:
        while not wanted <= set(outcome):
            if wait_for is None and any(status != "ok" for status, _ in outcome.values()):
                # One failed: its peers would wait for it until their timeout; give them a moment, then stop.
                deadline = min(deadline, time.monotonic() + 5)
            left = deadline - time.monotonic()
            if left <= 0:
                if not any(status != "ok" for status, _ in outcome.values()):
                    late = sorted(wanted - set(outcome))
                break
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
                        outcome.setdefault(r, ("died", ""))
    finally:
        _stop(procs, [r for r in range(len(procs)) if r not in outcome or r not in wanted])
    for r, proc in enumerate(procs):
        outcome.setdefault(r, ("stopped" if proc.exitcode is not None and proc.exitcode < 0 else "died", ""))
        status, value = outcome[r]
        if status != "ok":
            told = [str(value).rstrip()] if value != "" else []
            ended = how_it_ended(proc.exitcode) + ("" if status != "stopped" else " (stopped by the test harness)")
            output = _tail(logs[r])
            told.append(f"[{ended}; its last output lines:]\n{output}" if output else f"[{ended}; it wrote nothing]")
            outcome[r] = (status, "\n".join(told))
    shutil.rmtree(logs_dir, ignore_errors=True)
    ordered = [outcome[r] for r in range(len(procs))]
    if late:
        raise AssertionError(f"processes {late} did not finish within {timeout} s\n\n{describe(ordered)}")
    return ordered


def _stop(procs: list, ranks: list[int]) -> None:
    """End the processes of ``ranks`` that still run: each dumps its threads' stacks first (SIGUSR1,
    faulthandler), so a hang's report shows where it waited; then every process is joined."""
    running = [procs[r] for r in ranks if procs[r].is_alive()]
    for proc in running:
        try:
            os.kill(proc.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    if running:
        time.sleep(0.3)  # faulthandler writes from a signal handler: a moment is enough
    for proc in running:
        proc.kill()
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()


def describe(outcome: list[tuple[str, Any]], names: list[str] | None = None) -> str:
    """Every process's outcome, one block each: ``worker 1 died: exited with status 1; its last output...``."""
    blocks = []
    for rank, (status, value) in enumerate(outcome):
        name = names[rank] if names else f"process {rank}"
        blocks.append(f"{name} {status}" + ("" if status == "ok" else f": {value}"))
    return "\n\n".join(blocks)


def run_workers(fn: Callable[..., Any], workers: int, *args: Any, timeout: float = 60.0, **extra_env: str) -> list[Any]:
    """fn(rank, *args) on `workers` collective workers; raise with the first worker's error."""
    port = free_port()
    secret = secrets.token_hex(16)
    envs = [fleetrun_env(r, workers, port, FLEET_SECRET=secret, **extra_env) for r in range(workers)]
    outcome = run_processes(fn, envs, *args, timeout=timeout)
    if any(status != "ok" for status, _ in outcome):
        names = [f"worker {rank}" for rank in range(workers)]
        raise AssertionError(describe(outcome, names))
    import torch

    return [torch.load(io.BytesIO(value), weights_only=False) for _, value in outcome]
