"""Collective restart: a worker killed at a random step, the job restarted by fleetrun from the last
checkpoint, ends with exactly the parameters of an uninterrupted run."""

from __future__ import annotations

import os
import random
import re
import subprocess
from pathlib import Path

import pytest
import torch

import fleet
import fleet.api
from dist_harness import clean_env, fleetrun_command

pytestmark = pytest.mark.multiprocess  # every test here starts processes

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "resumable_train.py"


def fleetrun(tmp: Path, name: str, crash_step: int, victim: int) -> tuple[str, list[str]]:
    environ = clean_env()
    options = ("--workers", "2", "--max-restarts", "1", "--log-dir", str(tmp / f"logs-{name}"))
    command = fleetrun_command(*options, script=SCRIPT, args=(str(tmp / name), str(crash_step), str(victim)))
    done = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=150, cwd=tmp)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output, re.findall(r"worker \d final step 18 checksum (-?\d+\.\d+)", output)


@pytest.mark.slow  # tens of seconds: the slow set (docs/development.md) keeps the README's suite under 10 minutes
@pytest.mark.timeout(240)
def test_killed_worker_restart_resumes_to_the_uninterrupted_result(tmp_path):
    rng = random.Random()
    crash_step, victim = rng.randrange(1, 17), rng.randrange(2)
    _, expected = fleetrun(tmp_path, "straight", -1, 0)
    output, resumed = fleetrun(tmp_path, "killed", crash_step, victim)
    context = f"crash at step {crash_step} on worker {victim}:\n{output[-3000:]}"
    assert "restart 1" in output and f"starts at step {crash_step}" in output, context
    assert len(expected) == 2 and expected[0] == expected[1]
    assert resumed == expected, context


def test_no_checkpoint_yet_returns_none_and_files_are_complete(tmp_path, monkeypatch):
    for name in ("FLEET_ROLE", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    fleet.api._reset_for_tests()
    fleet.init()
    model = torch.nn.Linear(2, 2)
    opt = fleet.distributed_optimizer(torch.optim.Adam(model.parameters()))
    assert fleet.load_checkpoint(str(tmp_path), model, opt) is None
    for step in (1, 2, 3):
        fleet.save_checkpoint(str(tmp_path), model, opt, step, epoch=0, tag="x")
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-000000002", "step-000000003"]
    assert not [p for p in tmp_path.rglob("*.tmp-*")]
    resumed = fleet.load_checkpoint(str(tmp_path), model, opt)
    assert resumed == (3, {"epoch": 0, "tag": "x"})
    fleet.api._reset_for_tests()
