"""The "where the time went" table without fleetrun: worker 0 prints it once at the end of a torchrun or plain
python job, with the gradient reductions per step; FLEET_REPORT=0 turns it off."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from dist_harness import clean_env, free_port

SCRIPT = """
import sys, torch, fleet
fleet.init()
model = fleet.distributed_model(torch.nn.Linear(4, 2))
opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
for step in range(5):
    for micro in range(2):
        model.require_backward_grad_sync = micro == 1
        model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
if "--stop" in sys.argv:
    fleet.stop_worker()
"""


def _run(tmp_path, launcher: list[str], *args: str, **extra: str) -> str:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [*launcher, str(script), *args],
        cwd=tmp_path,
        env=clean_env(OMP_NUM_THREADS="1", COLUMNS="80", NO_COLOR="1", **extra),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("stop", [True, False])  # fleet.stop_worker() at the end, or the script just ends
def test_torchrun_job_prints_the_table_once_with_one_reduction_per_step(tmp_path, stop):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port"]
    out = _run(tmp_path, [*torchrun, str(free_port())], *(["--stop"] if stop else []))
    assert out.count("where the time went") == 1, out
    header = next(line for line in out.splitlines() if line.startswith("worker")).split()
    rows = [[t for t in line.split() if t != "slow"] for line in out.splitlines() if re.match(r"[01] ", line)]
    assert sorted(row[0] for row in rows) == ["0", "1"], out
    for row in rows:
        assert row[header.index("red")] == "1", out  # one gradient reduction per step: the flag skipped the others


@pytest.mark.timeout(150)
def test_plain_python_prints_it_and_the_switch_turns_it_off(tmp_path):
    assert "where the time went" in _run(tmp_path, [sys.executable], "--stop")
    assert "where the time went" not in _run(tmp_path, [sys.executable], FLEET_REPORT="0")
