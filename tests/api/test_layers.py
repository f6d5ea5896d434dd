"""The house: fleet's packages are layers that import downward only, with no import circle.

Every import counts: at module level, inside functions, and under ``TYPE_CHECKING`` (a type-only
circle is still a circle a reader must untangle). See docs/architecture.md for the picture.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import fleet

ROOT = Path(fleet.__file__).parent

# Lowest first. A module may import its own group and the groups listed before it, never after.
LAYERS: list[tuple[str, ...]] = [
    ("fleet.errors", "fleet.strategy_file", "fleet.registry"),
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


def _modules() -> dict[str, Path]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def _layer(module: str) -> int:
    best, index = -1, -1
    for i, group in enumerate(LAYERS):
        for prefix in group:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, index = len(prefix), i
    return index


def test_no_import_circle_counting_every_import():
    graph = _graph()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(dep) :] + [dep]))
            if dep not in state:
                visit(dep)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


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
