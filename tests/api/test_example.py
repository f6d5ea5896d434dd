"""The main example runs unchanged under python, fleetrun and torchrun."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dist_harness import clean_env, free_port

pytestmark = pytest.mark.multiprocess  # every test here starts processes

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "single_to_multi"


def run(command: list[str], tmp_path: Path) -> str:
    environ = clean_env()
    done = subprocess.run(command, cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=150)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output


def final_losses(output: str) -> list[float]:
    return [float(x) for x in re.findall(r"epoch 2 loss (\d+\.\d+)", output)]


def test_the_fleet_script_differs_from_the_single_one_by_at_most_four_lines():
    single = (EXAMPLE / "train_single.py").read_text().splitlines()
    multi = (EXAMPLE / "train_fleet.py").read_text().splitlines()
    added = [line for line in multi if line not in single]
    removed = [line for line in single if line not in multi]
    assert len(added) <= 4 and not removed, (added, removed)
    assert "import fleet" in added


@pytest.mark.timeout(180)
def test_runs_with_plain_python(tmp_path):
    losses = final_losses(run([sys.executable, str(EXAMPLE / "train_fleet.py")], tmp_path))
    assert len(losses) == 1 and losses[0] < 0.1


@pytest.mark.timeout(180)
def test_runs_with_fleetrun_on_two_workers(tmp_path):
    output = run([sys.executable, "-m", "fleet.launch", "--workers", "2", str(EXAMPLE / "train_fleet.py")], tmp_path)
    assert "[worker 0] epoch 2 loss" in output and "[worker 1] epoch 2 loss" in output
    assert all(loss < 0.2 for loss in final_losses(output))


@pytest.mark.timeout(180)
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH")
def test_runs_with_torchrun_on_two_workers(tmp_path):
    command = ["torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()), str(EXAMPLE / "train_fleet.py")]
    losses = final_losses(run(command, tmp_path))
    assert len(losses) == 2 and all(loss < 0.2 for loss in losses)
