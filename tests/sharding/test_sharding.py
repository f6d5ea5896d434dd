"""mode="sharding" (FSDP2) equals single-process training on the union of the batches, and resumes across worker counts."""

from __future__ import annotations

import pytest
import torch

from dist_harness import run_workers
from patterns import batch, make_optimizer

pytestmark = pytest.mark.multiprocess


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)
    )


def _train_step(model, opt, scheduler, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    opt.zero_grad()
    losses = [torch.nn.functional.cross_entropy(model(x), y) for x, y in parts]
    (sum(losses) / len(losses)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # active: the norm of the averaged gradient
    opt.step()
    scheduler.step()


def reference(kind: str, plan: list[int]) -> list[torch.Tensor]:
    """One process; step ``s`` trains on the union of the batches of ``plan[s]`` workers."""
    model = make_model(0)
    opt = make_optimizer(kind, model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
    for step, workers in enumerate(plan):
        _train_step(model, opt, scheduler, [batch(w, step) for w in range(workers)])
    return [p.detach().clone() for p in model.parameters()]


def _full(model: torch.nn.Module) -> list[torch.Tensor]:
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]


def sharded_worker(
    rank: int,
    kind: str,
    stage: int,
    steps: range,
    plan: list[int],
    ckpt: str | None,
    save_at: int | None,
    stop: bool = True,
):
    import fleet

    fleet.init()
    model = make_model(seed=rank)  # different on every worker: worker 0's values must win
    opt = make_optimizer(kind, model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)  # built before wrapping
    # 3 workers: fleet's announcements through gloo, the path across hosts; 2: through shared memory.
    strategy = fleet.DistributedStrategy(mode="sharding", sharding_stage=stage, shared_memory=fleet.worker_num() != 3)
    opt = fleet.distributed_optimizer(opt, strategy)
    shards = [tuple(p.to_local().shape) for p in model.parameters() if hasattr(p, "to_local")]
    start = steps.start
    if ckpt is not None and start > 0:
        resumed = fleet.load_checkpoint(ckpt, model, opt)
        assert resumed is not None and resumed.step == start
        scheduler.last_epoch = start  # the scheduler's own position is the script's to keep
    for step in steps:
        _train_step(model, opt, scheduler, [batch(rank, step)])
        if save_at is not None and step + 1 == save_at:
            fleet.save_checkpoint(ckpt, model, opt, step + 1)
    out = {"params": _full(model), "shards": shards, "lr": opt.param_groups[0]["lr"], "comms": _comms(model)}
    if stop:
        fleet.stop_worker()
    return out


def _comms(model: torch.nn.Module) -> set[str]:
    """The classes of the collectives FSDP2 runs for ``model``'s units."""
    groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if hasattr(m, "_get_fsdp_state")]
    return {type(c).__name__ for g in groups if g is not None for c in (g._all_gather_comm, g._reduce_scatter_comm)}


def both_optimizers_worker(rank: int, stage: int, steps: int, workers: int) -> dict:
    """One job, one strategy: a model with SGD, then another with Adam (each sharded when wrapped)."""
    return {
        kind: sharded_worker(rank, kind, stage, range(steps), [workers] * steps, None, None, stop=kind == "adam")
        for kind in ("sgd", "adam")
    }


@pytest.mark.timeout(150)
@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("stage", [2, 3])
def test_sharding_equals_single_process_on_union(workers, stage):
    steps = 4
    results = run_workers(both_optimizers_worker, workers, stage, steps, workers, timeout=120)
    for kind in ("sgd", "adam"):
        want = reference(kind, [workers] * steps)
        for rank, result in enumerate(results):
            got_all = result[kind]
            for got, expected in zip(got_all["params"], want, strict=True):
                assert torch.allclose(got, expected, atol=1e-5), (kind, rank, (got - expected).abs().max())
            lr = make_optimizer(kind, [torch.zeros(1)]).param_groups[0]["lr"]
            assert got_all["lr"] == pytest.approx(0.8**steps * lr)
        # 2 workers on one host: shared memory; 3 (shared_memory=False): gloo, timed as communication
        want_comms = {"SharedMemoryAllGather", "SharedMemoryReduceScatter"} if workers == 2 else \
            {"TimedAllGather", "TimedReduceScatter"}  # fmt: skip
        assert all(result[kind]["comms"] == want_comms for result in results), [r[kind]["comms"] for r in results]
        first_weight = results[0][kind]["shards"][0]
        assert first_weight[0] == -(-16 // workers), "each worker holds its share of the rows, not the whole weight"


@pytest.mark.timeout(200)
def test_a_checkpoint_saved_by_two_workers_resumes_with_three(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    plan = [2, 2, 3, 3]  # two steps on two workers, then two on three
    run_workers(sharded_worker, 2, "adam", 3, range(2), plan, ckpt, 2, timeout=120)
    resumed = run_workers(sharded_worker, 3, "adam", 3, range(2, 4), plan, ckpt, None, timeout=120)
    want = reference("adam", plan)
    for result in resumed:
        for got, expected in zip(result["params"], want, strict=True):
            assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()


@pytest.mark.timeout(150)
def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    whole = run_workers(sharded_worker, 2, "sgd", 2, range(4), [2] * 4, None, None, timeout=120)
    run_workers(sharded_worker, 2, "sgd", 2, range(2), [2] * 4, ckpt, 2, timeout=120)
    resumed = run_workers(sharded_worker, 2, "sgd", 2, range(2, 4), [2] * 4, ckpt, None, timeout=120)
    for a, b in zip(whole, resumed, strict=True):
        for x, y in zip(a["params"], b["params"], strict=True):
            assert torch.allclose(x, y, atol=1e-6)


def sparse_embedding_worker(rank: int, steps: int) -> dict:
    """A model with a fleet.nn.SparseEmbedding (with a life cycle): its dense part is sharded, its rows kept whole."""
    import fleet
    from ps_jobs import batch, feed_clicks, make_model, make_optimizer, snapshot

    fleet.init()
    torch.manual_seed(100 + rank)
    model = make_model("sgd+life+cap")
    opt = fleet.distributed_optimizer(
        make_optimizer("sgd", model.parameters()), fleet.DistributedStrategy(mode="sharding")
    )
    for step in range(steps):
        ids, dense, label = batch(step, rank)
        opt.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(model(ids, dense), label).backward()
        feed_clicks("sgd+life+cap", model, label)
        opt.step()
    for module in model.mlp:  # gather the sharded weights back to compare them
        for name, p in list(module.named_parameters()):
            if hasattr(p, "full_tensor"):
                setattr(module, name, torch.nn.Parameter(p.full_tensor()))
    out = {**snapshot(model), "num_rows": torch.tensor(model.emb.num_rows())}
    fleet.stop_worker()
    return out


@pytest.mark.timeout(120)
def test_sparse_embedding_rows_train_with_the_sharded_model():
    from ps_jobs import reference

    results = run_workers(sparse_embedding_worker, 2, 5, timeout=90)
    want = reference("sgd+life+cap", 5, 2)
    for result in results:
        for name, expected in want.items():
            assert torch.allclose(result[name], expected, atol=1e-5), (name, (result[name] - expected).abs().max())


def mixed_precision_worker(rank: int) -> dict:
    import fleet

    fleet.init()
    model = make_model(seed=0)
    opt = make_optimizer("adam", model.parameters())
    strategy = fleet.DistributedStrategy(mode="sharding", mixed_precision="bf16", shard_modules=["Linear"])
    opt = fleet.distributed_optimizer(opt, strategy)
    losses = []
    for step in range(30):
        x, y = batch(rank, step % 3)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    dtypes = {str(p.dtype) for p in model.parameters()}
    out = {"losses": losses, "params": _full(model), "dtypes": dtypes}
    fleet.stop_worker()
    return out


def mixed_precision_reference(steps: int, workers: int) -> tuple[list[list[float]], list[torch.Tensor]]:
    """Float32 single-process training on the union; per-step losses of every worker's part."""
    model = make_model(seed=0)
    opt = make_optimizer("adam", model.parameters())
    losses = []
    for step in range(steps):
        opt.zero_grad()
        parts = [
            torch.nn.functional.cross_entropy(model(x), y) for x, y in (batch(w, step % 3) for w in range(workers))
        ]
        (sum(parts) / workers).backward()
        opt.step()
        losses.append([part.item() for part in parts])
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(120)
def test_mixed_precision_computes_in_bf16_keeps_float32_parameters_and_tracks_float32_training():
    results = run_workers(mixed_precision_worker, 2, timeout=90)
    want_losses, want_params = mixed_precision_reference(30, 2)
    for rank, result in enumerate(results):
        assert result["dtypes"] == {"torch.float32"}  # the sharded parameters stay float32; compute is bf16
        got = torch.tensor(result["losses"])
        want = torch.tensor([step[rank] for step in want_losses])
        assert not torch.equal(got, want)  # bf16 rounding shows: the compute really ran in bf16
        assert (got - want).abs().max() < 0.05, (got - want).abs().max()
        for got_param, want_param in zip(result["params"], want_params, strict=True):
            assert (got_param - want_param).abs().max() < 0.05
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(a, b)
