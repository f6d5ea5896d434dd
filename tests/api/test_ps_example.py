"""The CTR example runs unchanged under fleetrun in parameter-server mode."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from dist_harness import clean_env, fleetrun_command

pytestmark = pytest.mark.multiprocess  # every test here starts processes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "single_to_multi")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy", ["ps_sync.toml", "ps_geo.toml"])
def test_ctr_example_runs_under_fleetrun_in_ps_mode(tmp_path, strategy: str) -> None:
    report = tmp_path / "report.jsonl"
    strategy_file = os.path.join(EXAMPLE, "strategies", strategy)
    options = ("--servers", "1", "--workers", "2", "--strategy", strategy_file, "--log-dir", str(tmp_path / "logs"))
    args = ("--steps", "4", "--batch", "32", "--warmup", "1", "--report", str(report))
    cmd = fleetrun_command(*options, script=os.path.join(EXAMPLE, "train_ctr.py"), args=args)
    done = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=140, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = [json.loads(line) for line in report.read_text().splitlines()]
    assert sorted(r["worker"] for r in results) == [0, 1]
    assert all(0 < r["loss"] < 1.5 for r in results), results
