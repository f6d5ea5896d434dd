"""The update modes as objects (fleet.ps.modes): one registry, each mode's options and server policy."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

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


def _imports(path: Path, module: str) -> set[str]:
    """Every fleet module ``path`` imports: at the top, inside functions and under TYPE_CHECKING."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            found |= {base, *(f"{base}.{a.name}" for a in node.names)}
    return found


@pytest.mark.parametrize("package", ["ps", "sparse"])
def test_no_import_cycles_in(package: str) -> None:
    paths = {}
    for path in (FLEET / package).rglob("*.py"):
        name = ".".join(path.relative_to(FLEET.parent).with_suffix("").parts).removesuffix(".__init__")
        paths[name] = path
    graph = {m: {d for d in _imports(p, m) if d in paths and d != m} for m, p in paths.items()}
    done: set[str] = set()

    def visit(module: str, trail: list[str]) -> None:
        if module in trail:
            raise AssertionError(f"import cycle: {' -> '.join([*trail[trail.index(module) :], module])}")
        if module in done:
            return
        for dep in sorted(graph[module]):
            visit(dep, [*trail, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
