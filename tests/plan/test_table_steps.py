"""The tables' step measured under each placement (fleet/plan/table_steps.py) and how the placement model uses it."""

from __future__ import annotations

import pytest
import torch

from fleet.plan import planner, table_steps
from fleet.plan.calibration import Calibration, Link
from fleet.plan.placement import Cluster, Table, Workload, candidates, measured_extra_s, recommend
from fleet.plan.table_steps import TableShape


def test_shapes_travel_as_text_and_bad_ones_are_named():
    shapes = [TableShape("collection", 16, 1500, 2560, 2), TableShape("embedding", 8, 100, 100)]
    assert table_steps.decode_all(table_steps.encode_all(shapes)) == shapes
    with pytest.raises(ValueError, match="kind must be collection, bag or embedding"):
        TableShape.decode("dense:16:1:1:1")
    with pytest.raises(ValueError, match="at least 1"):
        TableShape.decode("bag:0:1:1:1")


def test_the_id_space_gives_about_the_unique_ids_asked_for():
    generator = torch.Generator().manual_seed(0)
    for draws, unique in ((2560, 1500), (2560, 2000), (1000, 100)):
        space = table_steps.id_space(draws, unique)
        seen = [torch.randint(space, (draws,), generator=generator).unique().numel() for _ in range(20)]
        assert abs(sum(seen) / len(seen) - unique) < 0.03 * unique
    assert table_steps.id_space(100, 100) == 1 << 40  # all distinct: an id space far larger than the draws


def test_the_stand_in_trains_alone_as_the_script_looks_its_tables_up():
    shapes = [
        TableShape("collection", 4, 40, 64, 2),
        TableShape("collection", 8, 30, 32),
        TableShape("bag", 4, 20, 32),
        TableShape("embedding", 4, 30, 30),
    ]
    model = table_steps._StandIn(shapes, batch=16, seed=0)
    features, single = model.batch_input()
    assert set(features) == {"t0f0", "t0f1", "t1f0"} and features["t0f0"][0].numel() == 32  # 16 bags of 2
    assert single["t2"].shape == (16, 2) and single["t3"].shape == (30,)
    assert table_steps.seconds_per_step(shapes, 16, 3, None, seed=0) > 0


def test_the_probe_records_how_each_table_is_looked_up():
    from types import SimpleNamespace

    from fleet.plan.probe import Probe

    probe = Probe(__import__("pathlib").Path("unused.json"), warmup=0, steps=100, seconds=1e9)
    a, b = SimpleNamespace(embedding_dim=4), SimpleNamespace(embedding_dim=8)
    for _ in range(2):
        probe.on_lookup(a, torch.tensor([1, 1, 2, 3]), "collection", 2)
        probe.on_lookup(b, torch.tensor([5, 6]), "bag")
        probe._step(wall=1.0, compute=1.0)
    tables = probe.result()["tables"]
    assert [(t["kind"], t["features"], t["lookups"], t["ids"]) for t in tables] == [
        ("collection", 2, [4, 4], [3, 3]),
        ("bag", 1, [2, 2], [2, 2]),
    ]
    shapes = planner.table_shapes(probe.result())
    assert shapes == [TableShape("collection", 4, 3, 4, 2), TableShape("bag", 8, 2, 2, 1)]
    old = {"tables": [{"dim": 4, "ids": [3], "max_rows": None, "rows_seen": 3}]}  # a record from before
    assert planner.table_shapes(old) == []


def _cal(**over) -> Calibration:
    base = dict(
        cores=64,
        t_comp_s=0.02,
        step_sigma=0.0,
        batch=256,
        dense_bytes=88_000,
        allreduce=Link(latency_s=1e-4, bandwidth_Bps=1e9, loopback=False),
        round_s=4e-4,
        sparse_apply_rows_s=1e7,
        sparse_pull_rows_s=1.2e7,
        sparse_create_rows_s=1e6,
    )
    base.update(over)
    return Calibration(**base)


WORK = Workload(tuple(Table(10**6, 16, 1500, name=f"t{i}", lookups_per_step=2500) for i in range(8)), 88_000)
CLUSTER = Cluster(workers=2, workers_per_host=2, servers=0, worker_memory_bytes=1e12)
ONLY = ("replicated", "sharded", "table_wise")


def test_a_measured_tables_step_replaces_the_estimate_from_rates():
    steps = {"local": 0.005, "replicated": 0.020, "sharded": 0.012, "table_wise": 0.008}
    cal = _cal(table_steps_s=steps)
    by_name = {c.name: c for c in candidates(cal, WORK, CLUSTER, only=ONLY)}
    for name in ONLY:
        parts = by_name[name].parts
        assert parts["the tables sharded (measured on 2 workers)"] == pytest.approx(steps[name] - steps["local"])
        assert not any("route" in p or "pooled" in p or "all-gathered" in p for p in parts)
    ranking = sorted(ONLY, key=lambda n: by_name[n].step_s)
    assert ranking == ["table_wise", "sharded", "replicated"]  # the measured order, whatever the rates say
    rec = recommend(cal, WORK, CLUSTER, only=ONLY)
    assert rec.best.name == "table_wise"
    assert "add 3.0 ms a step against 15.0 ms (measured on a stand-in of the tables, 2 workers)" in rec.reason
    # without the measurement, the estimate from rates (and the tables' own rounds) as before
    estimated = {c.name: c for c in candidates(_cal(), WORK, CLUSTER, only=ONLY)}
    assert "route the rows by id" in estimated["sharded"].parts
    assert measured_extra_s("sharding", cal, 2) == pytest.approx(0.007)  # sharding shards rows as sharded
    assert measured_extra_s("sharded", cal, 4) == pytest.approx(0.007 * 1.5)  # (R-1)/R of the ids leave
    assert measured_extra_s("sharded", cal, 1) is None and measured_extra_s("ps_async", cal, 2) is None


def test_the_measurement_travels_through_the_calibration_files(tmp_path):
    cal = _cal(table_steps_s={"local": 0.005, "sharded": 0.012})
    path = cal.save(tmp_path / "calibration.json")
    assert Calibration.load(path).table_steps_s == {"local": 0.005, "sharded": 0.012}
    assert planner.load_transport(path)["table_steps"] == {"local": 0.005, "sharded": 0.012}


@pytest.mark.slow  # three 2-worker jobs
@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_every_placement_of_the_stand_in_is_measured_on_two_workers(tmp_path):
    probe = {
        "device": "cpu",
        "batch": 32,
        "tables": [
            {"kind": "collection", "dim": 8, "ids": [200], "lookups": [320], "features": 2, "max_rows": None},
            {"kind": "collection", "dim": 16, "ids": [100], "lookups": [160], "features": 1, "max_rows": None},
        ],
    }
    steps = planner.run_table_steps(tmp_path, probe)
    assert set(steps) == {"local", *table_steps.PLACEMENTS}
    assert all(0 < s < 5 for s in steps.values()), steps
