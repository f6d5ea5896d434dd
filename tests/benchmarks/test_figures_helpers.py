"""The pure helpers behind W2's and W6's figures: the job's CPU per 1,000 samples (benchmarks/job_cpu.py)
and the check that a configuration in a ratio trains (benchmarks/gate.py)."""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))

import gate  # noqa: E402
import job_cpu  # noqa: E402
from peer_procs import TimedWindow  # noqa: E402

SERIES = [(10.0, {7: 1.0, 8: 5.0}), (11.0, {7: 2.0, 8: 5.5}), (12.0, {7: 4.0, 9: 0.2})]


def test_cpu_at_interpolates_between_readings_and_holds_before_and_after() -> None:
    assert job_cpu.cpu_at(SERIES, 7, 10.5) == pytest.approx(1.5)
    assert job_cpu.cpu_at(SERIES, 7, 11.75) == pytest.approx(3.5)
    assert job_cpu.cpu_at(SERIES, 7, 9.0) == 0.0  # before its first reading: it had not started
    assert job_cpu.cpu_at(SERIES, 8, 13.0) == 5.5  # after its last reading: it ended
    assert job_cpu.cpu_at(SERIES, 42, 11.0) == 0.0


def test_job_cpu_adds_the_workers_own_cpu_and_the_other_processes_over_the_workers_windows() -> None:
    workers = [
        {"pid": 8, "cpu_s": 0.4, "timed_samples": 500, "window": [10.5, 11.5]},
        {"pid": 100, "cpu_s": 0.6, "timed_samples": 500, "window": [10.0, 12.0]},
    ]
    out = job_cpu.job_cpu(workers, SERIES)
    # pid 8 is a worker (its own figure counts, not the sampled one); 7 and 9 are others over [10, 12]
    assert out["workers_cpu_s"] == pytest.approx(1.0)
    assert out["others_cpu_s"] == pytest.approx((4.0 - 1.0) + 0.2)
    assert out["cpu_per_1k"] == pytest.approx(1000 * 4.2 / 1000)
    assert out["timed_samples"] == 1000 and out["window_s"] == pytest.approx(2.0)
    alone = job_cpu.job_cpu([{"pid": 1, "cpu_s": 0.3, "timed_samples": 600, "window": [0, 1]}])
    assert alone["cpu_per_1k"] == pytest.approx(0.5) and alone["others_cpu_s"] == 0
    assert job_cpu.job_cpu([{"pid": 1, "samples_per_s": 3.0}]) is None  # a worker that did not measure itself


def test_a_timed_window_counts_this_process_cpu_and_the_sampler_sees_a_busy_child() -> None:
    window = TimedWindow()
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:
        pass
    window.stop()
    fields = window.fields(256)
    assert fields["pid"] == os.getpid() and fields["timed_samples"] == 256
    assert 0.05 <= fields["cpu_s"] < 5 and fields["window"][0] <= fields["window"][1]
    # a job of a launcher and a busy child: the sampler reads both, RUSAGE_CHILDREN counts them in total
    # the child outlives a few re-listings of the job's processes (every TREE_EVERY readings), so a loaded
    # machine that starts it late still shows it to the sampler
    linger_s = 4 * job_cpu.TREE_EVERY * job_cpu.EVERY_S
    child = f"import time\nt = time.process_time() + 0.3\nwhile time.process_time() < t: pass\ntime.sleep({linger_s})"
    busy = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"
    done, sampled = job_cpu.run_job([sys.executable, "-c", busy], timeout=60)
    assert done.returncode == 0 and sampled["total_cpu_s"] >= 0.3
    pids = {pid for _, reading in sampled["series"] for pid in reading}
    assert len(pids) >= 2  # the launcher and its child


def test_a_configuration_trains_within_the_tolerance_of_the_reference_in_every_round() -> None:
    ok = gate.check("fleet-sharded", [0.5251, 0.5252], 0.5252)
    assert ok.trains and ok.note() == "fleet-sharded, loss 0.5251 vs one process 0.5252: trains"
    off = gate.check("fleet-ps-async", [0.5250, 0.6400], 0.5252)  # the worst round decides
    assert off.trains is False and off.loss == 0.64 and "does not train" in off.note()
    assert gate.check("x", [math.nan], 0.5).trains is False
    none = gate.check("x", [0.5], None)
    assert none.trains is None and "unchecked" in none.note()


def test_best_takes_the_fastest_that_trains_and_ratio_lines_show_both_checks() -> None:
    rates = {"a": 100.0, "b": 300.0, "c": 200.0, "t": 250.0}
    checks = {n: gate.check(n, [loss], 0.5) for n, loss in (("a", 0.5), ("b", 0.7), ("c", 0.505), ("t", 0.491))}
    assert gate.best(rates, checks) == "t"
    assert gate.best(rates, checks, ["a", "b", "c"]) == "c"  # b is faster but does not train
    assert gate.best(rates, checks, ["b"]) is None
    assert [c.name for c in gate.excluded(checks, rates)] == ["b"]
    line, r = gate.ratio_line("ratio vs TorchRec best", "c", "t", rates, checks, ">= 1.2")
    assert r == pytest.approx(0.8)
    assert line == (
        "ratio vs TorchRec best: 0.80 (c, loss 0.5050 vs one process 0.5000: trains; "
        "t, loss 0.4910 vs one process 0.5000: trains; target >= 1.2)"
    )
    line, r = gate.ratio_line("ratio vs limit", "c", "limit", {**rates, "limit": 400.0}, checks, ">= 0.6")
    assert r == pytest.approx(0.5) and "limit: a bound" in line
    line, r = gate.ratio_line("ratio vs TorchRec best", None, "t", rates, checks, ">= 1.2", "nothing trains")
    assert r is None and line == "ratio vs TorchRec best: n/a (nothing trains; target >= 1.2)"
    assert gate.ratio(1.0, 0.0) is None and gate.ratio(math.nan, 1.0) is None
