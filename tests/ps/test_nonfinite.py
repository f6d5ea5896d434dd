"""Non-finite updates never reach a table (issue 26, finding 9): server shards, one process, collective.

The parameter-server jobs (sync, async, geo end to end) are in tests/strategies/test_ps_nonfinite.py.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import fleet
import fleet.api
from dist_harness import run_workers
from fleet.ps.server import aggregator as agg
from fleet.sparse import nonfinite
from fleet.sparse.nonfinite import NonFiniteUpdateError

BAD = [math.nan, math.inf, -math.inf]
IDS = torch.tensor([3, 7, -5])


def sparse_shard(update: str, workers: int = 2, **extra) -> agg.SparseShard:
    config = {"dim": 2, "optimizer": {"kind": "adagrad", "lr": 0.5}, "update": update, **extra}
    return agg.SparseShard(0, config, workers)


def dense_shard(update: str, workers: int = 2, **extra) -> agg.DenseShard:
    shard = agg.DenseShard(1, {"size": 4, "optimizer": {"kind": "adam", "lr": 0.1}, "update": update, **extra}, workers)
    shard.set(torch.arange(4, dtype=torch.float32))
    return shard


def grads(seed: int, bad: float | None = None) -> torch.Tensor:
    g = torch.randn(3, 2, generator=torch.Generator().manual_seed(seed))
    if bad is not None:
        g[1, 0] = bad
    return g


def sparse_state(shard: agg.SparseShard) -> dict[str, torch.Tensor]:
    return {k: v for k, v in shard.table.state_dict().items() if isinstance(v, torch.Tensor)}


def assert_bit_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        same = torch.equal(a[key], b[key]) if isinstance(a[key], torch.Tensor) else a[key] == b[key]
        assert same, (key, a[key], b[key])


@pytest.mark.parametrize("bad", BAD)
def test_sync_sparse_a_nonfinite_push_counts_as_absent_and_the_step_averages_the_finite_ones(bad):
    shard, alone = sparse_shard("sync"), sparse_shard("sync", workers=1)
    for step in range(3):
        assert shard.push_grad(0, step, IDS, grads(step), 0.5)
        assert not shard.maybe_step({0, 1}, set())  # the bad worker's push is still to come: the step waits
        assert shard.push_grad(1, step, IDS, grads(10 + step, bad if step == 1 else None), 0.5)
        assert shard.maybe_step({0, 1}, set()) and shard.version == step + 1
        # the reference: one worker alone at step 1 (the other's push absent), both averaged otherwise
        mean = grads(step) if step == 1 else (grads(step) + grads(10 + step)) / 2
        assert alone.push_grad(0, step, IDS, mean, 0.5) and alone.maybe_step({0}, set())
    assert_bit_equal(sparse_state(shard), sparse_state(alone))
    assert shard.info()["nonfinite_skipped"] == {"1": 1}


def test_sync_sparse_a_nan_learning_rate_or_clicks_or_piece_makes_the_whole_push_absent():
    shard, alone = sparse_shard("sync"), sparse_shard("sync", workers=1)
    # worker 1's push comes in two pieces; the second is non-finite: the first, finite, must not count
    assert shard.push_grad(1, 0, IDS[:1], grads(1)[:1], 0.5, more=True)
    assert shard.push_grad(1, 0, IDS[1:], grads(1, math.nan)[1:], 0.5)
    assert shard.push_grad(0, 0, IDS, grads(0), 0.5) and shard.maybe_step({0, 1}, set())
    # a NaN learning rate (the worker's mark of a skipped table), even on a push without rows
    assert shard.push_grad(1, 1, IDS[:0], grads(1)[:0], math.nan)
    assert shard.push_grad(0, 1, IDS, grads(2), 0.5) and shard.maybe_step({0, 1}, set())
    # non-finite clicks
    assert shard.push_grad(1, 2, IDS, grads(3), 0.5, clicks=torch.tensor([1.0, math.inf, 0.0]))
    assert shard.push_grad(0, 2, IDS, grads(4), 0.5) and shard.maybe_step({0, 1}, set())
    # every push of a step skipped: the step closes, the table does not move
    before = sparse_state(shard)
    assert shard.push_grad(0, 3, IDS, grads(5, math.inf), 0.5) and shard.push_grad(1, 3, IDS, grads(6, math.nan), 0.5)
    assert shard.maybe_step({0, 1}, set()) and shard.version == 4
    assert_bit_equal(sparse_state(shard), before)
    for step, seed in enumerate((0, 2, 4)):
        assert alone.push_grad(0, step, IDS, grads(seed), 0.5) and alone.maybe_step({0}, set())
    assert_bit_equal(sparse_state(shard), sparse_state(alone))
    assert shard.info()["nonfinite_skipped"] == {"0": 1, "1": 4}


@pytest.mark.parametrize("bad", BAD)
def test_sync_dense_a_nonfinite_push_counts_as_absent(bad):
    shard, alone = dense_shard("sync"), dense_shard("sync", workers=1)
    g = [torch.randn(4, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    poisoned = g[1].clone()
    poisoned[2] = bad
    assert shard.push_grad(1, 0, poisoned, 0.1) and not shard.maybe_step({0, 1}, set())
    assert shard.push_grad(0, 0, g[0].clone(), 0.1) and shard.maybe_step({0, 1}, set())
    # (a sync shard accumulates into the first push's buffer, a received frame: here a copy)
    assert shard.push_grad(0, 1, g[2].clone(), 0.1) and shard.push_grad(1, 1, g[3], 0.1)
    assert shard.maybe_step({0, 1}, set())
    assert alone.push_grad(0, 0, g[0], 0.1) and alone.maybe_step({0}, set())
    assert alone.push_grad(0, 1, (g[2] + g[3]) / 2, 0.1) and alone.maybe_step({0}, set())
    assert_bit_equal(shard.table.state_dict(), alone.table.state_dict())
    assert shard.info()["nonfinite_skipped"] == {"1": 1}


@pytest.mark.parametrize("bad", BAD)
def test_async_and_geo_skip_a_nonfinite_push_and_leave_the_table_bit_equal(bad):
    sparse, dense = sparse_shard("async"), dense_shard("async")
    sparse_before, dense_before = sparse_state(sparse), dense.table.state_dict()
    assert sparse.push_grad(1, 4, IDS, grads(0, bad), 0.5)
    assert dense.push_grad(1, 4, torch.tensor([0.0, bad, 1.0, 2.0]), 0.1)
    assert dense.push_grad(0, 4, torch.ones(4), math.nan)
    assert_bit_equal(sparse_state(sparse), sparse_before)
    assert_bit_equal(dense.table.state_dict(), dense_before)
    assert sparse.version == dense.version == 0
    assert sparse.info()["nonfinite_skipped"] == {"1": 1} and dense.info()["nonfinite_skipped"] == {"0": 1, "1": 1}
    sparse, dense = sparse_shard("geo"), dense_shard("geo")
    sparse_before, dense_before = sparse_state(sparse), dense.table.state_dict()
    sparse.push_delta(IDS, grads(0, bad), step=3, worker=1)
    sparse.push_delta(IDS, grads(0), step=3, worker=0, clicks=torch.tensor([0.0, bad, 1.0]))
    dense.push_delta(torch.tensor([bad, 0.0, 0.0, 0.0]), worker=1, step=3)
    assert_bit_equal(sparse_state(sparse), sparse_before)
    assert_bit_equal(dense.table.state_dict(), dense_before)
    assert sparse.info()["nonfinite_skipped"] == {"0": 1, "1": 1} and dense.info()["nonfinite_skipped"] == {"1": 1}


def test_nonfinite_error_refuses_the_push_naming_table_worker_and_step():
    shard = sparse_shard("sync", nonfinite="error")
    before = sparse_state(shard)
    with pytest.raises(agg.ShardError, match=r"sparse table 0: worker 1's gradient for step 0 holds NaN or Inf"):
        shard.push_grad(1, 0, IDS, grads(0, math.nan), 0.5)
    assert_bit_equal(sparse_state(shard), before)
    dense = dense_shard("geo", nonfinite="error")
    with pytest.raises(agg.ShardError, match=r"dense table 1: worker 0's delta for step 2 holds NaN or Inf"):
        dense.push_delta(torch.tensor([math.inf, 0.0, 0.0, 0.0]), worker=0, step=2)
    with pytest.raises(agg.ShardError, match="nonfinite='sometimes'"):
        sparse_shard("sync", nonfinite="sometimes")


# --- one process, collective ---------------------------------------------------------

STEPS, BAD_STEPS, VOCAB = 5, {1: math.nan, 3: math.inf}, 20


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, VOCAB, (6, 2), generator=g), torch.randn(6, generator=g)


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = fleet.nn.SparseEmbedding(3, seed=1)
        self.head = torch.nn.Linear(6, 1)

    def forward(self, ids: torch.Tensor, poison: float | None = None) -> torch.Tensor:
        rows = self.emb(ids)
        if poison is not None:  # a non-finite gradient reaches the rows only; the dense head's stays finite
            rows.register_hook(lambda g: g + poison)
        return self.head(rows.flatten(1)).squeeze(1)


def _train(workers: int, rank: int, poison: bool, skip: bool) -> dict[str, torch.Tensor]:
    """``poison``: the last worker's row gradient is non-finite at BAD_STEPS; ``skip``: no table step there
    (what the table must equal). One process (``workers`` 1) trains on the union of the batches."""
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.3)
    if workers > 1:
        opt = fleet.distributed_optimizer(opt)
    for step in range(STEPS):
        parts = [_batch(step, r) for r in range(2)] if workers == 1 else [_batch(step, rank)]
        ids, target = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        bad = poison and step in BAD_STEPS and (workers == 1 or rank == workers - 1)
        opt.zero_grad()
        out = model(ids, BAD_STEPS[step] if bad else None)
        torch.nn.functional.mse_loss(out, target).backward()
        if skip and step in BAD_STEPS:
            model.emb.take_gradients()  # the rows' gradients of this step are dropped: no table step
        opt.step()
    model.eval()
    return {"rows": model.emb(torch.arange(VOCAB)).detach(), **model.head.state_dict()}


def test_one_process_skips_a_nonfinite_table_step_bit_equal_to_no_step(monkeypatch):
    fleet.api._reset_for_tests()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        poisoned = _train(1, 0, poison=True, skip=False)
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(said) == len(BAD_STEPS), said
    assert "sparse table of SparseEmbedding(dim 3) at step 2: the update holds NaN or Inf and was skipped" in said[0]
    reference = _train(1, 0, poison=False, skip=True)
    assert all(torch.isfinite(v).all() for v in poisoned.values())
    for key in poisoned:
        assert torch.equal(poisoned[key], reference[key]), key
    monkeypatch.setattr(nonfinite, "policy", lambda: "error")
    with pytest.raises(
        NonFiniteUpdateError, match=r"sparse table of SparseEmbedding\(dim 3\) at step 2: .*nonfinite='error'"
    ):
        _train(1, 0, poison=True, skip=False)


def _collective(rank: int) -> dict:
    import fleet as f

    f.init()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _train(2, rank, poison=True, skip=False)
    return {"values": got, "skipped": sum("NaN or Inf" in str(w.message) for w in caught)}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_collective_skips_the_step_of_a_table_whose_exchanged_gradient_is_nonfinite_on_every_worker():
    """Worker 1's row gradient is NaN (step 1) or Inf (step 3): the exchanged sum holds it on both workers, so
    both skip the table's step; the rows stay finite and equal on both, and equal a run with no such step."""
    results = run_workers(_collective, 2, timeout=100)
    assert [r["skipped"] for r in results] == [len(BAD_STEPS)] * 2
    a, b = results[0]["values"], results[1]["values"]
    assert all(torch.isfinite(v).all() for v in a.values())
    for key in a:
        assert torch.equal(a[key], b[key]), key
    fleet.api._reset_for_tests()
    reference = _train(1, 0, poison=False, skip=True)  # one process, the union, no table step at BAD_STEPS
    torch.testing.assert_close(a["rows"], reference["rows"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_finite_tells_an_overflowing_sum_of_finite_values_from_a_nan_or_inf(dtype):
    big = torch.full((1000,), torch.finfo(dtype).max / 2, dtype=dtype)  # finite, but their sum overflows
    assert nonfinite.finite(big) and nonfinite.finite(-big) and nonfinite.finite(big, 0.1, None)
    for bad in (math.nan, math.inf, -math.inf):
        for where in (0, 537, 999):
            t = torch.randn(1000).to(dtype)
            t[where] = bad
            assert not nonfinite.finite(t), (dtype, bad, where)
            assert not nonfinite.finite(big, t)
    assert not nonfinite.finite(torch.ones(3), math.nan)
    both = torch.tensor([math.inf, -math.inf], dtype=dtype)  # inf - inf: still not finite
    assert not nonfinite.finite(both)
