"""Sparse tables sharded table-wise (fleet.collective.table_wise): each table whole on one worker, a feature
collection's bags pooled by the tables' holders, and the job trains as one process on the union of the batches."""

from __future__ import annotations

import pytest
import sharded_jobs
from test_sharded_tables import _check

from dist_harness import run_workers
from fleet.collective.table_wise import holders

TABLE_WISE = {"mode": "collective", "table_placement": "table_wise"}
COLLECTION = ("user", "item")  # the SparseFeatureCollection's tables: pooled by their holders


def test_holders_spread_the_widest_tables_first_and_are_the_same_for_the_same_widths() -> None:
    widths = [16, 16, 32, 32, 64, 64, 64, 16]  # W6's tables
    got = holders(widths, 2)
    assert got == holders(list(widths), 2)
    load = [sum(w for w, h in zip(widths, got, strict=True) if h == j) for j in range(2)]
    assert sorted(load) == [144, 160], load
    assert holders([8], 3) == [0] and holders([8, 8, 8], 3) == [0, 1, 2]


def _check_whole(results: list[dict], want: dict, pooled: bool) -> None:
    """Every table held whole by one worker, the same one on every worker; the collection's bags pooled there."""
    for name, table in want["tables"].items():
        holder = results[0]["held"][name]["holder"]
        assert all(r["held"][name]["holder"] == holder for r in results), name
        counts = [r["held"][name]["count"] for r in results]
        assert counts[holder] == table["ids"].numel() and sum(counts) == counts[holder], (name, counts)
        assert all(r["held"][name]["owned"] and r["held"][name]["replica"] == 0 for r in results)
        steps = sharded_jobs.STEPS if pooled and name in COLLECTION else 0
        assert all(r["held"][name]["pooled"] == steps for r in results), (name, steps)
    assert len({r["held"][name]["holder"] for r in results for name in want["tables"]}) == len(results)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("kind", ["sgd", "adagrad"])
def test_table_wise_tables_equal_one_process_on_the_union(workers: int, kind: str) -> None:
    want = sharded_jobs.reference(workers, kind)
    results = run_workers(sharded_jobs.worker, workers, kind, TABLE_WISE, timeout=200)
    for result in results:
        _check(result, want, workers)
    _check_whole(results, want, pooled=True)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["momentum", "adam", "rowwise_adagrad"])
def test_every_row_optimizer_table_wise_equals_one_process(kind: str) -> None:
    want = sharded_jobs.reference(2, kind)
    for result in run_workers(sharded_jobs.worker, 2, kind, TABLE_WISE, timeout=200):
        _check(result, want, 2)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", [{**TABLE_WISE, "shared_memory": False}, {"mode": "sharding", "table_placement": "table_wise"}], ids=["process-group", "sharding"])  # fmt: skip
def test_table_wise_through_the_process_group_and_in_sharding_mode_equals_one_process(strategy: dict) -> None:
    want = sharded_jobs.reference(2, "adagrad")
    results = run_workers(sharded_jobs.worker, 2, "adagrad", strategy, timeout=200)
    for result in results:
        _check(result, want, 2)
    _check_whole(results, want, pooled=True)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("workers", "life"),
    [(2, True), (3, True), (2, "count"), (2, "cap")],
    ids=["ttl-clicks", "ttl-clicks-3", "count", "max_rows"],
)
def test_a_life_cycle_on_table_wise_tables_is_one_process_s_cap_included(workers: int, life: bool | str) -> None:
    """The holder keeps the whole table: admission (by probability, by count), TTL, the clicks record_clicks gives
    (their labels travel with the pooled gradients) and even a max_rows cap (not split over shares, unlike row-wise
    sharding) are one process's."""
    want = sharded_jobs.reference(workers, "adagrad", life=life)
    results = run_workers(sharded_jobs.worker, workers, "adagrad", TABLE_WISE, life, timeout=200)
    for result in results:
        _check(result, want, workers)
    _check_whole(results, want, pooled=True)


@pytest.mark.multiprocess
@pytest.mark.slow  # two jobs (N then M workers): the slow set keeps the README suite under 10 min
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("before", "after"), [(2, 3), (3, 2)])
def test_a_table_wise_state_dict_saved_by_n_workers_loads_on_m_and_trains_on_as_one_process(
    before: int, after: int
) -> None:
    """The state dict holds every row (gathered from the holders); on M workers each table's new holder keeps all of
    its rows (the holders depend on the number of workers), and training goes on as one process would."""
    want = sharded_jobs.reference_reload(before, after, "adagrad")
    saved = run_workers(sharded_jobs.save_worker, before, "adagrad", TABLE_WISE, timeout=200)
    results = run_workers(sharded_jobs.reload_worker, after, saved[0], "adagrad", TABLE_WISE, timeout=200)
    for result in results:
        _check({"tables": result["loaded"], "dense": want["dense"]}, {"tables": want["loaded"], "dense": {}}, after)
        _check(result, want, after)
    for name, table in want["loaded"].items():
        here = [r["loaded_here"][name] for r in results]
        assert sorted(here) == [0] * (after - 1) + [table["ids"].numel()], (name, here)  # one holder, every row
    assert sorted(r["given_here"] for r in results) == [0] * (after - 1) + [sharded_jobs.GIVEN.numel()]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("workers", [2, 3])
def test_micro_batches_and_an_evaluation_on_table_wise_tables_equal_one_process(workers: int) -> None:
    """Two pooled forwards before one step (each backward's pooled gradients travel at the step), then an
    evaluation forward under no_grad: the rows and the evaluated outputs are one process's."""
    want = sharded_jobs.reference_accumulated(workers, "adagrad")
    results = run_workers(sharded_jobs.accumulating_worker, workers, "adagrad", TABLE_WISE, timeout=200)
    batch = sharded_jobs.BATCH
    for rank, result in enumerate(results):
        _check(result, want, workers)
        mine = want["evaluated"][rank * batch : (rank + 1) * batch]
        assert (result["evaluated"] - mine).abs().max() <= 1e-6, rank


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_one_worker_evaluating_while_another_trains_is_named_on_every_worker() -> None:
    for kind, message in run_workers(sharded_jobs.mixed_mode_worker, 2, timeout=90):
        assert kind == "FleetError", (kind, message)
        assert "workers [1] look up to train" in message and "held by worker" in message, message


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_per_id_weights_on_one_worker_only_are_named_on_every_worker() -> None:
    for kind, message in run_workers(sharded_jobs.mixed_weights_worker, 2, timeout=90):
        assert kind == "FleetError", (kind, message)
        assert "workers [0] pass per-id weights for feature 0" in message, message


@pytest.mark.multiprocess
@pytest.mark.slow  # two jobs (2 then 3 workers): the slow set keeps the README suite under 10 min
@pytest.mark.timeout(300)
def test_a_table_wise_sharding_checkpoint_resumes_on_another_number_of_workers(tmp_path) -> None:
    """fleet.save_checkpoint in mode="sharding" with table-wise tables holds every row; loaded by 3 workers, each
    table's new holder takes its rows and training goes on as one process would."""
    ckpt = str(tmp_path / "ckpt")
    saved = run_workers(sharded_jobs.checkpoint_worker, 2, ckpt, False, "table_wise", timeout=200)
    resumed = run_workers(sharded_jobs.checkpoint_worker, 3, ckpt, True, "table_wise", timeout=200)
    want = sharded_jobs.reference_resume(2, 3)
    for result in resumed:
        _check({"tables": result["loaded"], "dense": {}}, {"tables": saved[0]["saved"], "dense": {}}, 3)
        _check(result, want, 3)
