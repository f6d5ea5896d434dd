"""The row-optimizer registry (fleet.sparse.row_optimizers): every rule answers for its kind, the wire format and
saves are those of before the registry (a committed fixture saved by the previous code loads and steps the same)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fleet.sparse import row_optimizers
from fleet.sparse.optim import OptimizerSpec, ServerOptimizer, optimizer_config_json
from fleet.sparse.table import SparseTable

FIXTURE = Path(__file__).parent / "fixtures" / "tables_before_row_optimizers.pt"

# optimizer_config_json as the code before the registry wrote it (saves and PS table creates carry it)
BEFORE = {
    "sgd": '{"dampening": 0.0, "kind": "sgd", "lr": 0.1, "maximize": false, "momentum": 0.0, "nesterov": false, '
    '"weight_decay": 0.0}',
    "sgd_nesterov": '{"dampening": 0.0, "kind": "sgd", "lr": 0.1, "maximize": false, "momentum": 0.9, '
    '"nesterov": true, "weight_decay": 0.0}',
    "adam": '{"betas": [0.9, 0.999], "eps": 1e-08, "kind": "adam", "lr": 0.01, "maximize": false, "weight_decay": 0.0}',
    "adamw": '{"betas": [0.8, 0.9], "eps": 1e-08, "kind": "adamw", "lr": 0.01, "maximize": false, "weight_decay": 0.1}',
    "adagrad": '{"eps": 1e-10, "initial_accumulator_value": 0.0, "kind": "adagrad", "lr": 0.1, "lr_decay": 0.0, '
    '"maximize": false, "weight_decay": 0.0}',
    "rowwise_adagrad": '{"eps": 1e-10, "initial_accumulator_value": 0.0, "kind": "rowwise_adagrad", "lr": 0.1, '
    '"lr_decay": 0.01, "maximize": true, "weight_decay": 0.0}',
}
SPECS = {
    "sgd": {"kind": "sgd", "lr": 0.1},
    "sgd_nesterov": {"kind": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True},
    "adam": {"kind": "adam", "lr": 0.01},
    "adamw": {"kind": "adamw", "lr": 0.01, "weight_decay": 0.1, "betas": (0.8, 0.9)},
    "adagrad": {"kind": "adagrad", "lr": 0.1},
    "rowwise_adagrad": {"kind": "rowwise_adagrad", "lr": 0.1, "lr_decay": 0.01, "maximize": True},
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_wire_format_is_unchanged(name: str) -> None:
    spec = OptimizerSpec(**SPECS[name])
    assert optimizer_config_json(spec) == BEFORE[name]
    assert OptimizerSpec.from_config(json.loads(BEFORE[name])) == spec


def test_another_rules_default_is_accepted_and_dropped() -> None:
    """As before the registry: a field of another kind at its default is harmless, any other value is an error."""
    assert OptimizerSpec(kind="sgd", lr=0.1, eps=1e-8).to_config() == OptimizerSpec(kind="sgd", lr=0.1).to_config()
    with pytest.raises(ValueError, match="eps does not apply to optimizer kind 'sgd'"):
        OptimizerSpec(kind="sgd", lr=0.1, eps=1e-3)


@pytest.mark.parametrize("name", row_optimizers.names())
def test_every_rule_steps_a_table_and_its_state_starts_as_declared(name: str) -> None:
    """Each registered rule: a table made from its name steps natively, keeps the state it declares, and the
    native step equals its torch reference on a first step."""
    rule = row_optimizers.get(name)
    spec = OptimizerSpec(kind=name, lr=0.1)
    assert spec.rule is rule and set(rule.hyper.model_fields) <= set(spec.to_config())
    table = SparseTable(5, spec, seed=3)
    ids = torch.tensor([4, 9, 4])
    table.pull(ids)  # creates the rows: values from the initializer, state as the rule starts it
    fresh = table.copy_rows(table._index.lookup(torch.tensor([4, 9])))
    opt = ServerOptimizer(spec)
    assert set(fresh) == {"rows", "steps", *(f"state.{n}" for n in opt.state_names)}
    for state_name in opt.state_names:
        assert bool((fresh[f"state.{state_name}"] == rule.initial_state(spec, state_name)).all())
    grads = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    table.apply_gradient(ids, grads, 0.1)
    rows, state = fresh["rows"].clone(), {n: fresh[f"state.{n}"].clone() for n in opt.state_names}
    opt.update(rows, torch.stack([grads[0] + grads[2], grads[1]]), state, torch.ones(2, dtype=torch.int64), 0.1)
    torch.testing.assert_close(table.pull(torch.tensor([4, 9])), rows, rtol=2e-6, atol=1e-7)


def test_unknown_kind_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown optimizer kind 'rmsprop'; known kinds: \['adagrad', 'adam'"):
        row_optimizers.get("rmsprop")


@pytest.mark.parametrize("name", ["sgd_momentum", "adam", "adagrad", "rowwise_adagrad"])
def test_a_table_saved_before_loads_and_steps_the_same(name: str) -> None:
    """The fixture was saved by the code before the registry, with the state after one more step."""
    saved = torch.load(FIXTURE, weights_only=False)[name]
    spec = OptimizerSpec.from_config(json.loads(saved["saved"]["optimizer"]))
    table = SparseTable(3, spec, seed=5)
    table.load_state_dict(saved["saved"])
    table.apply_gradient(torch.tensor([7, -2, 7, 40, 1 << 40]), torch.ones(5, 3), 0.1)
    after = table.state_dict()
    for key, value in saved["after"].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(after[key], value), key
        else:
            assert after[key] == value, key
