"""fleet.plan: the cost model's maths, the simulation, the calibration fits, and ``fleetrun --plan`` end to end."""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import pytest

from dist_harness import clean_env, run_fleetrun
from fleet.plan import planner
from fleet.plan.calibration import Calibration, Link, fit_link, lognormal_sigma
from fleet.plan.lognormal import LogNormal, monte_carlo_order
from fleet.plan.model import Model, Setup, breaks_at, ring_allreduce_s
from fleet.plan.simulation import Convergence, SimConfig, simulate

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import scaling  # noqa: E402


def _cal(**over) -> Calibration:
    base = dict(
        cores=64,
        t_comp_s=1.0,
        step_sigma=0.0,
        batch=32,
        dense_bytes=0,
        allreduce=Link(latency_s=0.1, bandwidth_Bps=1e9, loopback=False),
        ps=Link(latency_s=0.001, bandwidth_Bps=1e9, loopback=False),
        dense_apply_Bps=1e9,
        sparse_apply_rows_s=1e6,
        sparse_pull_rows_s=1e6,
    )
    base.update(over)
    return Calibration(**base)


# --- order statistics of log-normal step times ---------------------------------------


@pytest.mark.timeout(30)
def test_expected_max_matches_the_closed_form_and_monte_carlo():
    d = LogNormal(math.log(0.05), 0.5)
    # n = 2 has a closed form: 2 E[X] Phi(sigma / sqrt 2).
    closed = 2 * d.mean * 0.5 * (1 + math.erf(d.sigma / 2))
    assert d.expected_max(2) == pytest.approx(closed, rel=1e-6)
    assert d.expected_max(1) == pytest.approx(d.mean, rel=1e-6)
    for n in (4, 16):
        assert d.expected_max(n) == pytest.approx(monte_carlo_order(d, n, n, trials=4000, seed=n), rel=0.03)
    growing = [d.expected_max(n) for n in (2, 8, 64, 1024)]
    assert growing == sorted(growing)


@pytest.mark.timeout(30)
def test_backup_order_statistic_is_the_nth_fastest_of_n_plus_b():
    d = LogNormal(0.0, 0.8)
    n, b = 12, 3
    waited = d.expected_order(n, n + b)  # sync with b backups: the N-th fastest of N + b
    assert waited == pytest.approx(monte_carlo_order(d, n, n + b, trials=4000, seed=1), rel=0.03)
    assert d.expected_order(1, n) < d.expected_order(n - b, n) < waited < d.expected_max(n + b)


def test_lognormal_fits():
    rng = random.Random(0)
    truth = LogNormal(math.log(0.2), 0.3)
    samples = [truth.sample(rng) for _ in range(4000)]
    fitted = LogNormal.fit(samples)
    assert fitted.mu == pytest.approx(truth.mu, abs=0.02) and fitted.sigma == pytest.approx(truth.sigma, rel=0.05)
    assert lognormal_sigma(samples) == pytest.approx(truth.sigma, rel=0.08)
    q = LogNormal.from_quantiles(truth.quantile(0.5), truth.quantile(0.95))
    assert q.mu == pytest.approx(truth.mu) and q.sigma == pytest.approx(truth.sigma)


def test_link_fit_recovers_latency_and_bandwidth():
    latency, bandwidth = 50e-6, 2e9
    points = [(n, 2 * latency + n / bandwidth) for n in (1024, 65536, 2**20, 2**24)]
    lat, bw = fit_link(points, messages=2)
    assert lat == pytest.approx(latency, rel=1e-6) and bw == pytest.approx(bandwidth, rel=1e-6)
    with pytest.raises(ValueError, match="at least 2 sizes"):
        fit_link([(1024, 0.1)])


# --- the model -------------------------------------------------------------------------


def test_ring_allreduce_cost():
    link = Link(latency_s=1e-4, bandwidth_Bps=1e9)
    nbytes = 4e8
    assert ring_allreduce_s(1, nbytes, link) == 0.0
    assert ring_allreduce_s(2, nbytes, link) == pytest.approx(nbytes / 1e9 + 2 * 1e-4)
    r = 1024
    assert ring_allreduce_s(r, nbytes, link) == pytest.approx(2 * (r - 1) / r * nbytes / 1e9 + 2 * (r - 1) * 1e-4)


