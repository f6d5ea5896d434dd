"""The same script under other launchers: mpirun, a (simulated) Slurm step, Paddle-style variables."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dist_harness import clean_env, free_port

pytestmark = pytest.mark.multiprocess  # every test here starts processes

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "tiny_train.py"


def checksums(output: str) -> list[str]:
    found = re.findall(r"worker (\d) of 2 checksum (-?\d+\.\d+)", output)
    assert sorted(w for w, _ in found) == ["0", "1"], output
    return [c for _, c in found]


def run_per_rank(envs: list[dict[str, str]]) -> str:
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT)], env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for e in envs
    ]
    outputs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=90)
        finally:
            proc.kill()
        assert proc.returncode == 0, out
        outputs.append(out)
    return "".join(outputs)


@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun is not installed (apt-get install openmpi-bin)")
def test_mpirun():
    environ = clean_env(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    done = subprocess.run(
        ["mpirun", "--oversubscribe", "-n", "2", sys.executable, str(SCRIPT)],
        env=environ,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    a, b = checksums(done.stdout)
    assert a == b


@pytest.mark.timeout(120)
def test_simulated_slurm_step():
    port = str(free_port())
    envs = [
        clean_env(
            SLURM_PROCID=str(r),
            SLURM_NTASKS="2",
            SLURM_LOCALID=str(r),
            SLURM_JOB_ID="4242",
            SLURM_STEP_ID="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        for r in range(2)
    ]
    a, b = checksums(run_per_rank(envs))
    assert a == b


@pytest.mark.timeout(120)
def test_paddle_collective_variables():
    endpoints = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    envs = [
        clean_env(
            PADDLE_TRAINER_ID=str(r),
            PADDLE_TRAINERS_NUM="2",
            PADDLE_TRAINER_ENDPOINTS=endpoints,
            TRAINING_ROLE="TRAINER",
        )
        for r in range(2)
    ]
    a, b = checksums(run_per_rank(envs))
    assert a == b


def test_a_user_error_ends_with_one_paragraph_not_a_traceback():
    environ = clean_env(RANK="5", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1234")
    done = subprocess.run([sys.executable, str(SCRIPT)], env=environ, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "RANK=5 must be at least 0 and below WORLD_SIZE=2" in done.stderr
    assert "Traceback" not in done.stderr
