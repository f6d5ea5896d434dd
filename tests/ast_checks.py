"""Static checks over fleet's source shared by the tests of the house (imports, ownership of state)."""

from __future__ import annotations

import ast
from pathlib import Path

TORCH_FIELDS = {"grad", "data", "weight", "bias"}  # a tensor's gradient or data, a module's parameters


def foreign_writes(tree: ast.Module) -> list[tuple[int, ast.Attribute]]:
    """Assignments to another object's attributes: ``x.attr = ...`` where ``x`` is not ``self``/``cls``
    (a tensor's gradient or data, a module's parameters and ``os.environ`` are not counted)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = [e for t in node.targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        for target in targets:
            if not isinstance(target, ast.Attribute) or target.attr in TORCH_FIELDS:
                continue
            if isinstance(target.value, ast.Name) and target.value.id in ("self", "cls"):
                continue
            if isinstance(target.value, ast.Attribute) and target.value.attr == "environ":
                continue
            found.append((node.lineno, target))
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the fleet modules it imports, counting imports inside functions and under
    ``TYPE_CHECKING`` (``root`` is the ``fleet`` package directory)."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
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


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (found := visit(dep)) is not None:
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)) is not None:
            return found
    return None


def reaches(graph: dict[str, set[str]], starts: list[str]) -> set[str]:
    """Every module ``starts`` import, directly or through others (``starts`` themselves only if in a circle)."""
    seen: set[str] = set()
    todo = [dep for start in starts for dep in graph.get(start, ())]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph.get(module, ()))
    return seen
