"""Random kills: a worker or a server SIGKILLed at a random moment never hangs the job.

Each run starts a fleetrun job, kills one random process of the chosen role at a random time
and checks that fleetrun either finished correctly or exited non-zero within the strategy's
timeout plus 10 s, and that no checkpoint on disk is half-written. FLEET_KILL_RUNS sets the
number of server kills (worker kills: half as many per mode); the suite runs 6 to stay within
its time budget, ``FLEET_KILL_RUNS=20 pytest tests/launch/test_kill.py`` is the full robustness check.
"""

from __future__ import annotations

import glob
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from dist_harness import clean_env, fleetrun_command

pytestmark = pytest.mark.multiprocess  # every test here starts processes

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "kill_train.py"
RUNS = int(os.environ.get("FLEET_KILL_RUNS", "6"))
TIMEOUT_S = 5.0


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def _role(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            environ = dict(item.split(b"=", 1) for item in handle.read().split(b"\0") if b"=" in item)
    except OSError:
        return None
    return environ.get(b"FLEET_ROLE", b"").decode() or None


def _check_checkpoint(directory: Path) -> None:
    """Whatever is on disk under its final name loads: nothing half-written."""
    for path in directory.rglob("*.pt"):
        torch.load(path, weights_only=True)
    latest = directory / "latest"
    if latest.exists():
        step_dir = directory / latest.read_text().strip()
        if step_dir.name.startswith("save-"):  # save_persistables: worker 0's file and both servers' shards
            assert (step_dir / "worker-0.pt").is_file() and len(list(step_dir.glob("ps-server-*/table-*.pt"))) >= 2
        else:
            assert (step_dir / "state.pt").is_file() and len(list(step_dir.glob("worker-*.pt"))) == 2


def _one_run(tmp: Path, mode: str, victim_role: str, rng: random.Random) -> tuple[int, float, bool]:
    strategy = tmp / "strategy.toml"
    strategy.write_text(f'mode = "{mode}"\ntimeout_s = {TIMEOUT_S}\n' + ('update = "sync"\n' if mode == "ps" else ""))
    servers = ["--servers", "2"] if mode == "ps" else []
    environ = clean_env()
    options = ("--workers", "2", *servers, "--strategy", str(strategy), "--stop-timeout", "2", "--server-grace", "5")
    command = fleetrun_command(
        *options, "--log-dir", str(tmp / "logs"), script=SCRIPT, args=(mode, str(tmp / "checkpoint"), "60")
    )
    output = open(tmp / "fleetrun.out", "w")  # noqa: SIM115 - closed when the job ends
    job = subprocess.Popen(command, env=environ, stdout=output, stderr=subprocess.STDOUT)
    time.sleep(rng.uniform(0.5, 5.0))
    victims: list[int] = []
    started_looking = time.monotonic()
    while not victims and job.poll() is None and time.monotonic() - started_looking < 20:
        victims = [pid for pid in _children(job.pid) if _role(pid) == victim_role]  # started yet?
        time.sleep(0.05)
    killed = bool(victims)
    if victims:
        try:
            os.kill(rng.choice(victims), signal.SIGKILL)
        except ProcessLookupError:  # it finished between being found and being killed
            killed = False
    killed_at = time.monotonic()
    try:
        code = job.wait(timeout=TIMEOUT_S + 10)
    except subprocess.TimeoutExpired:
        job.kill()
        job.wait()
        logs = "\n".join(f"== {p.name}\n{p.read_text()[-1500:]}" for p in sorted((tmp / "logs").glob("*.log")))
        raise AssertionError(
            f"fleetrun still running {TIMEOUT_S + 10} s after a {victim_role} was killed:\n"
            f"{(tmp / 'fleetrun.out').read_text()[-3000:]}\n{logs}"
        ) from None
    finally:
        output.close()
    return code, time.monotonic() - killed_at, killed


_OWNER_IN_NAME = re.compile(r"^fleet-(?:[0-9a-f]{16}|local)-(\d+\.\d+)-")


def _orphaned(paths: set[str]) -> list[str]:
    """The segments whose creator is gone: what the killed job left. A segment whose creator still runs
    belongs to a job beside this test (another xdist worker's test; seen once in a clean-clone run)."""
    from fleet.runtime import job_files

    out = []
    for path in sorted(paths):
        owner = _OWNER_IN_NAME.match(os.path.basename(path))
        if owner is None or not job_files.owner_alive(owner.group(1)):
            out.append(path)
    return out


@pytest.mark.slow  # kills and restarts whole jobs, tens of seconds: run by .ci/run after the main suite
@pytest.mark.timeout(60 + RUNS * 25)
@pytest.mark.parametrize("mode, victim_role", [("collective", "worker"), ("ps", "worker"), ("ps", "server")])
def test_random_kills_end_the_job_in_time_and_leave_checkpoints_whole(tmp_path, mode, victim_role):
    rng = random.Random()
    runs = RUNS if victim_role == "server" else max(1, RUNS // 2)  # worker kills: half collective, half PS
    outcomes = []
    for run in range(runs):
        tmp = tmp_path / f"run{run}"
        tmp.mkdir()
        shared_before = set(glob.glob("/dev/shm/fleet-*"))
        code, seconds, killed = _one_run(tmp, mode, victim_role, rng)
        left = _orphaned(set(glob.glob("/dev/shm/fleet-*")) - shared_before)
        assert not left, f"shared memory left behind by a killed job: {left}"
        outcomes.append((code, round(seconds, 1), killed))
        assert seconds <= TIMEOUT_S + 10, outcomes
        if not killed:
            assert code == 0, outcomes  # nothing to kill any more: the job had finished
        # a killed job exits non-zero, or 0 when the process was already done (a server after its workers)
        checkpoint = tmp / "checkpoint"
        if checkpoint.exists():
            _check_checkpoint(checkpoint)
    assert any(code != 0 for code, _, _ in outcomes), f"no run was actually interrupted: {outcomes}"
