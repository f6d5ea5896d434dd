"""Uneven data: equal shares of an IterableDataset, fleet.join(), and a clear error without it."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

import patterns
from dist_harness import fleetrun_env, free_port, run_fleetrun, run_processes, run_workers
from fleet.data.loader import shard_loader

# --- IterableDataset through distributed_loader ---------------------------------------------------


class Stream(IterableDataset):
    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("samples", [9, 10, 11, 12])
@pytest.mark.parametrize("drop_last", [False, True])
def test_iterable_dataset_gives_every_worker_the_same_number_of_batches(workers, samples, drop_last):
    loader = DataLoader(Stream(samples), batch_size=2, drop_last=drop_last)
    shares = [[b.tolist() for b in shard_loader(loader, workers, r)] for r in range(workers)]
    counts = {len(share) for share in shares}
    assert len(counts) == 1, shares
    batches = [b.tolist() for b in loader]
    rounds, rest = divmod(len(batches), workers)
    assert counts == {rounds + (1 if rest and not drop_last else 0)}
    for rank, share in enumerate(shares):  # round-robin, the last partial round padded from the start
        padded = batches + (batches * workers)[: (workers - rest) % workers if not drop_last else 0]
        assert share == padded[rank::workers][: len(share)]


# --- fleet.join() ----------------------------------------------------------------------------------

STEPS = {2: [5, 3], 3: [5, 2, 4]}


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _loss(model: nn.Module, worker: int, step: int) -> torch.Tensor:
    x, y = patterns.batch(worker, step)
    return torch.nn.functional.cross_entropy(model(x), y)


def join_worker(rank: int, kind: str, steps: list[int]) -> dict:
    import fleet

    fleet.init()
    torch.manual_seed(patterns.SEED + rank)
    model = _model()
    opt = fleet.distributed_optimizer(patterns.make_optimizer(kind, model.parameters()))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    with fleet.join():
        for step in range(steps[rank]):
            opt.zero_grad()
            _loss(model, rank, step).backward()
            opt.step()
            scheduler.step()
    out = {"params": [p.detach().clone() for p in model.parameters()], "lr": opt.param_groups[0]["lr"]}
    fleet.stop_worker()
    return out


def join_reference(kind: str, steps: list[int]) -> list[torch.Tensor]:
    """One process; at each step the union of the batches of the workers that still have one."""
    torch.manual_seed(patterns.SEED)
    model = _model()
    opt = patterns.make_optimizer(kind, model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for step in range(max(steps)):
        active = [w for w, n in enumerate(steps) if n > step]
        opt.zero_grad()
        (sum(_loss(model, w, step) for w in active) / len(active)).backward()
        opt.step()
        scheduler.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_join_equals_single_process_on_the_batches_each_step_has(workers, kind):
    steps = STEPS[workers]
    results = run_workers(join_worker, workers, kind, steps)
    want = join_reference(kind, steps)
    for rank, result in enumerate(results):
        for got, expected in zip(result["params"], want, strict=True):
            assert torch.allclose(got, expected, atol=1e-5), (rank, (got - expected).abs().max())
        # the last trainer's optimizer state, learning rate included, reaches every worker
        initial = patterns.make_optimizer(kind, [torch.zeros(1, requires_grad=True)]).param_groups[0]["lr"]
        assert result["lr"] == pytest.approx(initial * 0.5 ** (max(steps) // 2))


def join_extras_worker(rank: int, steps: list[int]) -> dict:
    """distributed_model buffers and fleet.nn.SparseEmbedding rows are shadowed too."""
    import fleet
    from ps_jobs import Net, all_ids, batch

    fleet.init()
    torch.manual_seed(100)
    net = Net()
    norm = fleet.distributed_model(nn.BatchNorm1d(5))
    opt = fleet.distributed_optimizer(torch.optim.SGD([*net.parameters(), *norm.parameters()], lr=0.1))
    with fleet.join():
        for step in range(steps[rank]):
            ids, dense, label = batch(step, rank)
            opt.zero_grad()
            logits = net(ids, norm(dense))
            torch.nn.functional.binary_cross_entropy_with_logits(logits, label).backward()
            opt.step()
    net.eval()
    with torch.no_grad():
        rows = net.emb(all_ids()).clone()
    out = {"rows": rows, "state": {k: v.clone() for k, v in [*net.state_dict().items(), *norm.state_dict().items()]}}
    fleet.stop_worker()
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_join_shadows_buffer_broadcasts_and_sparse_embedding_rows():
    results = run_workers(join_extras_worker, 3, [4, 2, 3])
    for result in results[1:]:
        assert torch.equal(result["rows"], results[0]["rows"])
        for key, value in results[0]["state"].items():
            assert torch.equal(result["state"][key], value), key


# --- without fleet.join(): a clear error, fast --------------------------------------------------------


def early_end_worker(rank: int, how: str) -> tuple[str, str, float]:
    import fleet

    fleet.init(strategy=fleet.DistributedStrategy(timeout_s=60))
    model = _model()
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    started = time.monotonic()
    try:
        for step in range(5 if rank == 0 else 3):
            opt.zero_grad()
            _loss(model, rank, step).backward()
            opt.step()
        getattr(fleet, how)()
    except fleet.PeerError as error:
        return ("PeerError", str(error), time.monotonic() - started)
    return ("finished", "", time.monotonic() - started)


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["barrier_worker", "stop_worker"])
def test_a_loop_that_ends_early_is_named_within_seconds(how):
    port = free_port()
    outcome = run_processes(early_end_worker, [fleetrun_env(r, 2, port) for r in range(2)], how, timeout=60)
    import io

    results = [torch.load(io.BytesIO(value), weights_only=False) for status, value in outcome]
    for rank, (kind, message, seconds) in enumerate(results):
        assert kind == "PeerError", (rank, kind, message)
        assert "worker 1 (after 3 steps) finished its training loop early" in message, message
        assert "fleet.join()" in message and seconds < 20, (message, seconds)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_under_fleetrun_a_worker_whose_script_ends_early_is_named(tmp_path):
    from pathlib import Path

    script = Path(__file__).parents[1] / "scripts" / "uneven_train.py"
    started = time.monotonic()
    r = run_fleetrun("--workers", 2, "--log-dir", tmp_path / "logs", script, cwd=tmp_path, timeout=90)
    assert r.returncode != 0, r.stdout + r.stderr
    assert "worker 1 (after 2 steps) finished its training loop early" in r.stdout, r.stdout
    assert time.monotonic() - started < 60
