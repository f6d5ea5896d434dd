"""Row-wise Adagrad (fleet.nn.RowWiseAdagrad): fleet's sparse rows against the same math in plain torch."""

from __future__ import annotations

import pytest
import torch

import fleet
from fleet.sparse.optim import OptimizerSpec, ServerOptimizer
from fleet.sparse.table import SparseTable

DIM, STEPS = 5, 6


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 12, (9,), generator=g) * 101 - 50 for _ in range(STEPS)]  # repeats within a batch


def _target(ids: torch.Tensor) -> torch.Tensor:
    return torch.sin(ids.to(torch.float32)).unsqueeze(1) * torch.arange(1.0, DIM + 1)


def _plain_torch(batches: list[torch.Tensor], kwargs: dict) -> dict[int, torch.Tensor]:
    """Row-wise Adagrad written out in plain torch on a dense [ids, dim] table (per-row step counts)."""
    lr, eps = kwargs["lr"], kwargs.get("eps", 1e-10)
    wd, decay = kwargs.get("weight_decay", 0.0), kwargs.get("lr_decay", 0.0)
    all_ids = torch.unique(torch.cat(batches))
    weight = fleet.nn.SparseEmbedding(DIM, seed=4)(all_ids).detach().clone().requires_grad_(True)
    acc = torch.full((all_ids.numel(), 1), kwargs.get("initial_accumulator_value", 0.0))
    steps = torch.zeros(all_ids.numel())
    for ids in batches:
        pos = torch.searchsorted(all_ids, ids)
        weight.grad = None
        ((weight[pos] - _target(ids)) ** 2).sum().backward()
        with torch.no_grad():
            rows = torch.unique(pos)
            g = weight.grad[rows] + wd * weight[rows]
            steps[rows] += 1
            acc[rows] += g.square().mean(dim=1, keepdim=True)
            clr = lr / (1 + (steps[rows] - 1) * decay)
            weight[rows] -= clr.unsqueeze(1) * g / (acc[rows].sqrt() + eps)
    return {int(i): weight[k].detach() for k, i in enumerate(all_ids)}


@pytest.mark.parametrize(
    "kwargs",
    [{"lr": 0.3}, {"lr": 0.2, "lr_decay": 0.05, "weight_decay": 0.01, "initial_accumulator_value": 0.1, "eps": 1e-6}],
)
def test_rows_equal_plain_torch_in_one_process(kwargs: dict) -> None:
    batches = _batches()
    emb = fleet.nn.SparseEmbedding(DIM, seed=4)
    opt = fleet.nn.RowWiseAdagrad(emb.parameters(), **kwargs)
    for ids in batches:
        opt.zero_grad()
        ((emb(ids) - _target(ids)) ** 2).sum().backward()
        opt.step()
    want = _plain_torch(batches, kwargs)
    got = emb(torch.tensor(sorted(want))).detach()
    assert torch.allclose(got, torch.stack([want[i] for i in sorted(want)]), atol=1e-6, rtol=0)
    table = emb.local.table
    assert table.optimizer.kind == "rowwise_adagrad"
    assert table.state_width == 1  # one accumulator per row, not DIM


def test_torch_optimizer_rows_and_dense() -> None:
    """As a plain torch optimizer: sparse gradients step rows (as fleet's table), dense ones as torch's Adagrad."""
    torch.manual_seed(0)
    batches = _batches()
    all_ids = torch.unique(torch.cat(batches))
    table = torch.nn.Embedding(all_ids.numel(), DIM, sparse=True)
    table.weight.data.copy_(fleet.nn.SparseEmbedding(DIM, seed=4)(all_ids).detach())
    linear, linear_ref = torch.nn.Linear(DIM, 2), torch.nn.Linear(DIM, 2)
    linear_ref.load_state_dict(linear.state_dict())
    kwargs = {"lr": 0.3, "weight_decay": 0.01, "initial_accumulator_value": 0.1}
    opt = fleet.nn.RowWiseAdagrad([*table.parameters(), *linear.parameters()], **kwargs)
    ref = torch.optim.Adagrad(linear_ref.parameters(), **kwargs)
    for ids in batches:
        pos = torch.searchsorted(all_ids, ids)
        opt.zero_grad()
        ref.zero_grad()
        ((table(pos) - _target(ids)) ** 2).sum().backward()
        x = _target(ids)
        linear(x).square().sum().backward()
        linear_ref(x).square().sum().backward()
        opt.step()
        ref.step()
    want = _plain_torch(batches, kwargs)
    assert torch.allclose(table.weight.detach(), torch.stack([want[int(i)] for i in all_ids]), atol=1e-6, rtol=0)
    for p, q in zip(linear.parameters(), linear_ref.parameters(), strict=True):
        assert torch.equal(p, q)
    assert opt.state[table.weight]["row_sum"].shape == (all_ids.numel(),)


