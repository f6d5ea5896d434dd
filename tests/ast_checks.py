"""Static checks over fleet's source shared by the tests of the house (imports, ownership of state)."""

from __future__ import annotations

import ast
from pathlib import Path

TORCH_FIELDS = {"grad", "data", "weight", "bias"}  # a tensor's gradient or data, a module's parameters


def foreign_writes(tree: ast.Module) -> list[tuple[int, ast.Attribute]]:
    """Writes to another object's attributes: ``x.attr = ...`` (also augmented and annotated), and the same
    write spelled as a call: ``setattr(x, "attr", ...)``, ``object.__setattr__(x, "attr", ...)`` (any
    ``C.__setattr__(x, ...)``), ``vars(x)[...] = ...`` and ``x.__dict__[...] = ...``; ``x`` may be a module
    (``setattr(torch.autograd, "backward", ...)``). Not counted: writes to ``self``/``cls`` inside a method of
    their class (a function ``def f(cls)`` outside a class body gets no pass), a tensor's gradient or data, a
    module's parameters, ``os.environ``.

    A write spelled as a call comes back as the ``ast.Attribute`` it stands for (``x.attr``, or
    ``x.<expr>`` when the name is computed), with the call itself in its ``call`` attribute (:func:`describe`).
    """
    found = []
    for node, owners in _walk_with_owners(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [e for t in node.targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call):
            targets = [t for t in [_written_by_call(node)] if t is not None]
        for target in targets:
            if isinstance(target, ast.Subscript) and _is_dict_of(target.value) is not None:
                target = _as_attribute(_is_dict_of(target.value), _name_of(target.slice), target)
            if not isinstance(target, ast.Attribute) or target.attr in TORCH_FIELDS:
                continue
            if isinstance(target.value, ast.Name) and target.value.id in owners:
                continue
            if isinstance(target.value, ast.Attribute) and target.value.attr == "environ":
                continue
            found.append((node.lineno, target))
    return found


def describe(target: ast.Attribute) -> str:
    """How a write found by :func:`foreign_writes` is spelled in the source, for a test's message."""
    call = getattr(target, "call", None)
    if isinstance(call, ast.Call):
        return ast.unparse(call)
    if isinstance(call, ast.Subscript):
        return f"{ast.unparse(call)} = ..."
    return f"{ast.unparse(target)} = ..."


def _walk_with_owners(tree: ast.AST, owners: frozenset[str] = frozenset()):
    """Every node of ``tree`` with the names that are the object being defined there: ``self``/``cls``
    (the first parameter) inside a method of a class and the functions nested in it, nothing elsewhere."""
    for child in ast.iter_child_nodes(tree):
        inner = owners  # a function nested in a method closes over its self
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and isinstance(tree, ast.ClassDef):
            first = (child.args.posonlyargs + child.args.args)[:1]
            inner = frozenset(a.arg for a in first if a.arg in ("self", "cls", "mcls"))
        elif isinstance(child, ast.ClassDef):
            inner = frozenset()
        yield child, inner
        yield from _walk_with_owners(child, inner)


def _name_of(node: ast.expr) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return f"<{ast.unparse(node)}>"


def _as_attribute(obj: ast.expr, name: str, call: ast.AST) -> ast.Attribute:
    target = ast.Attribute(value=obj, attr=name, ctx=ast.Store())
    target.call = call  # type: ignore[attr-defined]
    return ast.copy_location(target, call)


def _written_by_call(node: ast.Call) -> ast.Attribute | None:
    """``setattr(x, name, v)`` or ``C.__setattr__(x, name, v)`` as the attribute it writes; else None."""
    func = node.func
    if isinstance(func, ast.Name) and func.id == "setattr" and len(node.args) == 3:
        return _as_attribute(node.args[0], _name_of(node.args[1]), node)
    if isinstance(func, ast.Attribute) and func.attr == "__setattr__" and len(node.args) == 3:
        return _as_attribute(node.args[0], _name_of(node.args[1]), node)  # object.__setattr__(x, name, v)
    if isinstance(func, ast.Attribute) and func.attr == "update" and _is_dict_of(func.value) is not None:
        return _as_attribute(_is_dict_of(func.value), "<__dict__.update>", node)
    return None


def _is_dict_of(node: ast.expr) -> ast.expr | None:
    """``x`` for ``x.__dict__`` or ``vars(x)``; else None."""
    if isinstance(node, ast.Attribute) and node.attr == "__dict__":
        return node.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars" and node.args:
        return node.args[0]
    return None


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
