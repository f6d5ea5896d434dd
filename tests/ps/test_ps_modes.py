"""The update modes as objects (fleet.ps.modes): one registry, each mode's options and server policy."""

from __future__ import annotations

from pathlib import Path

import pytest

from ast_checks import import_cycle, import_graph
from fleet.ps import modes
from fleet.ps.modes import Admit
from fleet.ps.protocol.errors import ShardError
from fleet.strategy import DistributedStrategy

FLEET = Path(__file__).resolve().parents[2] / "fleet"


def test_registry_names_every_mode_once() -> None:
    assert modes.names() == ("sync", "async", "geo")
    for name in modes.names():
        assert modes.mode_for(name).name == name
    assert modes.of_config({}).name == "async"  # a table created without "update"
    with pytest.raises(KeyError, match=r"update='sometimes'; expected one of sync, async, geo"):
        modes.mode_for("sometimes")


def test_each_mode_declares_its_options_and_checks_them() -> None:
    assert modes.mode_for("sync").options == ("backup_workers",)
    assert modes.mode_for("geo").options == ("k_steps",)
    modes.mode_for("sync").check(DistributedStrategy(mode="ps", update="sync", backup_workers=1))
    with pytest.raises(ValueError, match=r"backup_workers=1 applies to update='sync' only \(got update='async'\)"):
        modes.mode_for("async").check(DistributedStrategy.model_construct(update="async", backup_workers=1))


def test_server_policies() -> None:
    sync, async_, geo = (modes.mode_for(n) for n in ("sync", "async", "geo"))
    assert sync.admit_gradient(0, version=3, worker=1, step=3, pushed=False) is Admit.ACCUMULATE
    assert sync.admit_gradient(0, version=3, worker=1, step=2, pushed=False) is Admit.STALE
    with pytest.raises(ShardError, match="pull with min_version=4"):
        sync.admit_gradient(0, version=3, worker=1, step=4, pushed=False)
    with pytest.raises(ShardError, match="worker 1 already pushed step 3"):
        sync.admit_gradient(0, version=3, worker=1, step=3, pushed=True)
    assert async_.admit_gradient(0, version=3, worker=1, step=99, pushed=True) is Admit.APPLY
    with pytest.raises(ShardError, match="table 7 is in geo mode: push deltas, not gradients"):
        geo.admit_gradient(7, version=0, worker=0, step=0, pushed=False)
    geo.admit_delta(7)
    with pytest.raises(ShardError, match="table 7 is in sync mode: push gradients, not deltas"):
        sync.admit_delta(7)
    assert sync.stale_write(2, 3) and not sync.stale_write(3, 3) and not async_.stale_write(2, 3)


@pytest.mark.parametrize("package", ["ps", "sparse"])
def test_no_import_cycles_in(package: str) -> None:
    prefix = f"fleet.{package}"
    inside = {m for m in import_graph(FLEET) if m == prefix or m.startswith(prefix + ".")}
    graph = {m: deps & inside for m, deps in import_graph(FLEET).items() if m in inside}
    circle = import_cycle(graph)
    assert circle is None, f"import cycle: {' -> '.join(circle or [])}"
