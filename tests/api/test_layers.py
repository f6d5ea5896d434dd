"""The house: fleet's packages are layers that import downward only, with no import circle.

Every import counts: at module level, inside functions, and under ``TYPE_CHECKING`` (a type-only
circle is still a circle a reader must untangle). See docs/architecture.md for the picture.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import fleet
from ast_checks import import_cycle, import_graph

ROOT = Path(fleet.__file__).parent

# Lowest first. A module may import its own group and the groups listed before it, never after.
LAYERS: list[tuple[str, ...]] = [
    ("fleet.errors", "fleet.strategy_file", "fleet.registry"),
    ("fleet.runtime.env",),
    ("fleet.roles",),  # reads the launchers' variables through runtime.env; the rest of runtime takes its RoleInfo
    ("fleet.runtime", "fleet.storage", "fleet.ps.protocol"),
    ("fleet.telemetry",),
    ("fleet.data",),
    ("fleet.strategy",),
    ("fleet.training",),
    ("fleet.sparse",),
    ("fleet.nn",),
    ("fleet.collective",),
    ("fleet.sharding",),
    ("fleet.ps.modes",),
    ("fleet.ps.server",),
    ("fleet.ps.client",),
    ("fleet.ps.worker",),
    ("fleet.ps",),
    ("fleet.strategies",),
    ("fleet.api", "fleet.checkpoint", "fleet.export", "fleet.metrics"),
    ("fleet",),
    ("fleet.plan",),
    ("fleet.launch",),
]


def _graph() -> dict[str, set[str]]:
    return import_graph(ROOT)


def _layer(module: str) -> int:
    best, index = -1, -1
    for i, group in enumerate(LAYERS):
        for prefix in group:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, index = len(prefix), i
    return index


def test_no_import_circle_counting_every_import():
    circle = import_cycle(_graph())
    assert circle is None, "import circle: " + " -> ".join(circle or [])


def test_every_module_belongs_to_a_layer():
    unplaced = sorted(m for m in _graph() if _layer(m) < 0)
    assert not unplaced, f"modules in no layer of LAYERS (add their package to the list): {unplaced}"


def test_layers_import_downward_only():
    upward = [
        f"{module} (layer {_layer(module)}) imports {dep} (layer {_layer(dep)})"
        for module, deps in sorted(_graph().items())
        for dep in sorted(deps)
        if _layer(dep) > _layer(module)
    ]
    assert not upward, "imports that go up the layers:\n" + "\n".join(upward)


def test_the_top_level_is_the_public_face_and_packages_stay_small():
    top = sorted(p.stem for p in ROOT.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 10, f"fleet/ holds {len(top)} modules besides __init__.py (at most 10): {top}"
    for package in [p for p in ROOT.rglob("*") if p.is_dir() and (p / "__init__.py").exists()]:
        flat = [p.name for p in package.glob("*.py") if p.name != "__init__.py"]
        assert len(flat) <= 15, f"{package.relative_to(ROOT.parent)} holds {len(flat)} modules flat (at most 15)"


def test_import_fleet_exposes_only_the_documented_names():
    documented = set(fleet.__all__) | set(fleet.PUBLIC_MODULES)
    for name in sorted(documented):
        assert getattr(fleet, name) is not None, name
    for name in ("timing", "env", "tables", "rendezvous", "api", "no_such_name"):
        with pytest.raises(AttributeError, match=name):
            fleet.__getattr__(name)
    assert {n for n in dir(fleet) if not n.startswith("_")} == documented
