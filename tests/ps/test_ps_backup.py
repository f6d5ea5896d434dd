"""Sync with backup workers (TensorFlow SyncReplicasOptimizer semantics): a delayed worker does not hold the others."""

from __future__ import annotations

import time

import pytest
import torch

from ps_jobs import Net, batch, make_optimizer, run_job

pytestmark = pytest.mark.multiprocess  # every test here starts processes

DELAY_S = 0.3  # the slow worker's extra time per step
FAST_S = 0.04  # the others' (so that their steps overlap the slow worker's for a while)


def train_with_straggler(rank: int, steps: int, slow: int) -> dict:
    """Worker ``slow`` sleeps DELAY_S before each step's push, the others FAST_S."""
    import fleet

    try:
        fleet.init()
    except SystemExit as stop:
        return {"served": stop.code}
    me = fleet.worker_index()
    torch.manual_seed(100 + me)
    model = Net()
    opt = fleet.distributed_optimizer(make_optimizer("plain", model.parameters()))
    loss_fn = torch.nn.BCEWithLogitsLoss()
    losses = []
    start = time.monotonic()
    for step in range(steps):
        ids, dense, label = batch(step % 10, me)  # ten batches per worker, seen again and again
        opt.zero_grad()
        loss = loss_fn(model(ids, dense), label)
        loss.backward()
        time.sleep(DELAY_S if me == slow else FAST_S)
        opt.step()
        losses.append(loss.item())
    elapsed = time.monotonic() - start
    fleet.barrier_worker()  # the fast workers wait here for the slow one; its steps must not wait for them
    out = {
        "losses": losses,
        "elapsed": elapsed,
        "stale_dropped": opt.stale_dropped,
        "metrics": (opt.metrics.dropped_stale, opt.metrics.steps),
        "stats": opt.client.stats().result(),
    }
    fleet.stop_worker()
    return out


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("servers", [1, 2])
def test_backup_worker_lets_the_others_advance_and_drops_the_late_gradients(servers: int) -> None:
    steps, slow = 24, 2
    strategy = {"update": "sync", "backup_workers": 1}
    results = run_job(train_with_straggler, servers, 3, strategy, steps, slow, timeout=100)
    slow_pace = DELAY_S * steps
    assert results[slow]["elapsed"] >= slow_pace
    for worker in (0, 1):
        # the two fast workers close every step between them: far below the slow worker's pace
        assert results[worker]["elapsed"] < 0.5 * slow_pace, [r["elapsed"] for r in results]
        losses = results[worker]["losses"]
        assert _mean(losses[-5:]) < _mean(losses[:5]) - 0.05, (worker, [round(x, 3) for x in losses])
    # the slow worker's gradients were mostly late: dropped, counted on the servers and on the worker
    assert results[slow]["stale_dropped"] > 0
    for result in results:  # the step metrics (fleetrun's end-of-run report) carry the same count
        assert result["metrics"][0] == result["stale_dropped"], result["metrics"]
    for worker, result in enumerate(results):
        on_servers = sum(s["stale_dropped"].get(str(worker), 0) for s in results[0]["stats"])
        assert on_servers == result["stale_dropped"], (worker, on_servers, result["stale_dropped"])
    # each table advanced once per step the fast workers made (plus the late worker's lone steps at the end)
    for server in results[0]["stats"]:
        for table in server["tables"].values():
            assert table["version"] >= steps, table
    # the slow worker trains on the current values the fast ones made, not on its own stale line
    losses = results[slow]["losses"]
    assert _mean(losses[-5:]) < _mean(losses[:5]) - 0.05, (slow, [round(x, 3) for x in losses])


@pytest.mark.timeout(60)
def test_without_backup_workers_sync_waits_for_the_slowest() -> None:
    steps, slow = 4, 1
    results = run_job(train_with_straggler, 1, 2, {"update": "sync"}, steps, slow, timeout=50)
    for result in results:
        assert result["elapsed"] >= DELAY_S * steps * 0.9
        assert result["stale_dropped"] == 0
