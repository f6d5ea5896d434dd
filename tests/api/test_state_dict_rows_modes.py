"""A SparseEmbedding's rows through ``state_dict`` / ``load_state_dict`` and ``load_rows`` in collective and
parameter-server jobs, against one process on the union of the workers' batches (:mod:`rows_jobs`)."""

from __future__ import annotations

import pytest
import rows_jobs
import torch

from dist_harness import run_workers
from ps_jobs import run_job

pytestmark = pytest.mark.multiprocess


def _check(result: dict, want: dict) -> None:
    assert torch.equal(result["first"], rows_jobs.given(10, 1))  # given before the optimizer, then trained
    for key in ("saved", "after"):
        assert result["elsewhere"].keys() == result["saved"].keys()  # the rows loaded in a process of their own
        assert all(
            torch.equal(result["elsewhere"][k], v) for k, v in result["saved"].items()
        )  # the state dict's rows, optimizer state included, as in one process
        assert result[key].keys() == want[key].keys() and "state.sum" in want[key]
        assert torch.equal(result[key]["ids"], want[key]["ids"])
        for name in want[key]:
            assert torch.allclose(result[key][name].float(), want[key][name].float(), atol=1e-5), (key, name)
    assert torch.allclose(result["weight"], want["weight"], atol=1e-5)
    assert torch.equal(result["late"], rows_jobs.given(3, 2))
    assert torch.allclose(result["rows"], want["rows"], atol=1e-5)
    for name, value in want["mlp"].items():
        assert torch.allclose(result["mlp"][name], value, atol=1e-5), name


@pytest.mark.timeout(120)
def test_collective_state_dict_round_trip_matches_one_process() -> None:
    want = rows_jobs.reference(2)
    for result in run_workers(rows_jobs.worker, 2, timeout=90):
        _check(result, want)


@pytest.mark.timeout(150)
def test_parameter_server_state_dict_round_trip_in_bounded_pieces_matches_one_process() -> None:
    want = rows_jobs.reference(2)
    assert want["saved"]["ids"].numel() > 4 * 4  # many more rows than one request carries
    results = run_job(rows_jobs.worker, 1, 2, {"update": "sync", "max_request_ids": 4}, timeout=120)
    for result in results:
        _check(result, want)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy", [{"update": "geo", "k_steps": 2}, {"update": "async"}])
def test_parameter_server_load_state_dict_restores_the_servers_rows(strategy: dict) -> None:
    for result in run_job(rows_jobs.reload_worker, 2, 2, strategy, timeout=120):
        saved, after = result["saved"], result["after"]
        assert saved["ids"].numel() > 0 and saved.keys() == after.keys()
        assert all(torch.equal(saved[k], after[k]) for k in saved)
        assert torch.allclose(result["looked_up"], result["want"], atol=1e-6)
        assert result["second"].keys() == saved.keys()  # loaded before the table went to the servers
        assert all(torch.equal(result["second"][k], saved[k]) for k in saved)
