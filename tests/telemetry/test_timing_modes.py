"""fleetrun's timing report is honest beyond the collective mode's step: sharding counts FSDP2's gathers and
reduce-scatters as communication, and a script that never calls step() is timed per backward pass (issue 27)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dist_harness import run_fleetrun as fleetrun
from fleet.runtime import env
from fleet.telemetry import timing

JOB = Path(__file__).parents[1] / "scripts" / "timing_modes_job.py"


def _report(tmp_path: Path, how: str, steps: int, inject: dict | None = None) -> tuple[dict, str]:
    logs = tmp_path / how
    extra = {env.FLEET_INJECT: json.dumps(inject)} if inject else {}
    r = fleetrun("--workers", 2, "--log-dir", logs, JOB, steps, how, cwd=tmp_path, extra_env=extra, timeout=90)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads((logs / "report.json").read_text()), r.stdout


@pytest.mark.slow  # tens of seconds: the slow set (docs/development.md) keeps the README's suite under 10 minutes
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_sharding_counts_its_communication_and_a_script_without_step_is_timed_per_backward(tmp_path):
    # Worker 1 is 50 ms slower per step: worker 0 waits for it inside FSDP2's collectives.
    slow = {"ranks": [1], "delay": {"mu": -3.0, "sigma": 0.1}}
    report, out = _report(tmp_path, "sharding", 30, slow)
    assert report["per"] == "step"
    waiting, slower = report["workers"]
    for row in report["workers"]:
        assert row["steps"] == 29 and row["comm_s_per_step"] > 0, row
        assert row["compute_s_per_step"] + row["comm_s_per_step"] == pytest.approx(row["step_s_per_step"], abs=1e-6)
    assert waiting["comm_s_per_step"] > 0.03, waiting  # the wait for worker 1, seen in the gathers
    assert slower["compute_s_per_step"] > 0.03 and slower["comm_s_per_step"] < slower["compute_s_per_step"], slower
    assert report["speedup_condition"]["holds"] is False, report["speedup_condition"]
    assert "fails: T_sync" in out

    report, out = _report(tmp_path, "by-hand", 25)
    assert report["per"] == "backward", report
    for row in report["workers"]:
        assert row["steps"] == 24 and row["comm_s_per_step"] > 0, row  # the first backward starts the clock
        assert row["compute_s_per_step"] + row["comm_s_per_step"] == pytest.approx(row["step_s_per_step"], abs=1e-6)
        assert row["samples_per_s"] > 0
    assert "timed per backward pass" in out and "never called optimizer.step()" in out


def test_backward_boundaries_count_only_until_a_step_is_timed(tmp_path):
    now = [0.0]
    m = timing.StepMetrics(tmp_path, rank=0, clock=lambda: now[0])
    for _ in range(3):
        now[0] += 0.1
        m.end_backward(comm_s=0.04)
    summary = m.summary()
    assert summary["per"] == "backward" and summary["steps"] == 2
    assert summary["run"]["comm_s_total"] == pytest.approx(0.08) and summary["run"]["step_s_total"] == pytest.approx(
        0.2
    )
    m.end_step()  # a step starts the step clock; from then on the job is timed per step
    now[0] += 0.3
    m.end_backward(comm_s=0.01)
    m.add_comm(0.1)
    m.end_step()
    summary = m.summary()
    assert summary["per"] == "step" and summary["steps"] == 1
    assert summary["run"]["comm_s_total"] == pytest.approx(0.1)
