"""Parameter-server jobs: a NaN or Inf batch never reaches a table (issue 26, finding 9).

A worker's loss is multiplied by NaN at one step and by Inf at another, so every gradient of those
steps (dense and rows) is non-finite. Sync (2 workers): the bad worker counts as absent from those
steps, so the tables equal one process trained on the union of the other batches. Async and geo
(1 worker): the job trains a second model that skips those steps entirely, and both models'
tables must be bit-equal. Shard-level cases are in tests/ps/test_nonfinite.py.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from ps_jobs import all_ids, batch, make_model, make_optimizer, run_job

STEPS = 6
BAD = {1: math.nan, 4: math.inf}  # step -> what the bad worker's loss is multiplied by


def _train_model(rank: int, workers: int, poison: bool, skip: bool) -> tuple[dict, int, object]:
    """Trains one Net; ``poison``: the last worker's loss is non-finite at BAD; ``skip``: no step there."""
    import fleet

    torch.manual_seed(100)
    model = make_model("plain")
    opt = fleet.distributed_optimizer(make_optimizer("plain", model.parameters()))
    loss_fn = torch.nn.BCEWithLogitsLoss()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            if skip and step in BAD:
                continue
            ids, dense, label = batch(step, rank)
            opt.zero_grad()
            loss = loss_fn(model(ids, dense), label)
            if poison and step in BAD and rank == workers - 1:
                loss = loss * BAD[step]
            loss.backward()
            opt.step()
            opt.flush()  # async: this step's pushes and pull done, so both models see the same values
    warned = sum("NaN or Inf" in str(w.message) for w in caught)
    model.eval()
    with torch.no_grad():
        values = {"rows": model.emb(all_ids()).clone(), **{k: v.clone() for k, v in model.mlp.state_dict().items()}}
    return values, warned, opt


def train(rank: int, workers: int, twice: bool) -> dict:
    import fleet

    try:
        fleet.init()
    except SystemExit as stop:  # a server
        return {"served": stop.code}
    poisoned, warned, opt = _train_model(rank, workers, poison=True, skip=False)
    out = {"poisoned": poisoned, "warned": warned}
    if twice:  # the same job, a second model (its own tables) that never sees the bad steps
        out["clean"], _, _ = _train_model(rank, workers, poison=False, skip=True)
    fleet.barrier_worker()
    out["skipped"] = {  # per table: the servers' count of skipped pushes per worker
        table: info["nonfinite_skipped"]
        for server in opt.client.stats().result()
        for table, info in server["tables"].items()
    }
    fleet.stop_worker()
    return out


def reference(workers: int) -> dict[str, torch.Tensor]:
    """One process on the union of the workers' batches, the last worker's left out at BAD."""
    torch.manual_seed(100)
    model = make_model("plain")
    opt = make_optimizer("plain", model.parameters())
    loss_fn = torch.nn.BCEWithLogitsLoss()
    for step in range(STEPS):
        ranks = range(workers - 1) if step in BAD else range(workers)
        parts = [batch(step, r) for r in ranks]
        ids, dense, label = (torch.cat([p[i] for p in parts]) for i in range(3))
        opt.zero_grad()
        loss_fn(model(ids, dense), label).backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        return {"rows": model.emb(all_ids()).clone(), **model.mlp.state_dict()}


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_sync_a_nonfinite_batch_counts_as_absent_and_the_tables_equal_one_process_without_it():
    results = run_job(train, 1, 2, {"update": "sync"}, 2, False, timeout=120)
    assert [r["warned"] for r in results] == [0, len(BAD)]
    assert results[0]["skipped"] == {"0": {"1": len(BAD)}, "1": {"1": len(BAD)}}  # the dense table and the rows
    expected = reference(2)
    for worker in results:
        got = worker["poisoned"]
        assert sorted(got) == sorted(expected)
        for name in expected:
            assert torch.isfinite(got[name]).all(), name
            torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("update", ["async", "geo"])
def test_async_and_geo_tables_are_bit_equal_to_a_run_without_the_nonfinite_batches(update):
    strategy = {"update": update, **({"k_steps": 1} if update == "geo" else {})}
    (result,) = run_job(train, 1, 1, strategy, 1, True, timeout=120)
    assert result["warned"] == len(BAD)
    # async: the servers skipped the poisoned model's pushes (tables 0, 1); geo: the worker skipped the local
    # steps, so nothing non-finite reached them
    expect = {"0": {"0": len(BAD)}, "1": {"0": len(BAD)}} if update == "async" else {"0": {}, "1": {}}
    assert result["skipped"] == {**expect, "2": {}, "3": {}}
    for name, value in result["poisoned"].items():
        assert torch.isfinite(value).all(), name
        assert torch.equal(value, result["clean"][name]), name
