"""The collective engine owns its state: no module of it (or of the strategies composing it) assigns
another object's attributes; callers use methods (GradSync.arm/pause/resume, Lockstep.finish, ...)."""

from __future__ import annotations

import ast
import pathlib

import fleet
from ast_checks import foreign_writes

ROOT = pathlib.Path(fleet.__file__).parent
AREA = ["collective", "sharding", "strategies/collective.py", "strategies/sharding.py"]
# FSDP2 has no public hook before a reduce-scatter: fleet.sharding.order wraps its parameter group's.
# PyTorch has none before a backward starts: fleet.sharding.autograd's one owner puts fleet's
# torch.autograd.backward/grad in place while a sharding strategy holds them, and torch's back after.
ALLOWED = {("sharding/order.py", "param_group.post_backward"), ("sharding/autograd.py", "torch.autograd.<name>")}


def _writes(path: pathlib.Path) -> list[str]:
    return [ast.unparse(target) for _, target in foreign_writes(ast.parse(path.read_text()))]


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
