"""fleet.plan's placement rule (fleet/plan/placement.py): pure functions of a calibration, a workload and a cluster."""

from __future__ import annotations

import dataclasses

import pytest

from fleet.plan import planner
from fleet.plan.__main__ import main as plan_main
from fleet.plan.calibration import Calibration, Link, TableStat
from fleet.plan.placement import (
    PREFER_SYNC,
    STRATEGIES,
    TIE,
    Cluster,
    PlacementError,
    Table,
    Workload,
    candidates,
    parse_size,
    parse_tables,
    recommend,
    workload_from,
)


def _cal(**over) -> Calibration:
    base = dict(
        cores=64,
        t_comp_s=0.05,
        step_sigma=0.0,
        batch=256,
        dense_bytes=400_000,
        allreduce=Link(latency_s=1e-4, bandwidth_Bps=1e9, loopback=False),
        round_s=4e-4,
        ps=Link(latency_s=2e-4, bandwidth_Bps=1e9, loopback=False),
        dense_apply_Bps=1e10,
        sparse_apply_rows_s=2e6,
        sparse_pull_rows_s=4e6,
        sparse_create_rows_s=1e6,
    )
    base.update(over)
    return Calibration(**base)


GB = 1e9


def _by_name(rec) -> dict:
    return {c.name: c for c in rec.candidates}


def test_every_recommended_strategy_is_a_valid_distributed_strategy():
    from fleet.strategy import DistributedStrategy

    for name, text in STRATEGIES.items():
        strategy = eval(text, {"DistributedStrategy": DistributedStrategy})  # what the user pastes
        assert strategy.mode in ("collective", "sharding", "ps"), name


def test_tables_that_do_not_fit_a_worker_rule_out_replicated():
    work = Workload((Table(50_000_000, 64, 2_000),), dense_bytes=400_000, state=2.0)  # 25.6 GB with Adagrad
    rec = recommend(_cal(), work, Cluster(workers=8, worker_memory_bytes=8 * GB, servers=4))
    replicated = _by_name(rec)["replicated"]
    assert replicated.ruled_out and "do not fit in 8.0 GB" in replicated.ruled_out and replicated.step_s is None
    assert replicated.worker_bytes == pytest.approx(50_000_000 * (64 * 4 * 2 + 16) + 400_000 * 2)
    assert rec.best.name != "replicated" and "do not fit" in rec.reason
    assert _by_name(rec)["sharded"].worker_bytes == pytest.approx(replicated.worker_bytes / 8 + 400_000 * 2 * 7 / 8)


def test_tiny_tables_with_few_ids_favour_replicated():
    work = Workload((Table(1_000, 16, 20),), dense_bytes=40_000)
    rec = recommend(_cal(), work, Cluster(workers=8, worker_memory_bytes=8 * GB))
    assert rec.best.name == "replicated", rec.reason
    assert rec.best.strategy == 'DistributedStrategy(mode="collective", table_placement="replicated")'
    assert rec.best.step_s < _by_name(rec)["sharded"].step_s


def test_many_ids_on_many_workers_favour_sharded_and_the_reason_names_the_bytes():
    work = Workload((Table(20_000_000, 64, 100_000),), dense_bytes=40_000)  # 26 MB of rows a worker-step
    rec = recommend(_cal(), work, Cluster(workers=16, worker_memory_bytes=64 * GB))
    assert rec.best.name == "sharded", rec.reason
    assert "faster than tables replicated" in rec.reason and "all-gathered" in rec.reason, rec.reason
    c = _by_name(rec)
    # all-gathered: x the rows; to and from their owners: 2 (R-1)/R x the rows, R/2 = 8 times less
    gathered, owned = c["replicated"].parts["rows all-gathered"], c["sharded"].parts["rows to and from their owners"]
    assert gathered == pytest.approx(8 * owned)


def test_staleness_intolerance_rules_out_async_and_geo():
    # a spread of step times: every sync step waits for the slowest of 64, async does not
    cal = _cal(step_sigma=0.8)
    work = Workload((Table(1_000_000, 16, 1_000),), dense_bytes=40_000)
    cluster = Cluster(workers=64, worker_memory_bytes=8 * GB, servers=16)
    sync = recommend(cal, work, cluster)
    stale = recommend(cal, dataclasses.replace(work, sync_required=False), cluster)
    assert stale.best.name in ("ps_async", "ps_async_dense_ar", "ps_geo"), stale.reason
    assert sync.best.name not in ("ps_async", "ps_async_dense_ar", "ps_geo")
    for name in ("ps_async", "ps_async_dense_ar", "ps_geo"):
        ruled = _by_name(sync)[name]
        assert "one process's math is required" in ruled.ruled_out
        assert ruled.step_s is not None  # still predicted: the table shows what the tolerance would buy
    assert sync.best.step_s > stale.best.step_s


