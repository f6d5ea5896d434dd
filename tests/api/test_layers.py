"""The house: fleet's packages form a graph. Each package lists what it may import, siblings that must
stay independent are named, and nothing imports in a circle.

Every import counts: at module level, inside functions, and under ``TYPE_CHECKING`` (a type-only
circle is still a circle a reader must untangle). docs/architecture.md shows the same graph; a test
below keeps its table equal to :data:`MAY_IMPORT`.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

import fleet
from ast_checks import import_cycle, import_graph, reaches

ROOT = Path(fleet.__file__).parent
DOCS = ROOT.parent / "docs" / "architecture.md"

# The ground: what every engine may stand on.
GROUND = {"fleet.errors", "fleet.runtime.env", "fleet.roles", "fleet.runtime", "fleet.storage", "fleet.telemetry"}
PS_WIRE = {"fleet.ps.protocol", "fleet.ps.modes"}  # what both ends of the parameter server share

# Each package (or top-level module) and the packages it may import besides itself. A module belongs to the
# longest name here that prefixes it ("fleet" itself is only fleet/__init__.py).
MAY_IMPORT: dict[str, set[str]] = {
    # the ground
    "fleet.errors": set(),
    "fleet.strategy_file": set(),
    "fleet.registry": set(),
    "fleet.runtime.env": {"fleet.errors"},  # every environment variable fleet reads
    "fleet.roles": {"fleet.errors", "fleet.runtime.env"},  # who this process is, from the launchers' variables
    "fleet.runtime": {"fleet.errors", "fleet.runtime.env", "fleet.roles"},
    "fleet.storage": {"fleet.errors"},
    "fleet.telemetry": {"fleet.runtime.env", "fleet.runtime", "fleet.storage"},
    "fleet.ps.protocol": {"fleet.errors", "fleet.runtime.env", "fleet.runtime"},
    # the configuration model and the pieces engines share
    "fleet.strategy": GROUND | {"fleet.registry", "fleet.strategy_file", "fleet.ps.protocol"},
    "fleet.data": GROUND,
    "fleet.training": GROUND,
    "fleet.sparse": GROUND,
    "fleet.nn": GROUND | {"fleet.sparse"},
    # the engines
    "fleet.collective": GROUND | {"fleet.training", "fleet.sparse"},  # sharded tables: rows kept by their owners
    "fleet.sharding": GROUND | {"fleet.collective", "fleet.training", "fleet.sparse", "fleet.nn"},
    "fleet.ps.modes": GROUND | {"fleet.ps.protocol", "fleet.sparse"},
    "fleet.ps.server": GROUND | PS_WIRE | {"fleet.sparse"},
    "fleet.ps.client": GROUND | PS_WIRE | {"fleet.data"},
    "fleet.ps.worker": GROUND | PS_WIRE | {"fleet.ps.client", "fleet.training", "fleet.sparse"},
    "fleet.ps": set(),
    # policy, then the public face
    "fleet.strategies": GROUND
    | PS_WIRE
    | {"fleet.registry", "fleet.strategy", "fleet.training", "fleet.sparse", "fleet.nn", "fleet.data"}
    | {"fleet.collective", "fleet.sharding", "fleet.ps.server", "fleet.ps.client", "fleet.ps.worker"},
    "fleet.api": GROUND
    | {"fleet.registry", "fleet.strategy", "fleet.strategies", "fleet.data", "fleet.training", "fleet.sparse"}
    | {"fleet.collective"},
    "fleet.checkpoint": GROUND | {"fleet.api", "fleet.nn"},
    "fleet.export": GROUND | {"fleet.nn", "fleet.sparse"},
    "fleet.metrics": GROUND,
    "fleet": GROUND
    | {"fleet.api", "fleet.checkpoint", "fleet.export", "fleet.metrics", "fleet.strategy", "fleet.strategies"}
    | {"fleet.registry", "fleet.strategy_file", "fleet.data", "fleet.sparse", "fleet.nn"},
    # the tools: they use public faces only (FACES), never an engine's insides
    "fleet.plan": {
        "fleet",
        "fleet.runtime.env",
        "fleet.runtime",
        "fleet.telemetry",
        "fleet.strategy",
        "fleet.nn",
        "fleet.sparse",
    }
    | {"fleet.ps.client", "fleet.ps.server"},
    "fleet.launch": {"fleet.runtime.env", "fleet.runtime", "fleet.telemetry", "fleet.strategy_file", "fleet.plan"},
}

# Siblings that import nothing of each other, directly or through any other module.
INDEPENDENT: list[tuple[str, str]] = [
    ("fleet.collective", "fleet.ps"),  # two ways to train; the strategies choose
    ("fleet.sharding", "fleet.ps"),
    ("fleet.ps.client", "fleet.ps.server"),  # two ends of one wire: they share ps.protocol and ps.modes only
]

# Crossings of an independence rule that exist today, each a debt with its reason: module -> the packages it may
# import against the rules. The tests fail when another module crosses, and when a debt is paid (then remove it).
CROSSINGS: dict[str, set[str]] = {}  # none today (the PS hybrid's was paid: fleet.strategies composes it)

# A public face: a module other layers' tools may use without knowing an engine's insides. The fleet
# package and its top-level modules (what users import), and per package the one or two modules it offers
# to tools that measure it (the planner calibrates on a real server, client and tables).
FACES: set[str] = {
    *(f"fleet.{p.stem}" for p in ROOT.glob("*.py") if p.name != "__init__.py"),
    "fleet",
    "fleet.nn",
    "fleet.runtime.env",  # every environment variable fleet reads
    "fleet.runtime.job_files",  # the files a job leaves for fleetrun
    "fleet.telemetry.timing",  # the step recorder
    "fleet.telemetry.step_report",
    "fleet.sparse.table",  # SparseTable
    "fleet.sparse.optim",  # OptimizerSpec
    "fleet.sparse.id_index",  # IdIndex
    "fleet.ps.server.loop",  # ParameterServer
    "fleet.ps.server.dense_table",  # DenseTable
    "fleet.ps.client.client",  # PSClient
}
ONLY_FACES = ("fleet.plan", "fleet.launch")


@functools.cache
def _graph() -> dict[str, set[str]]:
    return import_graph(ROOT)


def _unit(module: str) -> str | None:
    """The package of MAY_IMPORT ``module`` belongs to (the longest name prefixing it), or None."""
    if module == "fleet":
        return "fleet"
    found = [u for u in MAY_IMPORT if u != "fleet" and (module == u or module.startswith(u + "."))]
    return max(found, key=len) if found else None


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_no_import_circle_counting_every_import():
    circle = import_cycle(_graph())
    assert circle is None, "import circle: " + " -> ".join(circle or [])


def test_every_module_belongs_to_a_package_of_the_graph():
    unplaced = sorted(m for m in _graph() if _unit(m) is None)
    assert not unplaced, f"modules in no package of MAY_IMPORT (add their package to it): {unplaced}"


def test_the_declared_graph_has_no_circle_and_names_only_its_packages():
    unknown = sorted(d for deps in MAY_IMPORT.values() for d in deps if d not in MAY_IMPORT)
    assert not unknown, f"MAY_IMPORT lists packages it does not declare: {unknown}"
    circle = import_cycle({unit: set(deps) for unit, deps in MAY_IMPORT.items()})
    assert circle is None, "MAY_IMPORT allows an import circle: " + " -> ".join(circle or [])


def test_every_import_is_one_the_graph_allows():
    undeclared = []
    for module, deps in sorted(_graph().items()):
        unit = _unit(module)
        for dep in sorted(deps):
            target = _unit(dep)
            if target != unit and target not in MAY_IMPORT[unit] and target not in CROSSINGS.get(module, ()):
                undeclared.append(f"{module} ({unit}) imports {dep} ({target})")
    assert not undeclared, "imports MAY_IMPORT does not allow:\n" + "\n".join(undeclared)


def _without_crossings(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return {m: {d for d in deps if _unit(d) not in CROSSINGS.get(m, ())} for m, deps in graph.items()}


@pytest.mark.parametrize(("one", "other"), INDEPENDENT, ids=[f"{a}|{b}" for a, b in INDEPENDENT])
def test_independent_siblings_import_nothing_of_each_other(one, other):
    graph = _without_crossings(_graph())
    for a, b in ((one, other), (other, one)):
        # the declared graph cannot allow it either, so that the rule cannot be bypassed by adding an edge
        declared = {u: set(deps) for u, deps in MAY_IMPORT.items()}
        starts = [u for u in MAY_IMPORT if _within(u, a)]
        assert not [u for u in reaches(declared, starts) if _within(u, b)], f"MAY_IMPORT lets {a} reach {b}"
        found = [
            f"{module} reaches {dep}"
            for module in sorted(m for m in graph if _within(m, a))
            for dep in sorted(reaches(graph, [module]))
            if _within(dep, b)
        ]
        assert not found, f"{a} must import nothing of {b}, even through other modules:\n" + "\n".join(found)


def test_each_crossing_is_still_there_and_crosses_an_independence_rule():
    graph = _graph()
    for module, packages in sorted(CROSSINGS.items()):
        for package in sorted(packages):
            assert any(_unit(d) == package for d in graph.get(module, ())), f"{module} no longer imports {package}"
            ruled = [(a, b) for a, b in INDEPENDENT for x, y in ((a, b), (b, a)) if _within(module, x) and package == y]
            assert ruled, f"{module} -> {package} breaks no rule of INDEPENDENT: declare it in MAY_IMPORT instead"


def test_the_tools_import_only_public_faces():
    inside = [
        f"{module} imports {dep}"
        for module, deps in sorted(_graph().items())
        if any(_within(module, tool) for tool in ONLY_FACES)
        for dep in sorted(deps)
        if not any(_within(dep, tool) for tool in ONLY_FACES) and dep not in FACES
    ]
    assert not inside, "fleet.plan and fleet.launch import modules that are no public face (FACES):\n" + "\n".join(
        inside
    )


def test_the_architecture_page_shows_the_same_graph():
    """docs/architecture.md holds MAY_IMPORT as a table: ``package | may import`` (GROUND spelled "ground")."""
    text = DOCS.read_text()
    table = text.split("| package | may import |", 1)[1].split("\n\n", 1)[0]  # the table, to its blank line
    rows = re.findall(r"^\| `([\w.]+)` \| (.*) \|$", table, flags=re.MULTILINE)
    shown: dict[str, set[str]] = {}
    for unit, deps in rows:
        names = set(re.findall(r"`([\w.]+)`", deps))
        shown[unit] = names | (GROUND if "ground" in deps else set())
    differing = sorted(u for u in set(shown) | set(MAY_IMPORT) if shown.get(u) != MAY_IMPORT.get(u))
    assert not differing, f"docs/architecture.md's table of the graph differs from MAY_IMPORT for: {differing}"


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