def test_spec_mapping_and_overrides() -> None:
    group = {"lr": 0.1, "lr_decay": 0.0, "eps": 1e-10, "weight_decay": 0.0, "initial_accumulator_value": 0.0}
    rows = OptimizerSpec.from_torch(fleet.nn.RowWiseAdagrad, group, rows=True)
    assert rows.kind == "rowwise_adagrad" and rows.eps == 1e-10
    assert OptimizerSpec.from_torch(fleet.nn.RowWiseAdagrad, group).kind == "adagrad"  # dense parameters
    emb = fleet.nn.SparseEmbedding(DIM, optimizer=(fleet.nn.RowWiseAdagrad, {"lr": 0.05}))
    assert emb.optimizer_override.kind == "rowwise_adagrad"
    with pytest.raises(ValueError, match="optimizer RMSprop is not supported as a SparseEmbedding's optimizer"):
        fleet.nn.SparseEmbedding(DIM, optimizer=(torch.optim.RMSprop, {"lr": 0.1}))
    spec = OptimizerSpec.from_config({"kind": "rowwise_adagrad", "lr": 0.1})
    assert spec.eps == 1e-10 and ServerOptimizer(spec).state_width == 1
    with pytest.raises(ValueError, match="not a dense block"):
        ServerOptimizer(spec).update(torch.zeros(4), torch.ones(4), {"sum": torch.zeros(4)}, 1, 0.1)


def test_table_saves_round_trip_with_one_accumulator_per_row() -> None:
    spec = OptimizerSpec(kind="rowwise_adagrad", lr=0.1)
    table = SparseTable(DIM, spec, seed=2)
    ids = torch.tensor([3, 9, 3, 40])
    table.apply_gradient(ids, torch.randn(4, DIM), 0.1)
    state = table.state_dict()
    assert state["state.sum"].shape == (3, 1)
    copy = SparseTable(DIM, spec, seed=2)
    copy.load_state_dict(state)
    table.apply_gradient(ids, torch.ones(4, DIM), 0.1)
    copy.apply_gradient(ids, torch.ones(4, DIM), 0.1)
    assert torch.equal(copy.pull(torch.tensor([3, 9, 40])), table.pull(torch.tensor([3, 9, 40])))
    with pytest.raises(ValueError, match=r"state.sum has shape \(3, 5\), expected \(3, 1\)"):
        copy.load_state_dict({**state, "state.sum": torch.zeros(3, DIM)})


def test_unsupported_optimizer_names_one_process() -> None:
    emb = fleet.nn.SparseEmbedding(DIM)
    opt = torch.optim.RMSprop(emb.parameters(), lr=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="not supported for a fleet.nn.SparseEmbedding in one process") as err:
        opt.step()
    assert "parameter server" not in str(err.value) and "fleet.nn.RowWiseAdagrad" in str(err.value)


def _assert_matches(results: list, want: dict) -> None:
    for worker, result in enumerate(results):
        for name, value in want.items():
            got = result["snapshot"][name]
            assert torch.allclose(got, value, atol=1e-6, rtol=0), f"worker {worker} {name}: {(got - value).abs().max()}"


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_ps_sync_equals_single_process_on_union() -> None:
    """1 server, 2 workers: the sparse rows (row-wise) and the MLP (Adagrad on the servers) as one process."""
    from ps_jobs import reference, run_job, train

    _assert_matches(run_job(train, 1, 2, {"update": "sync"}, "rwsadagrad", 6), reference("rwsadagrad", 6, 2))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_collective_replicas_equal_single_process_on_union() -> None:
    from dist_harness import run_workers
    from ps_jobs import reference, train_collective

    _assert_matches(run_workers(train_collective, 2, "rwsadagrad", 5), reference("rwsadagrad", 5, 2))
