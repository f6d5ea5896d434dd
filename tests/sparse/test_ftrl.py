"""FTRL-Proximal on sparse tables: the native kernel against a plain-Python reference (per coordinate, in float64)
and against the rule's torch math; L1 makes rows exactly zero; its hyper-parameters are checked; saves round-trip;
a parameter-server job equals one process."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fleet.sparse import row_optimizers
from fleet.sparse.native import kernels, native_hyper
from fleet.sparse.optim import OptimizerSpec, ServerOptimizer
from fleet.sparse.table import SparseTable

CONFIGS = [
    {"kind": "ftrl", "lr": 0.1, "l1": 0.02, "l2": 0.01, "beta": 1.0},
    {"kind": "ftrl", "lr": 0.05, "l1": 0.05, "lr_power": -0.7, "initial_accumulator_value": 0.0},
    {"kind": "ftrl", "lr": 0.2, "l1": 0.01, "weight_decay": 0.01, "maximize": True},
]


def _batches(dim: int, steps: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """(ids, grads, lr) per step: ids drawn from a small pool (repeats within a batch), lr changing as a scheduler."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.tensor([5, -3, 1 << 40, 77, 12, 9001, -(1 << 33), 4])
    out = []
    for step in range(steps):
        ids = pool[torch.randint(0, pool.numel(), (12,), generator=gen)]
        grads = torch.randn(ids.numel(), dim, generator=gen) * (0.2 if step % 2 else 0.05)
        out.append((ids, grads, 1.0 + 0.1 * step))
    return out


def _plain_python(initial: dict[int, list[float]], batches: list, cfg: dict) -> tuple[dict, dict]:
    """FTRL-Proximal written out per coordinate in Python floats: {id: weights}, {id: linear terms}."""
    spec = OptimizerSpec(**cfg)
    power = -spec.lr_power
    w = {i: list(row) for i, row in initial.items()}
    n = {i: [spec.initial_accumulator_value] * len(row) for i, row in initial.items()}
    z = {i: [0.0] * len(row) for i, row in initial.items()}
    for ids, grads, scale in batches:
        alpha = spec.lr * scale
        total: dict[int, list[float]] = {}
        for i, g in zip(ids.tolist(), grads.tolist(), strict=True):  # repeated ids: one summed gradient
            total[i] = [a + b for a, b in zip(total[i], g, strict=True)] if i in total else list(g)
        for i, g in total.items():
            for c, gc in enumerate(g):
                gc = (-gc if spec.maximize else gc) + spec.weight_decay * w[i][c]
                n_new = n[i][c] + gc * gc
                sigma = (n_new**power - n[i][c] ** power) / alpha
                z[i][c] += gc - sigma * w[i][c]
                quadratic = (spec.beta + n_new**power) / alpha + 2 * spec.l2
                zc = z[i][c]
                w[i][c] = 0.0 if abs(zc) <= spec.l1 else (math.copysign(spec.l1, zc) - zc) / quadratic
                n[i][c] = n_new
    return w, z


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items() if k != "kind"))
def test_native_ftrl_equals_plain_python(cfg: dict) -> None:
    dim = 6
    table = SparseTable(dim, OptimizerSpec(**cfg), seed=11)
    batches = _batches(dim, 8, seed=len(cfg))
    ids = torch.unique(torch.cat([b[0] for b in batches]))
    initial = {int(i): row.tolist() for i, row in zip(ids, table.pull(ids), strict=True)}
    for batch_ids, grads, scale in batches:
        table.apply_gradient(batch_ids, grads, cfg["lr"] * scale)
    want_w, want_z = _plain_python(initial, batches, cfg)
    got = table.pull(ids)
    linear = table.copy_rows(table._index.lookup(ids))["state.linear"]
    want = torch.tensor([want_w[int(i)] for i in ids], dtype=torch.float64)
    z_ref = torch.tensor([want_z[int(i)] for i in ids], dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=2e-6)
    torch.testing.assert_close(linear.double(), z_ref, rtol=1e-4, atol=2e-6)
    # L1: exactly zero where the reference's |z| <= l1 (away from the threshold by more than float32 can blur)
    clear = (z_ref.abs() - cfg["l1"]).abs() > 1e-5
    assert torch.equal((got == 0)[clear], (z_ref.abs() <= cfg["l1"])[clear])
    assert int((got == 0).sum()) > 0, "the test must reach L1's zeroing"
    assert int((got != 0).sum()) > 0


