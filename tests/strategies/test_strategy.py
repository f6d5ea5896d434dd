"""DistributedStrategy: validation messages, Paddle aliases, files, environment."""

from __future__ import annotations

import json

import pytest

from fleet import DistributedStrategy, StrategyError
from fleet.runtime.env import EnvReader


def test_defaults_are_collective_sync():
    s = DistributedStrategy()
    assert (s.mode, s.update, s.backup_workers, s.grad_compression, s.timeout_s) == (
        "collective",
        "sync",
        0,
        "none",
        300.0,
    )


@pytest.mark.parametrize(
    "kwargs, fragments",
    [
        ({"update": "asink"}, ["update", "'asink'", "'sync', 'async' or 'geo'"]),
        ({"k_steps": 0}, ["k_steps", "0", "greater than or equal to 1"]),
        ({"timeout_s": "soon"}, ["timeout_s", "'soon'", "number"]),
        ({"grad_compression": "int8"}, ["grad_compression", "'int8'", "'fp16'"]),
        ({"colour": "red"}, ["no field 'colour'", "Known fields"]),
        ({"mode": "ring"}, ["mode", "'ring'", "'collective', 'ps'"]),
        ({"update": "async"}, ["update='async' is not supported with mode='collective'", "mode='ps' with update"]),
        ({"backup_workers": 1}, ["backup_workers=1", "mode='ps'"]),
        ({"mode": "ps", "update": "async", "backup_workers": 1}, ["backup_workers=1 applies to update='sync'"]),
        ({"mode": "ps", "grad_compression": "fp16"}, ["grad_compression applies to mode='collective'"]),
    ],
)
def test_bad_values_name_field_value_and_allowed(kwargs, fragments):
    with pytest.raises(StrategyError) as error:
        DistributedStrategy(**kwargs)
    for fragment in fragments:
        assert fragment in str(error.value)
    assert isinstance(error.value, ValueError)


def test_assignment_is_validated():
    s = DistributedStrategy()
    with pytest.raises(StrategyError, match="bucket_mb"):
        s.bucket_mb = -3
    s.bucket_mb = 4
    assert s.bucket_mb == 4.0


def test_paddle_aliases_read_and_write_the_same_fields():
    s = DistributedStrategy()
    assert s.a_sync is False
    s.a_sync = True
    assert (s.mode, s.update, s.a_sync) == ("ps", "async", True)
    s.a_sync_configs = {"k_steps": 8}
    assert (s.update, s.k_steps, s.a_sync_configs) == ("geo", 8, {"k_steps": 8})
    s.a_sync_configs = {"k_steps": 0}
    assert s.update == "async"
    s.a_sync = False
    assert s.update == "sync"
    assert DistributedStrategy(a_sync=True, a_sync_configs={"k_steps": 4}).update == "geo"
    assert DistributedStrategy(a_sync=True).update == "async"
    assert DistributedStrategy(a_sync=False).mode == "ps"
    with pytest.raises(StrategyError, match="k_steps"):
        DistributedStrategy(a_sync=True, a_sync_configs={"k_step": 4})


def test_from_toml_and_json(tmp_path):
    toml = tmp_path / "ps.toml"
    toml.write_text('mode = "ps"\nupdate = "sync"\nbackup_workers = 1\ntimeout_s = 30\n')
    s = DistributedStrategy.from_file(toml)
    assert (s.mode, s.update, s.backup_workers, s.timeout_s) == ("ps", "sync", 1, 30.0)
    nested = tmp_path / "nested.toml"
    nested.write_text('[strategy]\nmode = "ps"\nupdate = "geo"\nk_steps = 5\n')
    assert DistributedStrategy.from_file(nested).k_steps == 5
    js = tmp_path / "c.json"
    js.write_text(json.dumps({"grad_compression": "bf16", "bucket_mb": 4}))
    assert DistributedStrategy.from_file(js).grad_compression == "bf16"


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(StrategyError, match="does not exist"):
        DistributedStrategy.from_file(tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("mode = \n")
    with pytest.raises(StrategyError, match="does not parse"):
        DistributedStrategy.from_file(broken)
    bad = tmp_path / "bad.json"
    bad.write_text('{"update": "sometimes"}')
    with pytest.raises(StrategyError, match=r"bad.json.*update"):
        DistributedStrategy.from_file(bad)
    other = tmp_path / "s.yaml"
    other.write_text("mode: ps")
    with pytest.raises(StrategyError, match=".toml or .json"):
        DistributedStrategy.from_file(other)


def test_from_environment(tmp_path):
    assert DistributedStrategy.from_env(EnvReader({})) is None
    s = DistributedStrategy(mode="ps", update="geo", k_steps=3)
    assert DistributedStrategy.from_env(EnvReader({"FLEET_STRATEGY": s.to_json()})) == s
    path = tmp_path / "s.toml"
    path.write_text('mode = "ps"\n')
    assert DistributedStrategy.from_env(EnvReader({"FLEET_STRATEGY_FILE": str(path)})).mode == "ps"
    with pytest.raises(StrategyError, match="FLEET_STRATEGY"):
        DistributedStrategy.from_env(EnvReader({"FLEET_STRATEGY": "{not json"}))


def test_a_strategy_owns_its_fields_and_the_core_names_none(monkeypatch):
    """A registered strategy's owned fields are refused under every other mode, by the generic check
    in strategies/base.py, which names no strategy itself."""
    import ast
    from pathlib import Path

    import torch

    from fleet import registry
    from fleet.strategies import Strategy

    class Stepper(Strategy):
        name = "stepper"
        owned_fields = frozenset({"bucket_mb"})

        def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
            return optimizer

    monkeypatch.setitem(registry._registered, "stepper", Stepper)
    assert DistributedStrategy(mode="stepper", bucket_mb=8.0).bucket_mb == 8.0
    for mode in ("collective", "ps", "sharding"):
        with pytest.raises(StrategyError, match=rf"bucket_mb applies to mode='stepper' only .*mode='{mode}'"):
            DistributedStrategy(mode=mode, bucket_mb=8.0)
    base = Path(registry.__file__).parent / "strategies" / "base.py"
    literals = {n.value for n in ast.walk(ast.parse(base.read_text())) if isinstance(n, ast.Constant)}
    assert not literals & set(registry.names()), "strategies/base.py names a strategy"
