"""Objects own their state: a module changes another object through its methods, never by assigning
its attributes, and never reads another module's private attributes.

tests/collective/test_ownership.py holds the collective engine to the same rule with no exception;
this test covers the whole package. The exceptions below are not fleet's engines: third-party
objects whose API is attribute assignment, and plain records owned by the module that defines them.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import fleet
from ast_checks import foreign_writes

ROOT = Path(fleet.__file__).parent
TORCH_PRIVATE = {"_values", "_indices", "_version", "_parameters", "_modules"}  # torch's own, same names as ours

# module -> the names (roots of the assigned expression) it may assign attributes of, and why.
ALLOWED_WRITES: dict[str, set[str]] = {
    # ZeroMQ socket options are attributes in pyzmq's API.
    "ps/protocol/auth.py": {"sock", "self.socket"},
    "ps/server/loop.py": {"sock"},
    # The IO thread's own request records, and the message it stamps with a request id and deadline.
    "ps/client/io.py": {"sock", "job", "msg"},
    # Pulled tensors carry the servers' version as an attribute.
    "ps/client/client.py": {"t"},
    # The two generations of an id index are instances of the same class.
    "sparse/id_index.py": {"fresh", "old"},
    # ctypes declares a foreign function's signature by assignment.
    "sparse/pages.py": {"fn"},
    # The wrapped torch optimizer's own fields (the wrapper is a proxy of its surface).
    "training/optimizer.py": {"self._inner", "call"},
    "ps/worker/optimizer.py": {"self._inner"},
    # The interpreter's excepthook.
    "runtime/excepthook.py": {"hook", "sys"},
    # FSDP2 has no public hook before a reduce-scatter (see tests/collective/test_ownership.py).
    "sharding/order.py": {"param_group"},
    # The simulation's own state record, the supervisor's own process slots.
    "plan/simulation.py": {"sim"},
    "launch/supervisor.py": {"slot"},
    # The probe is a script that instruments the step recorder inside its own process.
    "plan/probe.py": {"recorder", "sys", "probe"},
}


def _modules() -> dict[str, ast.Module]:
    return {str(p.relative_to(ROOT)): ast.parse(p.read_text()) for p in sorted(ROOT.rglob("*.py"))}


def _root(node: ast.expr) -> str:
    """``a.b.c`` -> ``a`` (or ``self.b`` for attributes of self's attributes)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    name = node.id if isinstance(node, ast.Name) else ast.unparse(node)
    if name in ("self", "cls") and len(parts) >= 2:
        return f"{name}.{parts[-1]}"
    return name


def test_no_module_assigns_another_objects_attributes():
    offenders = [
        f"{module}:{line}: {ast.unparse(target)} = ..."
        for module, tree in _modules().items()
        for line, target in foreign_writes(tree)
        if _root(target) not in ALLOWED_WRITES.get(module, set())
    ]
    assert not offenders, "give the object a method instead:\n" + "\n".join(offenders)


def test_no_module_reads_another_modules_private_attributes():
    trees = _modules()
    owners: dict[str, set[str]] = defaultdict(set)  # private attribute -> modules whose classes set it on self
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                owners[node.attr].add(module)
    offenders = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or node.attr not in owners or node.attr in TORCH_PRIVATE:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if module not in owners[node.attr]:
                offenders.append(
                    f"{module}:{node.lineno}: {ast.unparse(node)} (private to {sorted(owners[node.attr])})"
                )
    assert not offenders, "use a public method or property instead:\n" + "\n".join(offenders)