def test_speedup_condition_breaks_where_the_algebra_says():
    # No gradient bytes, no spread: a collective step is T_comp + (R-1) x latency (the lockstep
    # all-gather), so T_sync < (R-1)/R x T_comp exactly while R < T_comp / latency = 8.
    model = Model(_cal(dense_bytes=0, allreduce=Link(latency_s=0.125, bandwidth_Bps=1e9, loopback=False)))
    preds = [model.predict("collective", Setup(workers=r)) for r in range(1, 17)]
    assert breaks_at(preds, "collective") == 8
    assert all(p.holds for p in preds if 2 <= p.workers < 8)
    at7 = preds[6]
    assert at7.step_s == pytest.approx(1.0 + 6 * 0.125) and at7.speedup == pytest.approx(7 / 1.75)


def test_sync_waits_for_the_slowest_and_backups_for_fewer():
    model = Model(_cal(step_sigma=0.5))
    for r in (4, 64):
        sync = model.predict("ps_sync", Setup(workers=r, servers=r))
        backup = model.predict("ps_backup", Setup(workers=r, servers=r, backup=1))
        dist = LogNormal.with_mean(1.0, 0.5)
        assert sync.parts["wait for the slowest"] == pytest.approx(dist.expected_max(r) - dist.mean)
        assert backup.parts["wait for the slowest"] == pytest.approx(dist.expected_order(r - 1, r) - dist.mean)
        assert backup.step_s < sync.step_s


def test_processes_beyond_the_cores_share_them():
    model = Model(_cal(cores=2, allreduce=Link(latency_s=0.0, bandwidth_Bps=1e12, loopback=True)))
    two = model.predict("collective", Setup(workers=2, workers_per_host=2))
    four = model.predict("collective", Setup(workers=4, workers_per_host=4))
    assert two.t_comp_s == pytest.approx(1.0) and four.t_comp_s == pytest.approx(2.0)
    assert four.speedup == pytest.approx(2.0, rel=1e-3)  # 4 workers on 2 cores: at most 2x


# --- the simulation ---------------------------------------------------------------------


def _sim(**over) -> SimConfig:
    base = dict(workers=4, compute=LogNormal(math.log(0.05), 0.3), push_s=0.002, pull_s=0.002, apply_s=0.001, steps=60)
    base.update(over)
    return SimConfig(**base)


def test_simulation_is_deterministic_for_a_seed():
    a, b = simulate(_sim(seed=7)), simulate(_sim(seed=7))
    assert (a.time_s, a.worker_steps, a.dropped) == (b.time_s, b.worker_steps, b.dropped)
    assert simulate(_sim(seed=8)).time_s != a.time_s
    assert simulate(_sim(mode="async", seed=7)).time_s == simulate(_sim(mode="async", seed=7)).time_s


def test_sync_step_without_spread_is_the_protocols_sum():
    cfg = _sim(compute=LogNormal(math.log(0.05), 0.0), update_s=0.003, steps=10)
    step = 0.05 + 0.002 + 4 * 0.001 + 0.003 + 0.002  # compute, push, 4 pushes in turn, update, pull
    assert simulate(cfg).update_s == pytest.approx(step)


def test_backup_worker_drops_a_persistent_straggler():
    slow = LogNormal(math.log(0.5), 0.1)
    plain = simulate(_sim(straggler_ranks=(3,), straggler_delay=slow))
    backup = simulate(_sim(backup=1, straggler_ranks=(3,), straggler_delay=slow))
    assert backup.gradients_per_update == 3 and backup.dropped >= backup.worker_steps[3] - 1
    assert backup.update_s < 0.5 * plain.update_s
    assert plain.dropped == 0 and plain.gradients_per_update == 4


def test_async_staleness_is_about_the_number_of_other_workers():
    for r in (4, 16):
        result = simulate(_sim(workers=r, mode="async", compute=LogNormal(math.log(0.05), 0.05), apply_s=0.0))
        assert 0.7 * (r - 1) <= result.staleness <= 1.3 * (r - 1)
        conv = Convergence(noise_scale=4.0)
        assert conv.async_updates(result.staleness) > conv.sync_updates(r)


# --- the benchmark's refusal rule and the calibration builder ---------------------------


def test_scaling_refuses_speedups_beyond_the_cores():
    assert scaling.refusal(speedup=1.9, workers=2, cores=2) is None
    assert scaling.refusal(speedup=3.9, workers=4, cores=2) is not None  # the old figure's point
    assert "2 cores" in scaling.refusal(speedup=2.3, workers=4, cores=2)
    assert scaling.refusal(speedup=2.4, workers=2, cores=4) is not None  # never above R either
    assert scaling.refusal(speedup=1.0, workers=1, cores=2) is None