def test_l1_zeroes_whole_rows() -> None:
    """A strong L1 makes every coordinate of rows with small gradients exactly 0 (what CTR tables rely on)."""
    table = SparseTable(4, OptimizerSpec(kind="ftrl", lr=0.1, l1=1.0), seed=2)
    ids = torch.tensor([1, 2, 3, 1])
    table.apply_gradient(ids, torch.tensor([[0.1] * 4, [0.2] * 4, [5.0] * 4, [0.1] * 4]), 0.1)
    rows = table.pull(torch.tensor([1, 2, 3]))
    assert torch.equal(rows[:2], torch.zeros(2, 4))
    assert bool((rows[2] != 0).all())


def _reference_step(opt: ServerOptimizer, fields: dict, slots: torch.Tensor, grads: torch.Tensor, lr: float) -> None:
    """The rule's torch math on the per-row fields (as copy_rows names them), duplicates summed in batch order."""
    uniq, inverse = torch.unique(slots, return_inverse=True)
    g = torch.zeros(uniq.numel(), grads.shape[1]).index_add_(0, inverse, grads)
    rows = fields["rows"].index_select(0, uniq)
    state = {name: fields[f"state.{name}"].index_select(0, uniq) for name in opt.state_names}
    opt.update(rows, g, state, 1, lr)
    fields["rows"].index_copy_(0, uniq, rows)
    for name in opt.state_names:
        fields[f"state.{name}"].index_copy_(0, uniq, state[name])


