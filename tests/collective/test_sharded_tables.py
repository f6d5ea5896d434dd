"""Sparse tables sharded across the workers (fleet.collective.sharded_rows) train as one process on the union of
the workers' batches, each worker holding only the rows it owns (:mod:`sharded_jobs`)."""

from __future__ import annotations

import pytest
import sharded_jobs
import torch

from dist_harness import run_workers

pytestmark = pytest.mark.multiprocess

COLLECTIVE = {"mode": "collective", "table_placement": "sharded"}
SHARDING = {"mode": "sharding"}  # sharded by default


def _check(result: dict, want: dict, workers: int) -> None:
    for name, table in want["tables"].items():
        got = result["tables"][name]
        assert torch.equal(got["ids"], table["ids"]), name  # every row, gathered from every owner
        assert got.keys() == table.keys(), (name, sorted(got), sorted(table))
        for field, value in table.items():
            assert torch.allclose(got[field].double(), value.double(), atol=1e-6, rtol=0), (name, field)
    for name, value in want["dense"].items():
        assert torch.allclose(result["dense"][name], value, atol=1e-6, rtol=0), name


def _check_held(results: list[dict], want: dict, workers: int, through: str = "shared memory") -> None:
    """Each worker holds its own rows only (about 1/N of them), none twice, and no replica; the exchanges went
    ``through`` shared memory (every worker here is on one host) or the process group."""
    for name, table in want["tables"].items():
        assert all(r["held"][name]["through"] == through for r in results), (name, through)
        total = table["ids"].numel()
        counts = [r["held"][name]["count"] for r in results]
        assert sum(counts) == total, (name, counts, total)
        for r in results:
            assert r["held"][name]["owned"] and r["held"][name]["replica"] == 0
            assert r["held"][name]["total"] == total
        assert max(counts) < total, (name, counts)  # split, not one worker holding all


@pytest.mark.timeout(240)
@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("kind", ["sgd", "adagrad"])
@pytest.mark.parametrize("strategy", [COLLECTIVE, SHARDING], ids=["collective", "sharding"])
def test_sharded_tables_equal_one_process_on_the_union(workers: int, kind: str, strategy: dict) -> None:
    want = sharded_jobs.reference(workers, kind)
    results = run_workers(sharded_jobs.worker, workers, kind, strategy, timeout=200)
    for result in results:
        _check(result, want, workers)
    _check_held(results, want, workers)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("workers", [2, 3])
def test_sharded_tables_through_the_process_group_equal_one_process(workers: int) -> None:
    """With shared memory switched off (as across hosts), the exchanges go through gloo: the same math."""
    want = sharded_jobs.reference(workers, "adagrad")
    results = run_workers(sharded_jobs.worker, workers, "adagrad", {**COLLECTIVE, "shared_memory": False}, timeout=200)
    for result in results:
        _check(result, want, workers)
    _check_held(results, want, workers, through="process group")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("shared_memory", [True, False])
def test_a_step_whose_ids_are_not_its_last_pulls_sends_them_and_equals_one_process(shared_memory: bool) -> None:
    """A step sends its ids only where they are not those of the table's last pull (the owner has them): a
    lookup between the forward and the step (of the step's ids on worker 0, other ids on worker 1) mixes both
    kinds of sender in one step; the same math either way."""
    want = sharded_jobs.reference(2, "adagrad")
    strategy = {**COLLECTIVE, "shared_memory": shared_memory}
    results = run_workers(sharded_jobs.worker, 2, "adagrad", strategy, False, None, True, timeout=200)
    for result in results:
        _check(result, want, 2)
    _check_held(results, want, 2, through="shared memory" if shared_memory else "process group")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["momentum", "adam", "rowwise_adagrad"])
def test_every_row_optimizer_sharded_equals_one_process(kind: str) -> None:
    want = sharded_jobs.reference(2, kind)
    for result in run_workers(sharded_jobs.worker, 2, kind, COLLECTIVE, timeout=200):
        _check(result, want, 2)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("workers", [2, 3])
def test_life_cycle_and_clicks_on_sharded_tables_equal_one_process(workers: int) -> None:
    """ProbabilityEntry admission, TTL eviction and record_clicks' statistics: the owners' clocks are one table's."""
    want = sharded_jobs.reference(workers, "adagrad", life=True)
    assert any(k.startswith("stats.") for k in want["tables"]["emb"])
    for result in run_workers(sharded_jobs.worker, workers, "adagrad", COLLECTIVE, True, timeout=200):
        _check(result, want, workers)


@pytest.mark.slow  # two jobs each (N then M workers): the slow set keeps the README suite under 10 min
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("before", "after"), [(2, 3), (3, 2)])
def test_a_state_dict_saved_by_n_workers_loads_on_m_and_trains_on_as_one_process(before: int, after: int) -> None:
    """Every row is in the state dict (gathered in pieces); M workers each keep the rows they own, train on exactly as
    one process would; load_rows spreads given rows over the workers, about 1/M each."""
    want = sharded_jobs.reference_reload(before, after, "adagrad")
    saved = run_workers(sharded_jobs.save_worker, before, "adagrad", COLLECTIVE, timeout=200)
    first, last = sharded_jobs.load_bytes(saved[0]), sharded_jobs.load_bytes(saved[-1])
    assert first.keys() == last.keys() and all(torch.equal(first[k], last[k]) for k in first)  # the same rows
    results = run_workers(sharded_jobs.reload_worker, after, saved[0], "adagrad", COLLECTIVE, timeout=200)
    for result in results:
        _check({"tables": result["loaded"], "dense": want["dense"]}, {"tables": want["loaded"], "dense": {}}, after)
        _check(result, want, after)
        assert torch.allclose(result["weight"], want["weight"], atol=1e-6, rtol=0)
    for name, table in want["loaded"].items():
        assert sum(r["loaded_here"][name] for r in results) == table["ids"].numel(), name
    given = [r["given_here"] for r in results]
    assert sum(given) == sharded_jobs.GIVEN.numel()
    share = sharded_jobs.GIVEN.numel() / after
    assert all(0.8 * share <= n <= 1.2 * share for n in given), given  # memory per worker: about 1/M of the rows


