"""The collective engine owns its state: no module of it (or of the strategies composing it) assigns
another object's attributes; callers use methods (GradSync.arm/pause/resume, Lockstep.finish, ...)."""

from __future__ import annotations

import ast
import pathlib

import fleet

ROOT = pathlib.Path(fleet.__file__).parent
AREA = ["collective", "sharding", "strategies/collective.py", "strategies/sharding.py"]
TORCH_FIELDS = {"grad", "data", "weight", "bias"}  # a tensor's gradient or data, a module's parameters
# FSDP2 has no public hook before a reduce-scatter: fleet.sharding.order wraps its parameter group's.
ALLOWED = {("sharding/order.py", "param_group.post_backward")}


def _writes(path: pathlib.Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
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
            found.append(ast.unparse(target))
    return found


def test_no_module_assigns_another_objects_attributes():
    paths = []
    for part in AREA:
        path = ROOT / part
        paths += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    assert len(paths) > 10
    offenders = [
        f"{path.relative_to(ROOT)}: {write}"
        for path in paths
        for write in _writes(path)
        if (str(path.relative_to(ROOT)), write) not in ALLOWED
    ]
    assert offenders == []