@pytest.mark.parametrize("dim", [1, 16, 33])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items() if k != "kind"))
def test_native_ftrl_is_the_torch_rule(cfg: dict, dim: int) -> None:
    """Float32 against float32: the kernel's roundings are the torch reference's (vectorised paths included)."""
    spec = OptimizerSpec(**cfg)
    gen = torch.Generator().manual_seed(dim)
    table = SparseTable(dim, spec, seed=1)
    ids = torch.randint(-(2**40), 2**40, (400,), generator=gen).unique()
    table.pull(ids)
    want = table.copy_rows(slice(None))
    opt = ServerOptimizer(spec)
    for step in range(10):
        batch = ids[torch.randint(0, ids.numel() if step % 3 else 30, (250,), generator=gen)]
        grads = torch.randn(batch.numel(), dim, generator=gen) * 0.1
        lr = cfg["lr"] * (1 + 0.1 * step)
        table.apply_gradient(batch, grads, lr)
        _reference_step(opt, want, table._index.lookup(batch), grads, lr)
    got = table.copy_rows(slice(None))
    for name in ("rows", "state.accumulator", "state.linear"):
        torch.testing.assert_close(got[name], want[name], rtol=2e-6, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert torch.equal(got["rows"] == 0, want["rows"] == 0)


def test_spec_fields_defaults_and_checks() -> None:
    spec = OptimizerSpec(kind="ftrl", lr=0.1)
    assert (spec.beta, spec.l1, spec.l2, spec.lr_power, spec.initial_accumulator_value) == (0.0, 0.0, 0.0, -0.5, 0.1)
    assert spec.to_config() == {
        "kind": "ftrl",
        "lr": 0.1,
        "weight_decay": 0.0,
        "maximize": False,
        "beta": 0.0,
        "l1": 0.0,
        "l2": 0.0,
        "lr_power": -0.5,
        "initial_accumulator_value": 0.1,
    }
    assert OptimizerSpec.from_config(spec.to_config()) == spec
    assert ServerOptimizer(spec).state_names == ("accumulator", "linear") and not ServerOptimizer(spec).needs_step
    for bad, field in [
        ({"l1": -1.0}, "l1"),
        ({"l2": float("nan")}, "l2"),
        ({"beta": -0.1}, "beta"),
        ({"lr_power": 0.5}, "lr_power"),
        ({"initial_accumulator_value": -1.0}, "initial_accumulator_value"),
        ({"momentum": 0.9}, "momentum does not apply to optimizer kind 'ftrl'"),
        ({"l3": 0.1}, "l3"),
        ({"l1": "strong"}, "l1"),
    ]:
        with pytest.raises(ValueError, match=field):
            OptimizerSpec.from_config({"kind": "ftrl", "lr": 0.1, **bad})
    with pytest.raises(ValueError, match="ftrl"):  # the unknown-kind error lists the registered kinds, FTRL among them
        OptimizerSpec.from_config({"kind": "ftlr", "lr": 0.1})
    assert "ftrl" in row_optimizers.names()


def test_kernel_refuses_a_wrong_call() -> None:
    """A bad hyper tuple or missing state raises a Python error and writes nothing."""
    spec = OptimizerSpec(kind="ftrl", lr=0.1, l1=0.1)
    rows, n, z = np.ones((4, 2), np.float32), np.zeros((4, 2), np.float32), np.zeros((4, 2), np.float32)
    slots, grads = np.array([0, 1], np.int64), np.ones((2, 2), np.float32)
    hyper = native_hyper(spec, 0.1)
    with pytest.raises(ValueError, match="tuple of 4 hyper-parameters"):
        kernels.apply_rows((*hyper[:5], hyper[5][:3]), rows, n, z, None, None, slots, grads, 4, None, None, None, None)
    with pytest.raises(ValueError, match="two state tensors"):
        kernels.apply_rows(hyper, rows, n, None, None, None, slots, grads, 4, None, None, None, None)
    assert (rows == 1).all() and not n.any()
    kernels.apply_rows(hyper, rows, n, z, None, None, slots, grads, 4, None, None, None, None)
    assert n[:2].tolist() == [[1.0, 1.0]] * 2 and not n[2:].any()


def test_table_save_round_trip() -> None:
    spec = OptimizerSpec(kind="ftrl", lr=0.1, l1=0.01, beta=0.5)
    table = SparseTable(3, spec, seed=4)
    ids = torch.tensor([8, -1, 8, 1 << 35])
    table.apply_gradient(ids, torch.randn(4, 3, generator=torch.Generator().manual_seed(0)), 0.1)
    state = table.state_dict()
    assert state["state.accumulator"].shape == (3, 3) and state["state.linear"].shape == (3, 3)
    copy = SparseTable(3, spec, seed=4)
    copy.load_state_dict(state)
    table.apply_gradient(ids, torch.ones(4, 3), 0.1)
    copy.apply_gradient(ids, torch.ones(4, 3), 0.1)
    assert torch.equal(copy.pull(torch.unique(ids)), table.pull(torch.unique(ids)))
    with pytest.raises(ValueError, match="optimizer 'ftrl', this table uses 'adagrad'"):
        SparseTable(3, OptimizerSpec(kind="adagrad", lr=0.1)).load_state_dict(state)


def test_sparse_embedding_takes_ftrl_as_data() -> None:
    """One process: the module's rows step with FTRL (the torch optimizer's lr), dense parameters with SGD."""
    import fleet

    emb = fleet.nn.SparseEmbedding(4, optimizer={"kind": "ftrl", "lr": 0.5, "l1": 10.0}, seed=1)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    emb(torch.tensor([3, 4, 3])).sum().backward()
    opt.step()
    assert torch.equal(emb(torch.tensor([3, 4])).detach(), torch.zeros(2, 4))  # |z| <= l1: exactly zero


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_ps_sync_equals_single_process_on_union() -> None:
    """1 server, 2 workers in sync mode: the FTRL rows (on the server) and the MLP equal one process on the union."""
    from ps_jobs import reference, run_job, train

    want = reference("plain+ftrl_rows", 6, 2)
    assert int((want["rows"] == 0).all(dim=1).sum()) > 0, "L1 must zero some rows for the test to see them"
    for worker, result in enumerate(run_job(train, 1, 2, {"update": "sync"}, "plain+ftrl_rows", 6)):
        for name, value in want.items():
            got = result["snapshot"][name]
            assert torch.allclose(got, value, atol=1e-6, rtol=0), f"worker {worker} {name}: {(got - value).abs().max()}"


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_collective_replicas_equal_single_process_on_union() -> None:
    """2 collective workers: each replica's FTRL table steps with the merged row gradients, as one process."""
    from dist_harness import run_workers
    from ps_jobs import reference, train_collective

    want = reference("plain+ftrl_rows", 5, 2)
    for worker, result in enumerate(run_workers(train_collective, 2, "plain+ftrl_rows", 5)):
        for name, value in want.items():
            got = result["snapshot"][name]
            assert torch.allclose(got, value, atol=1e-6, rtol=0), f"worker {worker} {name}: {(got - value).abs().max()}"
