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


def _check_held(results: list[dict], want: dict, workers: int) -> None:
    """Each worker holds its own rows only (about 1/N of them), none twice, and no replica."""
    for name, table in want["tables"].items():
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