@pytest.mark.timeout(120)
def test_join_with_sharded_tables_is_refused_on_every_worker() -> None:
    for kind, message in run_workers(sharded_jobs.misuse_worker, 2, "join", timeout=90):
        assert kind == "FleetError", (kind, message)
        assert "not supported yet with sparse tables sharded across the workers" in message, message
        assert "table_placement='replicated'" in message


@pytest.mark.timeout(120)
def test_a_lookup_on_one_worker_alone_is_named_not_a_hang() -> None:
    for kind, message in run_workers(sharded_jobs.misuse_worker, 2, "alone", timeout=90):
        assert kind == "PeerError", (kind, message)
        assert "pull the rows of a fleet.nn.SparseEmbedding sharded across the workers" in message, message


@pytest.mark.timeout(120)
def test_a_nan_on_one_worker_skips_the_step_on_every_owner() -> None:
    for result in run_workers(sharded_jobs.nonfinite_worker, 2, timeout=90):
        for name, table in result["before"].items():
            after = result["after"][name]
            kept = torch.isin(after["ids"], table["ids"])  # the pull created the new ids' rows, at their initial values
            assert table["ids"].numel() and torch.equal(after["ids"][kept], table["ids"])
            assert all(torch.equal(v, after[k][kept]) for k, v in table.items()), name  # no row stepped
        assert sum("NaN or Inf and was skipped" in w for w in result["warned"]) == 4, result["warned"]  # 4 tables


@pytest.mark.slow  # two jobs (2 then 3 workers): the slow set keeps the README suite under 10 min
@pytest.mark.timeout(300)
def test_a_sharding_checkpoint_of_sharded_tables_resumes_on_another_number_of_workers(tmp_path) -> None:
    """fleet.save_checkpoint with 2 workers holds every row; fleet.load_checkpoint with 3 spreads them over their
    owners, and training goes on as one process would (dense optimizer state resharded by FSDP2's checkpoint)."""
    ckpt = str(tmp_path / "ckpt")
    saved = run_workers(sharded_jobs.checkpoint_worker, 2, ckpt, False, timeout=200)
    resumed = run_workers(sharded_jobs.checkpoint_worker, 3, ckpt, True, timeout=200)
    want = sharded_jobs.reference_resume(2, 3)
    for result in resumed:
        _check({"tables": result["loaded"], "dense": {}}, {"tables": saved[0]["saved"], "dense": {}}, 3)
        _check(result, want, 3)
    exported = torch.load(resumed[0]["exported"], weights_only=True)["tables"]
    names = {"emb": "emb", "bag": "bag", "user": "features.tables.user", "item": "features.tables.item"}
    for name, table in want["tables"].items():
        got = exported[names[name]]
        order = torch.argsort(got["ids"])
        assert torch.equal(got["ids"][order], table["ids"]), name  # every owner's rows, once
        assert torch.allclose(got["rows"][order], table["rows"], atol=1e-6, rtol=0), name


@pytest.mark.timeout(240)
def test_rows_gathered_in_small_pieces_are_every_row() -> None:
    """A state dict gathered two or three rows per worker per exchange holds the same rows as in one piece."""
    want = sharded_jobs.reference(3, "adagrad")
    assert want["tables"]["emb"]["ids"].numel() > 20  # many exchanges
    for result in run_workers(sharded_jobs.worker, 3, "adagrad", COLLECTIVE, False, 100, timeout=200):
        _check(result, want, 3)


@pytest.mark.timeout(120)
def test_rows_given_before_init_move_to_their_owners() -> None:
    results = run_workers(sharded_jobs.pretrained_worker, 2, timeout=90)
    assert sum(r["held"] for r in results) == sharded_jobs.GIVEN.numel()
    for r in results:
        assert r["replica"] == 0 and 0 < r["held"] < sharded_jobs.GIVEN.numel()
        order = torch.argsort(r["rows"]["ids"])
        assert torch.equal(r["rows"]["ids"][order], sharded_jobs.GIVEN * 7 - 3)
        assert torch.equal(r["rows"]["rows"][order], sharded_jobs.given_rows())


@pytest.mark.timeout(240)
def test_count_filter_admission_on_sharded_tables_equals_one_process() -> None:
    """Each owner counts its own ids in its sketch (as a parameter server does); without sketch collisions (a few
    hundred ids in 4 Mi counters) that admits what one process admits."""
    want = sharded_jobs.reference(2, "adagrad", life="count")
    for result in run_workers(sharded_jobs.worker, 2, "adagrad", COLLECTIVE, "count", timeout=200):
        _check(result, want, 2)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", [COLLECTIVE, {"mode": "sharding", "table_placement": "sharded"}])
def test_a_cap_on_a_sharded_table_is_split_over_the_owners(strategy: dict) -> None:
    results = run_workers(sharded_jobs.worker, 2, "sgd", strategy, "cap", timeout=200)
    for name in ("emb", "bag", "user", "item"):
        counts = [r["held"][name]["count"] for r in results]
        assert all(0 < n <= sharded_jobs.CAP // 2 for n in counts), (name, counts)
        assert all(r["held"][name]["total"] == sum(counts) and r["held"][name]["owned"] for r in results)
