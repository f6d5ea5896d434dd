"""Server-side optimizer specs, update rules (dense path) and deterministic row initialisation."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fleet.ps.server.dense_table import DenseTable
from fleet.sparse.optim import InitializerSpec, OptimizerSpec, ServerOptimizer, initial_rows

# (torch class, constructor kwargs); every case is checked against torch.optim step by step.
CASES = [
    (torch.optim.SGD, {"lr": 0.1}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.3}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.5, "weight_decay": 0.01, "maximize": True}),
    (torch.optim.SGD, {"lr": 0.1, "weight_decay": 0.05}),
    (torch.optim.Adam, {"lr": 0.01}),
    (torch.optim.Adam, {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1}),
    (torch.optim.Adam, {"lr": 0.01, "maximize": True}),
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    (torch.optim.Adagrad, {"lr": 0.1}),
    (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.05, "initial_accumulator_value": 0.1, "weight_decay": 0.01}),
]


def _case_id(case: tuple) -> str:
    cls, kw = case
    return cls.__name__ + "-" + "-".join(f"{k}={v}" for k, v in kw.items() if k != "lr")


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_dense_table_matches_torch_optim_with_changing_lr(case: tuple) -> None:
    cls, kw = case
    gen = torch.Generator().manual_seed(1)
    # Two parameters, as a model would have; the server sees them flattened into one vector.
    params = [torch.randn(4, 5, generator=gen).requires_grad_(), torch.randn(7, generator=gen).requires_grad_()]
    opt = cls(params, **kw)
    spec = OptimizerSpec.from_torch(cls, opt.param_groups[0])
    table = DenseTable(27, spec, init=torch.cat([p.detach().reshape(-1) for p in params]))
    for step in range(60):
        lr = kw["lr"] * (0.97**step) * (1.5 if step % 7 == 0 else 1.0)  # a schedule, with jumps
        for group in opt.param_groups:
            group["lr"] = lr
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        flat_grad = torch.cat([p.grad.reshape(-1) for p in params])
        opt.step()
        table.apply_gradient(flat_grad, lr)
        expected = torch.cat([p.detach().reshape(-1) for p in params])
        torch.testing.assert_close(table.pull(), expected, atol=1e-6, rtol=0)
    assert table.step == 60


def test_from_torch_reads_param_group() -> None:
    p = [torch.zeros(2, requires_grad=True)]
    sgd = OptimizerSpec.from_torch(torch.optim.SGD, torch.optim.SGD(p, lr=0.3, momentum=0.9).param_groups[0])
    assert (sgd.kind, sgd.lr, sgd.momentum, sgd.nesterov) == ("sgd", 0.3, 0.9, False)
    ada = OptimizerSpec.from_torch(torch.optim.Adagrad, torch.optim.Adagrad(p).param_groups[0])
    assert ada.kind == "adagrad" and ada.eps == 1e-10
    adamw = OptimizerSpec.from_torch(torch.optim.AdamW, torch.optim.AdamW(p).param_groups[0])
    assert adamw.kind == "adamw" and adamw.weight_decay == 0.01
    tensor_lr = OptimizerSpec.from_torch(torch.optim.Adam, torch.optim.Adam(p, lr=torch.tensor(0.5)).param_groups[0])
    assert tensor_lr.lr == 0.5 and tensor_lr.betas == (0.9, 0.999)


def test_from_torch_rejects_unsupported() -> None:
    p = [torch.zeros(2, requires_grad=True)]
    with pytest.raises(ValueError, match=r"RMSprop.*supported: torch.optim.SGD, torch.optim.Adam"):
        OptimizerSpec.from_torch(torch.optim.RMSprop, torch.optim.RMSprop(p).param_groups[0])
    with pytest.raises(ValueError, match="amsgrad"):
        OptimizerSpec.from_torch(torch.optim.Adam, torch.optim.Adam(p, amsgrad=True).param_groups[0])


def test_adagrad_eps_default_when_built_directly() -> None:
    assert OptimizerSpec(kind="adagrad", lr=0.1).eps == 1e-10
    assert OptimizerSpec(kind="adam", lr=0.1).eps == 1e-8
    assert OptimizerSpec(kind="adagrad", lr=0.1, eps=1e-3).eps == 1e-3


@pytest.mark.parametrize(
    "spec",
    [
        OptimizerSpec(kind="sgd", lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4),
        OptimizerSpec(kind="adam", lr=1e-3, betas=(0.8, 0.9)),
        OptimizerSpec(kind="adagrad", lr=0.1, lr_decay=0.01, maximize=True),
    ],
)
def test_optimizer_config_round_trip_is_json(spec: OptimizerSpec) -> None:
    config = json.loads(json.dumps(spec.to_config()))
    assert OptimizerSpec.from_config(config) == spec
    assert "betas" not in spec.to_config() or spec.kind == "adam"  # only the kind's own fields travel


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"kind": "sgd"}, "lr"),
        ({"kind": "rmsprop", "lr": 0.1}, "kind"),
        ({"kind": "sgd", "lr": 0.1, "momentun": 0.9}, "momentun"),
        ({"kind": "sgd", "lr": -1.0}, "lr"),
        ({"kind": "adam", "lr": 0.1, "momentum": 0.9}, "momentum"),
        ({"kind": "adam", "lr": 0.1, "betas": [0.9, 1.5]}, "betas"),
        ({"kind": "sgd", "lr": 0.1, "nesterov": True}, "nesterov"),
        ({"kind": "sgd", "lr": "fast"}, "lr"),
    ],
)
def test_optimizer_config_errors_name_the_field(config: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        OptimizerSpec.from_config(config)


def test_initializer_config() -> None:
    spec = InitializerSpec(kind="normal", std=0.5)
    assert InitializerSpec.from_config(json.loads(json.dumps(spec.to_config()))) == spec
    with pytest.raises(ValueError, match="low"):
        InitializerSpec.from_config({"kind": "uniform", "low": 1.0, "high": 0.0})
    with pytest.raises(ValueError, match="scale"):
        InitializerSpec.from_config({"kind": "normal", "scale": 1.0})


# --------------------------------------------------------------------------- initial rows
_MASK = (1 << 64) - 1


def _reference_uniform(seed: int, id_: int, col: int, low: float, high: float) -> float:
    """Plain-Python (unsigned 64-bit) version of the documented hash, for one element."""

    def mix(z: int) -> int:
        z &= _MASK
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        return z ^ (z >> 31)

    gamma = 0x9E3779B97F4A7C15
    seed_key = mix(seed * gamma + 0 + 1)
    row = mix((id_ & _MASK) ^ seed_key)
    z = mix(row + (col + 1) * gamma)
    u = ((z >> 11) + 1) * 2.0**-53 - 2.0**-53
    return float(torch.tensor(u * (high - low) + low, dtype=torch.float64).to(torch.float32))


def test_initial_rows_match_reference_hash_for_extreme_ids() -> None:
    ids = [0, 1, -1, 2**63 - 1, -(2**63), 123456789012345, -987654321]
    init = InitializerSpec(kind="uniform", low=-0.5, high=0.5)
    rows = initial_rows(torch.tensor(ids), 5, init, seed=7)
    for i, id_ in enumerate(ids):
        for c in range(5):
            assert rows[i, c].item() == _reference_uniform(7, id_, c, -0.5, 0.5)


@pytest.mark.parametrize("kind", ["uniform", "normal"])
def test_initial_rows_independent_of_batch_order_and_sharding(kind: str) -> None:
    init = InitializerSpec(kind=kind)
    gen = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.randint(-(2**62), 2**62, (3000,), generator=gen), torch.arange(-50, 50)])
    full = initial_rows(ids, 16, init, seed=3)
    assert full.dtype == torch.float32 and full.shape == (3100, 16)
    perm = torch.randperm(ids.numel(), generator=gen)
    assert torch.equal(initial_rows(ids[perm], 16, init, seed=3), full[perm])
    for shard in range(3):  # shard by id, as servers do; odd-sized pieces exercise kernel tails
        mask = ids % 3 == shard
        assert torch.equal(initial_rows(ids[mask], 16, init, seed=3), full[mask])
    for i in (0, 7, 3099):  # one at a time
        assert torch.equal(initial_rows(ids[i : i + 1], 16, init, seed=3), full[i : i + 1])
    assert torch.equal(initial_rows(ids, 5, init, seed=3), full[:, :5])  # column c never depends on dim
    assert not torch.equal(initial_rows(ids, 16, init, seed=4), full)


def test_initial_rows_distributions() -> None:
    ids = torch.arange(20000)
    u = initial_rows(ids, 8, InitializerSpec(kind="uniform", low=-1.0, high=3.0), seed=0)
    assert u.min() >= -1.0 and u.max() < 3.0
    assert abs(u.mean().item() - 1.0) < 0.02 and abs(u.var().item() - 16 / 12) < 0.03
    n = initial_rows(ids, 8, InitializerSpec(kind="normal", mean=2.0, std=0.5), seed=0)
    assert abs(n.mean().item() - 2.0) < 0.01 and abs(n.std().item() - 0.5) < 0.01
    assert torch.isfinite(n).all()
    # Neighbouring ids and columns are uncorrelated.
    assert abs(torch.corrcoef(torch.stack([u[:-1, 0], u[1:, 0]]))[0, 1].item()) < 0.03
    assert abs(torch.corrcoef(torch.stack([u[:, 0], u[:, 1]]))[0, 1].item()) < 0.03
    assert torch.equal(initial_rows(ids[:3], 4, InitializerSpec(kind="zeros"), 0), torch.zeros(3, 4))
    assert torch.equal(
        initial_rows(ids[:3], 4, InitializerSpec(kind="constant", value=0.5), 0), torch.full((3, 4), 0.5)
    )


def test_server_optimizer_leaves_grad_untouched() -> None:
    spec = OptimizerSpec(kind="sgd", lr=0.1, momentum=0.9, weight_decay=0.1, maximize=True)
    opt = ServerOptimizer(spec)
    param, grad = torch.ones(4), torch.full((4,), 2.0)
    state = {"momentum_buffer": torch.zeros(4)}
    for step in (1, 2):
        opt.update(param, grad, state, step, 0.1)
    assert torch.equal(grad, torch.full((4,), 2.0))
    assert math.isclose(param[0].item(), 1 + 0.1 * 1.9 + 0.1 * (0.9 * 1.9 + 1.881), rel_tol=1e-6)
