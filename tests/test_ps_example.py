"""The CTR example runs unchanged under fleetrun in parameter-server mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "single_to_multi")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy", ["ps_sync.toml", "ps_geo.toml"])
def test_ctr_example_runs_under_fleetrun_in_ps_mode(tmp_path, strategy: str) -> None:
    report = tmp_path / "report.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "fleet.launch",
        "--servers",
        "1",
        "--workers",
        "2",
        "--strategy",
        os.path.join(EXAMPLE, "strategies", strategy),
        "--log-dir",
        str(tmp_path / "logs"),
        os.path.join(EXAMPLE, "train_ctr.py"),
        "--steps",
        "4",
        "--batch",
        "32",
        "--warmup",
        "1",
        "--report",
        str(report),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=140, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = [json.loads(line) for line in report.read_text().splitlines()]
    assert sorted(r["worker"] for r in results) == [0, 1]
    assert all(0 < r["loss"] < 1.5 for r in results), results