def test_the_probe_counts_new_ids_per_step_and_leaves_its_own_time_out(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import torch

    from fleet.plan.probe import Probe

    probe = Probe(tmp_path / "probe.json", warmup=0, steps=100, seconds=1e9)
    table = SimpleNamespace(embedding_dim=4)
    clock = iter(float(t) for t in range(1000))
    monkeypatch.setattr("fleet.plan.probe.time.perf_counter", lambda: next(clock))  # each hook call: 1 s
    batches = [torch.tensor([[1, 2], [2, 3]]), torch.tensor([[3, 4], [5, 5]]), torch.tensor([[1, 5]])]
    for ids in batches:
        probe.on_lookup(table, ids)
        probe._step(wall=10.0, compute=8.0)
    assert probe.sparse_rows == [3, 3, 2]  # unique ids per step
    assert probe.sparse_new == [3, 2, 0]  # ids no earlier step looked up
    assert probe.compute == [7.0, 7.0, 7.0] and probe.wall == [9.0, 9.0, 9.0]  # the hook's 1 s taken out


def test_build_calibration_from_probe_and_transport_records():
    probe = {
        "compute_s": [0.1, 0.11, 0.09, 0.1, 0.12, 0.1],
        "warmup": 3,
        "dense_bytes": 4096,
        "sparse_rows": [100, 120],
        "sparse_dim": 8,
        "device": "cpu",
        "threads": 1,
        "batch": 16,
        "optimizer": "sgd",
        "load_average": 1.5,
    }
    net = {
        "loopback": True,
        "cores": 2,
        "allreduce": [[1024, 2e-4 + 1024 / 1e9], [2**20, 2e-4 + 2**20 / 1e9]],
        "ps": {"dense_pull": [[1024, 3e-4 + 1024 / 2e9], [2**20, 3e-4 + 2**20 / 2e9]]},
        "apply": {"optimizer": "sgd", "dense_apply_Bps": 5e9, "sparse_apply_rows_s": 5e6, "sparse_pull_rows_s": 8e6},
    }
    cal = planner.build(probe, net, "x.py")
    assert cal.allreduce.latency_s == pytest.approx(1e-4) and cal.ps.latency_s == pytest.approx(3e-4)
    assert cal.sparse_rows == 110 and cal.background == pytest.approx(0.5)
    assert 0.09 < cal.t_comp_s < 0.12
    assert any("loopback" in a for a in cal.assumptions)
    assert not any("set_batch_size" in a for a in cal.assumptions)  # the batch is known
    unknown = planner.build({**probe, "batch": None}, net, "x.py")
    assert any("fleet.telemetry.timing.set_batch_size(n)" in a for a in unknown.assumptions)


# --- fleetrun --plan, end to end ----------------------------------------------------------

SCRIPT = """
import torch
import fleet

fleet.init()
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
fleet.telemetry.timing.set_batch_size(16)
for step in range(100000):  # far more than the calibration needs: the probe stops it
    x = torch.randn(16, 32)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
"""


@pytest.mark.slow  # tens of seconds: run by .ci/run after the main suite (docs/development.md)
@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_fleetrun_plan_end_to_end(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = run_fleetrun(
        "--plan", "--plan-workers", "1,2,4,1024", "--log-dir", tmp_path / "logs", script,
        cwd=tmp_path, timeout=140, extra_env=clean_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "recommended:" in out and "assumptions:" in out
    rows = [line.split()[0] for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert rows == ["1", "2", "4", "1024"]
    cal = Calibration.load(tmp_path / "logs" / "calibration.json")
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    assert cal.dense_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    assert cal.batch == 16 and cal.steps_timed >= 2 and cal.t_comp_s > 0 and cal.ps is not None
    probe = json.loads((tmp_path / "logs" / "probe.json").read_text())
    assert probe["timed_by"] == "fleet.telemetry.timing"


@pytest.mark.multiprocess
@pytest.mark.timeout(30)
def test_fleetrun_plan_names_a_script_that_never_steps(tmp_path):
    script = tmp_path / "nostep.py"
    script.write_text("print('no training here')\n")
    done = run_fleetrun(
        "--plan", "--log-dir", tmp_path / "logs", script, cwd=tmp_path, timeout=25, extra_env=clean_env()
    )
    assert done.returncode == 1
    assert "nostep.py made 0 timed optimizer steps" in done.stdout
