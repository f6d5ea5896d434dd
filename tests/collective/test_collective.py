"""Collective sync data parallelism equals single-process training on the union of the batches."""

from __future__ import annotations

import pytest
import torch

from dist_harness import run_workers

pytestmark = pytest.mark.multiprocess  # every test here starts processes

STEPS = 4
BATCH = 8


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + worker)
    return torch.randn(BATCH, 6, generator=generator), torch.randint(0, 3, (BATCH,), generator=generator)


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    if name == "plain-sgd":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.Adam(params, lr=0.01)


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def reference(workers: int, optimizer: str, steps: int = STEPS, micro: int = 1) -> torch.Tensor:
    """Single process, worker 0's initial weights, every step on the union of all workers' batches."""
    model = make_model(0)
    opt = make_optimizer(optimizer, model.parameters())
    for step in range(steps):
        opt.zero_grad()
        xs, ys = zip(*(batch(w, step * micro + m) for w in range(workers) for m in range(micro)), strict=True)
        torch.nn.functional.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return flat(model)


def train_worker(rank: int, optimizer: str, strategy_kwargs: dict, steps: int = STEPS, micro: int = 1, stop=True):
    import fleet

    fleet.init()
    model = make_model(seed=rank)  # deliberately different initial weights on every worker
    opt = fleet.distributed_optimizer(
        make_optimizer(optimizer, model.parameters()), fleet.DistributedStrategy(**strategy_kwargs)
    )
    assert isinstance(opt, torch.optim.Optimizer)
    trajectory = [flat(model)]
    for step in range(steps):
        for m in range(micro):
            opt.zero_grad()
            x, y = batch(rank, step * micro + m)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        trajectory.append(flat(model))
    if stop:
        fleet.stop_worker()
    return trajectory


def both_optimizers_worker(rank: int, strategy_kwargs: dict) -> dict:
    """One job: SGD, then Adam, on fresh models (the job's synchroniser lets go of the first)."""
    import fleet

    out = {optimizer: train_worker(rank, optimizer, strategy_kwargs, stop=False) for optimizer in ("sgd", "adam")}
    fleet.stop_worker()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("workers", "shared_memory"), [(2, True), (3, True), (2, False)], ids=["2-shm", "3-shm", "2-process-group"]
)
def test_sync_equals_single_process_on_union(workers, shared_memory):
    strategy = {"bucket_mb": 0.0005, "shared_memory": shared_memory}
    results = run_workers(both_optimizers_worker, workers, strategy)
    for optimizer in ("sgd", "adam"):
        trajectories = [result[optimizer] for result in results]
        for step in range(STEPS + 1):
            for rank in range(1, workers):
                assert torch.equal(trajectories[rank][step], trajectories[0][step]), f"worker {rank} differs at {step}"
        assert torch.allclose(trajectories[0][-1], reference(workers, optimizer), atol=1e-5), optimizer
        assert torch.equal(trajectories[0][0], flat(make_model(0))), "initial weights must come from worker 0"


@pytest.mark.timeout(90)
def test_gradient_accumulation_equals_one_step_on_the_union():
    trajectories = run_workers(train_worker, 2, "sgd", {"grad_accumulation_steps": 3}, 2, 3)
    assert torch.equal(trajectories[0][-1], trajectories[1][-1])
    assert torch.allclose(trajectories[0][-1], reference(2, "sgd", steps=2, micro=3), atol=1e-5)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("compression, tolerance", [("fp16", 2e-3), ("bf16", 2e-2)])
def test_compressed_gradients_stay_within_tolerance(compression, tolerance):
    trajectories = run_workers(train_worker, 2, "sgd", {"grad_compression": compression})
    assert torch.equal(trajectories[0][-1], trajectories[1][-1])
    expected = reference(2, "sgd")
    assert (trajectories[0][-1] - expected).abs().max() < tolerance
    assert not torch.equal(trajectories[0][-1], expected) or compression == "none"


@pytest.mark.timeout(90)
def test_local_sgd_averages_parameters_every_k_steps():
    k = 2
    trajectories = run_workers(train_worker, 2, "sgd", {"local_sgd_steps": k}, 4)
    for step in range(1, 5):
        same = torch.equal(trajectories[0][step], trajectories[1][step])
        assert same == (step % k == 0), f"step {step}: parameters equal={same}"
    # Between averages each worker trains alone: replay worker-local SGD and average by hand.
    models = [make_model(0) for _ in range(2)]
    opts = [make_optimizer("sgd", m.parameters()) for m in models]
    for step in range(k):
        for w, (model, opt) in enumerate(zip(models, opts, strict=True)):
            opt.zero_grad()
            x, y = batch(w, step)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    averaged = (flat(models[0]) + flat(models[1])) / 2
    assert torch.allclose(trajectories[0][k], averaged, atol=1e-6)


def sparse_sum_worker(rank):
    import torch.distributed as dist

    import fleet
    from fleet.collective import sparse_grads

    fleet.init()
    rows = torch.tensor([[1, 3, 3, 7][rank:][:3]])  # overlapping and repeated rows, a different count per worker
    mine = torch.sparse_coo_tensor(rows, torch.ones(rows.shape[1], 2) * (rank + 1), (10, 2)).coalesce()
    gathered = sparse_grads.gather_sum(mine, dist.group.WORLD)  # the path for backends without sparse all-reduce
    reduced = mine.clone()
    dist.all_reduce(reduced)  # gloo's own sparse all-reduce
    fleet.stop_worker()
    return gathered.to_dense(), reduced.to_dense()


def test_sparse_gradients_sum_the_same_by_all_gather_as_by_gloo():
    for gathered, reduced in run_workers(sparse_sum_worker, 2):
        assert torch.equal(gathered, reduced) and gathered.sum() > 0


def dropped_optimizer_worker(rank: int) -> torch.Tensor:
    """Drop an optimizer kept alive by a reference cycle; worker 0's gc frees it in the middle of a round."""
    import gc

    import fleet

    fleet.init(strategy=fleet.DistributedStrategy(timeout_s=20))
    gc.disable()  # only the explicit collection below frees the dropped optimizer
    try:
        old = make_model(seed=rank)
        holder: list = [fleet.distributed_optimizer(torch.optim.SGD(old.parameters(), lr=0.1))]
        holder.append(holder)  # a cycle, as an LR scheduler makes: the optimizer outlives the script's reference
        x, y = batch(rank, 99)
        torch.nn.functional.cross_entropy(old(x), y).backward()
        holder[0].step()
        del holder, old
        model = make_model(seed=rank)
        opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        for step in range(2):
            opt.zero_grad()
            x, y = batch(rank, step)
            hidden = model[1](model[0](x))
            if rank == 0 and step == 0:
                # Runs after the last layer's gradients started the round and before the first layer's.
                hidden.register_hook(lambda grad: (gc.collect(), grad)[1])
            torch.nn.functional.cross_entropy(model[2](hidden), y).backward()
            opt.step()
    finally:
        gc.enable()
    fleet.stop_worker()
    return flat(model)


@pytest.mark.timeout(90)
def test_a_dropped_optimizer_collected_mid_round_on_one_worker_changes_nothing():
    # Its parameters stay in the round's layout until the next refresh, with their old gradients:
    # they are not gradients "set by hand", which would start a catch-up round on that worker alone.
    results = run_workers(dropped_optimizer_worker, 2)
    assert torch.equal(results[0], results[1])
    assert torch.allclose(results[0], reference(2, "plain-sgd", steps=2), atol=1e-6)