def test_a_sync_candidate_close_to_a_stale_one_is_preferred():
    work = Workload((Table(1_000_000, 16, 1_000),), dense_bytes=40_000, sync_required=False)
    rec = recommend(_cal(), work, Cluster(workers=2, worker_memory_bytes=8 * GB, servers=1))
    fastest = min((c for c in rec.candidates if c.step_s), key=lambda c: c.step_s)
    assert fastest.name == "ps_async" and rec.best.name not in ("ps_async", "ps_async_dense_ar", "ps_geo")
    assert rec.best.step_s <= (1 + PREFER_SYNC + TIE) * fastest.step_s
    assert "slower than servers, async, whose updates are stale" in rec.reason, rec.reason


def test_without_servers_the_ps_candidates_are_ruled_out_and_nothing_fitting_is_an_error():
    work = Workload((Table(1_000_000, 16, 1_000),), dense_bytes=40_000)
    cands = candidates(_cal(), work, Cluster(workers=4, worker_memory_bytes=8 * GB, servers=0))
    assert all("no servers" in c.ruled_out for c in cands if c.name.startswith("ps_"))
    huge = Workload((Table(10**10, 64, 1_000),), dense_bytes=40_000)
    with pytest.raises(PlacementError, match="no placement fits.*replicated: .*do not fit"):
        recommend(_cal(), huge, Cluster(workers=2, worker_memory_bytes=1 * GB, servers=1))
    with pytest.raises(PlacementError, match="no embedding tables"):
        recommend(_cal(), Workload((), dense_bytes=1), Cluster(workers=2, worker_memory_bytes=GB))


def test_sharding_mode_splits_the_dense_layers_and_pays_fsdp_rounds():
    work = Workload((Table(1_000_000, 16, 1_000),), dense_bytes=4 * 10**9)  # 4 GB of dense layers
    rec = recommend(_cal(), work, Cluster(workers=8, worker_memory_bytes=10 * GB))
    c = _by_name(rec)
    assert c["sharded"].ruled_out is None and c["sharding"].worker_bytes < c["sharded"].worker_bytes / 4
    tight = recommend(_cal(), work, Cluster(workers=8, worker_memory_bytes=3 * GB))
    assert tight.best.name in ("sharding", "ps_sync"), tight.reason  # the dense layers fit nowhere else


def test_inputs_are_checked_with_messages_naming_them():
    assert parse_size("16GB") == 16e9 and parse_size("512mb") == 512e6 and parse_size("1000") == 1000
    with pytest.raises(PlacementError, match="memory size 'lots'"):
        parse_size("lots")
    tables = parse_tables("10000000x16:1500,100000x64:1200")
    assert [(t.rows, t.dim, t.ids_per_step) for t in tables] == [(10_000_000, 16, 1500), (100_000, 64, 1200)]
    with pytest.raises(PlacementError, match="ROWSxDIM:IDS"):
        parse_tables("10000000x16")
    with pytest.raises(PlacementError, match="rows, dim and value_bytes must be >= 1"):
        Table(0, 16, 10)
    with pytest.raises(PlacementError, match="workers >= 1"):
        Cluster(workers=0, worker_memory_bytes=GB)


def test_the_calibration_carries_the_probes_tables_into_the_workload():
    probe = {
        "compute_s": [0.1, 0.11, 0.09, 0.1],
        "dense_bytes": 4096,
        "sparse_rows": [100, 120],
        "sparse_dim": 8,
        "tables": [{"dim": 8, "ids": [60, 80], "rows_seen": 500, "max_rows": None}, {"dim": 4, "ids": [40, 40]}],
        "device": "cpu",
        "threads": 1,
        "batch": 16,
        "optimizer": "adagrad",
    }
    net = {"loopback": True, "cores": 2, "allreduce": [[1024, 2e-4], [2**20, 1.2e-3]], "round_s": 3e-4}
    cal = planner.build(probe, net, "x.py")
    assert cal.round_s == 3e-4
    assert cal.tables == [TableStat(dim=8, ids_per_step=70, rows_seen=500), TableStat(dim=4, ids_per_step=40)]
    work = workload_from(cal.model_copy(update={"optimizer": "adagrad"}))
    assert [(t.rows, t.dim, t.ids_per_step) for t in work.tables] == [(500, 8, 70), (1, 4, 40)]
    assert work.state == 2.0
    assert [t.rows for t in workload_from(cal, rows=[10**6, 10**3]).tables] == [10**6, 10**3]
    with pytest.raises(PlacementError, match="2 tables"):
        workload_from(cal, rows=[1])


def test_python_m_fleet_plan_placement_prints_the_strategy_to_paste(tmp_path, capsys):
    path = _cal().save(tmp_path / "calibration.json")
    code = plan_main(
        ["placement", "--calibration", str(path), "--workers", "8", "--tables", "50000000x64:2000",
         "--worker-memory", "8GB", "--servers", "4"]
    )  # fmt: skip
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "recommended placement: DistributedStrategy(" in out.out and "why:" in out.out
    assert "do not fit in 8.0 GB" in out.out  # replicated, ruled out
    assert plan_main(["placement", "--calibration", str(path), "--workers", "8"]) == 2
    assert "records no embedding tables: give them with --tables" in capsys.readouterr().err


