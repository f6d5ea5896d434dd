"""Where the time goes: step metrics, straggler rule, report math, progress, injection (unit and under fleetrun)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from dist_harness import run_fleetrun as fleetrun
from fleet.launch import timing as launch_timing
from fleet.runtime import env, inject
from fleet.telemetry import step_report, timing
from fleet.telemetry.progress import progress
from fleet.training.optimizer import WrappedOptimizer

JOB = Path(__file__).parents[1] / "scripts" / "timing_job.py"


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def fresh_recorder(monkeypatch, tmp_path):
    for name in (env.FLEET_INJECT, env.FLEET_LOG_DIR, env.FLEET_RESTART_COUNT, env.FLEET_WORKER_INDEX, env.RANK):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(timing, "_recorder", None)
    yield
    monkeypatch.setattr(timing, "_recorder", None)


# --- worker-side metrics ---------------------------------------------------------------


@pytest.mark.timeout(10)
def test_histogram_percentiles_within_bin_width():
    hist = step_report.LogHistogram()
    for i in range(1, 1001):
        hist.add(i / 1000)  # 1 ms .. 1 s
    assert hist.percentile(50) == pytest.approx(0.5, rel=0.03)
    assert hist.percentile(95) == pytest.approx(0.95, rel=0.03)
    assert step_report.LogHistogram().percentile(50) is None


@pytest.mark.timeout(10)
def test_step_metrics_split_compute_and_comm_and_write_atomically(tmp_path):
    clock = FakeClock()
    m = timing.StepMetrics(tmp_path, rank=3, restarts=2, write_every_s=0.5, clock=clock)
    m.set_batch_size(16)
    m.end_step()  # first boundary only starts the clock
    for _ in range(10):
        clock.now += 0.100
        m.add_comm(0.030)
        m.end_step(micro_batches=2)
    m.add_dropped(2)
    assert m.steps == 10 and m.samples == 320
    assert m.total["compute"] == pytest.approx(0.7) and m.total["comm"] == pytest.approx(0.3)
    path = tmp_path / "metrics" / "worker-3.json"
    assert path.exists()  # written at the first boundary 0.5 s after the first
    m.write(final=True)
    record = json.loads(path.read_text())
    assert record["rank"] == 3 and record["final"] and record["restarts"] == 2 and record["dropped_stale"] == 2
    assert record["window"]["steps"] == 10 and record["window"]["compute_p50"] == pytest.approx(0.07)
    assert record["run"]["step_p50"] == pytest.approx(0.1, rel=0.03)
    assert not list(path.parent.glob(".*tmp"))
    row = step_report.worker_row(record)
    assert row["comm_compute_ratio"] == pytest.approx(0.3 / 0.7)
    assert row["samples_per_s"] == pytest.approx(320.0)
    with pytest.raises(ValueError, match="set_batch_size"):
        m.set_batch_size(0)
    m.set_batch_size(99, inferred=True)  # an inferred size never overrides an explicit one
    assert m.batch_size == 16


@pytest.mark.timeout(10)
def test_listeners_hear_every_step_boundary_until_they_unsubscribe():
    clock = FakeClock()
    m = timing.StepMetrics(clock=clock)
    heard: list = []
    m.subscribe(heard.append)
    m.end_step()  # the first boundary starts the clock: no step to tell of
    clock.now += 0.5
    m.add_comm(0.2)
    m.end_step()
    m.unsubscribe(heard.append)
    clock.now += 0.5
    m.end_step()
    assert heard[0] is None and heard[1] == pytest.approx((0.5, 0.3, 0.2)) and len(heard) == 2
    assert "end_step" not in vars(m)  # listened to, not patched
    assert m.steps == 2


@pytest.mark.timeout(30)
def test_wrapped_optimizer_times_steps_and_injects_delay(fresh_recorder, monkeypatch):
    monkeypatch.setenv(env.FLEET_INJECT, json.dumps({"ranks": [0], "delay": {"mu": -5.0, "sigma": 0.0}}))
    param = torch.nn.Parameter(torch.zeros(2))
    opt = WrappedOptimizer(torch.optim.SGD([param], lr=0.1))
    for _ in range(4):
        param.grad = torch.ones(2)
        opt.step()
    assert opt.metrics.steps == 3  # four boundaries, three timed steps
    assert opt.metrics.total["compute"] >= 3 * 0.9 * 0.0067  # exp(-5) s injected each step


# --- straggler rule -------------------------------------------------------------------------


def _record(rank: int, compute_p50: float, steps: int = 20) -> dict:
    return {"rank": rank, "window": {"steps": steps, "compute_p50": compute_p50}}


@pytest.mark.timeout(10)
def test_find_stragglers_compares_with_the_others_median():
    assert step_report.find_stragglers({0: 0.010, 1: 0.011, 2: 0.040, 3: 0.009}) == {2: (0.040, 0.010)}
    assert step_report.find_stragglers({0: 0.010, 1: 0.014}) == {}  # 1.4x is not well above
    assert step_report.find_stragglers({0: 0.0001, 1: 0.0004}) == {}  # 4x but 0.3 ms: noise
    assert step_report.find_stragglers({0: 0.5}) == {}


@pytest.mark.timeout(10)
def test_tracker_needs_consecutive_checks_and_reports_once_per_episode():
    tracker = step_report.StragglerTracker()
    slow = {0: _record(0, 0.01), 1: _record(1, 0.05)}
    assert tracker.update(slow) == {}
    assert set(tracker.update(slow)) == {1}
    assert tracker.update(slow) == {}  # already reported
    assert tracker.update({0: _record(0, 0.01), 1: _record(1, 0.01)}) == {}  # recovered
    assert tracker.update(slow) == {} and set(tracker.update(slow)) == {1}
    young = {0: _record(0, 0.01), 1: _record(1, 0.05, steps=2)}
    fresh = step_report.StragglerTracker()
    assert fresh.update(young) == {} and fresh.update(young) == {}


# --- report math ------------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_speedup_condition():
    ok = step_report.speedup_condition(t_sync=0.4, t_comp=1.0, workers=2)
    assert ok["holds"] is True and ok["bound_s"] == pytest.approx(0.5) and ok["verdict"].startswith("holds")
    bad = step_report.speedup_condition(t_sync=0.8, t_comp=1.0, workers=4)
    assert bad["holds"] is False and bad["bound_s"] == pytest.approx(0.75) and bad["verdict"].startswith("fails")
    assert step_report.speedup_condition(0.0, 1.0, 1)["holds"] is None


@pytest.mark.timeout(10)
def test_build_report_and_table(tmp_path):
    records = {}
    for rank, comm in enumerate([0.3, 0.1]):
        m = timing.StepMetrics(tmp_path, rank=rank, clock=(clock := FakeClock()))
        m.set_batch_size(10)
        m.end_step()
        for _ in range(10):
            clock.now += 0.1
            m.add_comm(comm / 10)
            m.end_step()
        m.write(final=True)
    records = step_report.read_records(tmp_path)
    report = step_report.build_report(records, restarts={1: 2}, stragglers={1})
    assert [w["rank"] for w in report["workers"]] == [0, 1] and report["workers"][1]["restarts"] == 2
    assert report["total_samples_per_s"] == pytest.approx(200.0)
    condition = report["speedup_condition"]
    assert condition["t_sync_s"] == pytest.approx(0.02) and condition["t_comp_s"] == pytest.approx(0.08)
    assert condition["holds"] is True  # 0.02 < 1/2 x 0.08
    result = launch_timing.final_report(tmp_path, {1: 2}, {1})
    assert result is not None
    assert json.loads((tmp_path / "report.json").read_text())["stragglers"] == [1]


@pytest.mark.timeout(10)
def test_report_at_exit_without_fleetrun(fresh_recorder, tmp_path, capsys):
    clock = FakeClock()
    m = timing.StepMetrics(tmp_path, rank=0, clock=clock)
    m.end_step()
    clock.now += 0.1
    m.end_step()
    m.write(final=True)
    assert step_report.report_at_exit(m, 0, 1, wait_s=0.0) == tmp_path / "report.json"
    assert json.loads((tmp_path / "report.json").read_text())["speedup_condition"]["holds"] is None
    assert "where the time went" in capsys.readouterr().out


# --- progress -----------------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_progress_only_on_the_first_worker(fresh_recorder, monkeypatch):
    out = io.StringIO()
    monkeypatch.setenv(env.FLEET_WORKER_INDEX, "1")
    monkeypatch.setenv(env.FLEET_WORKER_NUM, "2")
    items = [1, 2, 3]
    assert progress(items, description="train", stream=out) is items  # untouched, silent
    assert out.getvalue() == ""
    monkeypatch.setenv(env.FLEET_WORKER_INDEX, "0")
    assert list(progress(items, description="train", every_s=0.0, stream=out)) == items
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("train: 1/3 (33%)") and lines[-1].startswith("train: 3/3 (100%)")


# --- injection ------------------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_injection_spec_errors_name_the_variable_and_value():
    with pytest.raises(inject.InjectionError, match=r"FLEET_INJECT=.*delay.sigma = -1"):
        inject.parse('{"ranks": [1], "delay": {"mu": 0, "sigma": -1}}')
    with pytest.raises(inject.InjectionError, match="FLEET_INJECT=.*not JSON"):
        inject.parse("{ranks")
    with pytest.raises(inject.InjectionError, match="give delay"):
        inject.parse('{"ranks": [1]}')
    from fleet.strategy import DistributedStrategy, StrategyError

    with pytest.raises(StrategyError, match=r"inject.crash_at_step = 0"):
        DistributedStrategy(inject={"ranks": [0], "crash_at_step": 0})


@pytest.mark.timeout(10)
def test_injector_is_seeded_per_rank_and_only_on_chosen_ranks():
    spec = inject.InjectionSpec(ranks=[1, 2], delay={"mu": -1.0, "sigma": 0.5}, crash_at_step=3)
    draws = [inject.Injector(spec, 1).next_delay() for _ in range(2)]
    assert draws[0] == draws[1] > 0
    assert inject.Injector(spec, 2).next_delay() != draws[0]
    idle = inject.Injector(spec, 0)
    assert not idle.active and idle.next_delay() == 0.0
    assert inject.Injector(spec, 1, restarts=1).crash_at is None  # a restarted worker does not crash again
    reader = env.EnvReader({env.FLEET_INJECT: '{"ranks": [0], "crash_at_step": 2}'})
    strategy_spec = inject.InjectionSpec(ranks=[0], delay={"mu": -3.0})
    chosen = inject.for_process(type("S", (), {"inject": strategy_spec})(), 0, reader)
    assert chosen.crash_at == 2 and chosen.delay is None  # FLEET_INJECT wins


# --- under fleetrun -------------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_fleetrun_reports_injected_straggler_and_writes_report(tmp_path):
    delay = {"ranks": [1], "delay": {"mu": -3.0, "sigma": 0.1}}  # about 50 ms per step on worker 1
    r = fleetrun(
        "--workers",
        2,
        "--log-dir",
        tmp_path / "logs",
        JOB,
        120,
        "--progress",
        cwd=tmp_path,
        extra_env={env.FLEET_INJECT: json.dumps(delay)},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[fleetrun] straggler: worker 1 " in r.stdout, r.stdout
    assert "straggler: worker 0" not in r.stdout
    assert "[worker 0] train: 120/120 (100%)" in r.stdout and "[worker 1] train:" not in r.stdout
    report = json.loads((tmp_path / "logs" / "report.json").read_text())
    assert [w["rank"] for w in report["workers"]] == [0, 1] and report["stragglers"] == [1]
    slow, fast = report["workers"][1], report["workers"][0]
    for key in (
        "step_p50_s",
        "step_p95_s",
        "compute_s_per_step",
        "comm_s_per_step",
        "comm_compute_ratio",
        "samples_per_s",
        "dropped_stale",
        "restarts",
    ):
        assert key in slow, key
    assert slow["compute_s_per_step"] > 0.03 and fast["comm_s_per_step"] > 0.03  # worker 0 waits for worker 1
    assert slow["samples_per_s"] > 0 and slow["steps"] == 119
    assert report["speedup_condition"]["holds"] is False and "speedup condition" in r.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_fleetrun_injected_crash_names_the_worker(tmp_path):
    strategy = tmp_path / "crash.toml"
    strategy.write_text('mode = "collective"\n\n[inject]\nranks = [1]\ncrash_at_step = 3\nexit_code = 7\n')
    r = fleetrun(
        "--workers", 2, "--strategy", strategy, "--log-dir", tmp_path / "logs", JOB, 200, cwd=tmp_path, extra_env={}
    )
    assert r.returncode == 7, r.stdout + r.stderr
    assert "worker 1 failed (exit status 7)" in r.stdout
    assert "fleet.runtime.inject: worker 1 crashes at step 3" in r.stdout


def test_the_report_table_reads_at_80_columns():
    """A log file or a CI console is 80 columns wide: no header or number may be cut."""
    import io

    from rich.console import Console

    rows = [
        {
            "rank": r,
            "steps": 12345,
            "step_s_per_step": 0.1375,
            "step_p50_s": 0.1375,
            "step_p95_s": 0.3005,
            "compute_s_per_step": 0.1002,
            "comm_s_per_step": 0.0373,
            "comm_compute_ratio": 0.37,
            "samples_per_s": 13512.0,
            "dropped_stale": 124,
            "restarts": 2,
        }
        for r in range(2)
    ]
    condition = step_report.speedup_condition(0.0373, 0.1002, 2)
    report = {"workers": rows, "total_samples_per_s": 27024.0, "stragglers": [1], "speedup_condition": condition}
    out = io.StringIO()
    Console(file=out, width=80, no_color=True).print(step_report.report_table(report))
    text = out.getvalue()
    assert "…" not in text, text
    assert max(len(line) for line in text.splitlines()) <= 80, text
    header = next(line for line in text.splitlines() if line.lstrip().startswith("worker"))
    for name in ("steps", "step", "compute", "comm", "p95", "samp/s", "drop", "rst"):
        assert name in header.split(), header
    # the three means add up: 100.2 + 37.3 = 137.5
    assert "137.5" in text and "100.2" in text and "37.3" in text and "300.5" in text and "13,512" in text
    assert "1 slow" in text and "step = compute + comm" in text
