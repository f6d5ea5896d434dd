"""Parameter-server strategy end to end: servers and workers as processes with fleetrun's environment."""

from __future__ import annotations

import pytest
import torch

from ps_jobs import reference, run_job, train

pytestmark = pytest.mark.multiprocess  # every test here starts processes


def _assert_matches(results: list, ref: dict) -> None:
    for worker, result in enumerate(results):
        for name, want in ref.items():
            got = result["snapshot"][name]
            assert torch.allclose(got, want, atol=1e-5), f"worker {worker} {name}: {(got - want).abs().max()}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("opt_name", "servers", "workers"),
    [
        ("sgd", 1, 2),
        ("adam", 2, 3),
        ("sgd+steplr", 2, 2),
        ("plain+adagrad_rows", 1, 2),
        ("sgd+life+cap", 1, 2),  # admission, TTL, max_rows and clicks: the same table as one process
        ("adam+life", 2, 2),
    ],
)
def test_sync_equals_single_process_on_union(opt_name: str, servers: int, workers: int) -> None:
    results = run_job(train, servers, workers, {"update": "sync"}, opt_name, 6)
    _assert_matches(results, reference(opt_name, 6, workers))


def _learned(result: dict) -> bool:
    losses = result["losses"]
    return sum(losses[-10:]) / 10 < 0.35  # from about 0.69 at the start


@pytest.mark.timeout(120)
def test_async_reaches_a_lower_loss_on_every_worker() -> None:
    results = run_job(train, 1, 2, {"update": "async"}, "plain+prefetch", 60)
    for worker, result in enumerate(results):
        assert _learned(result), (worker, [round(x, 3) for x in result["losses"]])


@pytest.mark.timeout(120)
def test_geo_learns_and_pushes_only_every_k_steps() -> None:
    steps, k = 60, 5
    results = run_job(train, 2, 2, {"update": "geo", "k_steps": k}, "plain", steps, True)
    for worker, result in enumerate(results):
        assert _learned(result), (worker, [round(x, 3) for x in result["losses"]])
    for server in results[0]["stats"]:
        ops = server["ops"]
        # 2 workers x (steps / k) syncs x 1 dense table; sparse deltas go to the servers owning touched rows
        assert ops.get("PUSH_DENSE_DELTA") == 2 * steps // k, ops
        assert ops.get("PUSH_SPARSE_DELTA", 0) <= 2 * steps // k, ops
        assert "PUSH_DENSE_GRAD" not in ops and "PUSH_SPARSE_GRAD" not in ops, ops


@pytest.mark.timeout(150)
def test_checkpoint_save_stop_load_resume_equals_uninterrupted(tmp_path) -> None:
    from ps_jobs import train_resumable

    ckpt = str(tmp_path / "ckpt")
    whole = run_job(train_resumable, 2, 2, {"update": "sync"}, "adam", 8, None, None, ckpt)
    run_job(train_resumable, 2, 2, {"update": "sync"}, "adam", 8, 4, None, ckpt)
    resumed = run_job(train_resumable, 2, 2, {"update": "sync"}, "adam", 8, 4, ckpt, ckpt)
    _assert_matches(resumed, whole[0]["snapshot"])
    _assert_matches(whole, reference("adam", 8, 2))


@pytest.mark.timeout(120)
def test_sparse_embedding_in_collective_mode_equals_single_process_on_union() -> None:
    from dist_harness import run_workers
    from ps_jobs import train_collective

    results = run_workers(train_collective, 2, "sgd", 5)
    _assert_matches(results, reference("sgd", 5, 2))


@pytest.mark.timeout(120)
def test_sparse_life_cycle_in_collective_mode_equals_single_process_on_union() -> None:
    from dist_harness import run_workers
    from ps_jobs import train_collective

    results = run_workers(train_collective, 2, "adam+life+cap", 8)
    want = reference("adam+life+cap", 8, 2)
    assert 0 < int(want["num_rows"]) <= 30
    _assert_matches(results, want)
