"""Static checks over fleet's source shared by the tests of the house (ownership of state)."""

from __future__ import annotations

import ast

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