def test_the_plan_prints_the_placement_when_the_script_has_tables():
    from rich.console import Console

    cal = _cal(sparse_rows=3_000, sparse_dim=16, tables=[TableStat(dim=16, ids_per_step=3_000, rows_seen=200_000)])
    console = Console(record=True, width=200, highlight=False)
    planner.predict_and_report(cal, (1, 2, 8), workers_per_host=2, servers_per_host=1, console=console)
    out = console.export_text()
    assert "workers" in out and "recommended:" in out  # the mode table, as before
    assert "placement at " in out and "recommended placement: DistributedStrategy(" in out
    assert "table sizes: the rows the calibration run touched, a lower bound" in out
    console = Console(record=True, width=200, highlight=False)
    planner.predict_and_report(_cal(), (1, 2), console=console)
    assert "placement" not in console.export_text()  # no tables: the plan is what it was


def test_a_feature_collection_names_each_tables_ids_for_the_probe():
    import torch

    from fleet.nn import FeatureTable, SparseFeatureCollection

    collection = SparseFeatureCollection(
        [FeatureTable("a", 4, features=["x", "y"]), FeatureTable("b", 8, features=["z"])]
    )
    ids = collection.ids_by_table(
        {"x": torch.tensor([[1, 2], [2, 3]]), "y": torch.tensor([[5], [5]]), "z": torch.tensor([[7], [8]])}
    )
    assert sorted(ids) == ["a", "b"]
    assert ids["a"].tolist() == [1, 2, 2, 3, 5, 5] and ids["b"].tolist() == [7, 8]
    assert collection["a"].num_rows() == 0  # counting pulls nothing


def test_a_tie_goes_to_no_servers_then_the_least_memory():
    # communication nearly free: every candidate takes the computation's time, within the model's resolution
    fast = Link(latency_s=1e-7, bandwidth_Bps=1e13, loopback=False)
    cal = _cal(t_comp_s=1.0, allreduce=fast, ps=fast, round_s=1e-7, dense_apply_Bps=1e13, sparse_apply_rows_s=1e9)
    cluster = Cluster(workers=4, worker_memory_bytes=64 * GB, servers=2)
    small_dense = recommend(cal, Workload((Table(10**7, 16, 1_000),), dense_bytes=40_000), cluster)
    assert small_dense.best.name == "sharded" and "within the model's resolution" in small_dense.reason
    big_dense = recommend(cal, Workload((Table(10**7, 16, 1_000),), dense_bytes=2 * 10**9), cluster)
    assert big_dense.best.name == "sharding", big_dense.reason  # the dense layers split 4 ways too


def test_what_moves_to_the_servers_is_the_lookup_at_their_rates_not_the_pooling():
    from fleet.plan.placement import calibration_for

    cal = _cal(sparse_local_s=0.03, sparse_new_rows=200, sparse_pull_rows_s=1e6, sparse_create_rows_s=1e5)
    moved = calibration_for(cal, Workload((Table(10**6, 16, 1_000),), dense_bytes=0)).sparse_local_s
    assert moved == pytest.approx(200 / 1e5 + 800 / 1e6)
    assert (
        calibration_for(
            cal.model_copy(update={"sparse_local_s": 1e-4}), Workload((Table(10, 4, 1_000),), 0)
        ).sparse_local_s
        == 1e-4
    )


def test_many_even_tables_favour_table_wise_and_one_large_table_favours_row_wise():
    """Table-wise moves bags and pooled vectors instead of rows; it cannot split a table, so one large table
    leaves one holder with every worker's sparse work."""
    many = Workload(tuple(Table(1_000_000, 64, 20_000, name=f"t{i}") for i in range(8)), dense_bytes=40_000)
    cluster = Cluster(workers=2, worker_memory_bytes=64 * GB)
    rec = recommend(_cal(), many, cluster)
    c = _by_name(rec)
    assert rec.best.name == "table_wise", rec.reason
    assert rec.best.strategy == 'DistributedStrategy(mode="collective", table_placement="table_wise")'
    assert c["table_wise"].step_s < c["sharded"].step_s
    assert c["table_wise"].parts["the busiest holder's extra sparse work"] == pytest.approx(0.0)  # 4 and 4 tables
    assert c["table_wise"].worker_bytes == pytest.approx(c["sharded"].worker_bytes)  # half of the tables each
    one = Workload((Table(20_000_000, 64, 100_000),), dense_bytes=40_000)
    rec = recommend(_cal(), one, Cluster(workers=16, worker_memory_bytes=64 * GB))
    assert rec.best.name == "sharded", rec.reason
    table_wise = _by_name(rec)["table_wise"]
    assert table_wise.step_s > rec.best.step_s and table_wise.worker_bytes > rec.best.worker_bytes  # one holder
    assert table_wise.parts["the busiest holder's extra sparse work"] > 0
