"""Objects own their state: a module changes another object through its methods, never by assigning
its attributes (``x.a = ...``, nor the same write spelled ``setattr(x, "a", ...)``,
``object.__setattr__(x, "a", ...)``, ``vars(x)[...] = ...`` or ``setattr`` on a module), and never reads
another module's private attributes.

tests/collective/test_ownership.py holds the collective engine to the same rule with no exception;
this test covers the whole package. The exceptions below are not fleet's engines: third-party
objects whose API is attribute assignment, plain records owned by the module that defines them, and
the process-wide patches that remain, each with its one owner (docs/architecture.md, "Process-wide
patches").
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import fleet
from ast_checks import describe, foreign_writes

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
    "training/optimizer.py": {"self._inner"},
    "ps/worker/optimizer.py": {"self._inner"},
    # The interpreter's excepthook.
    "runtime/excepthook.py": {"hook", "sys"},
    # FSDP2 has no public hook before a reduce-scatter (see tests/collective/test_ownership.py).
    "sharding/order.py": {"param_group"},
    # The simulation's own state record, the supervisor's own process slots.
    "plan/simulation.py": {"sim"},
    "launch/supervisor.py": {"slot"},
    # The probe is a script that runs the user's script as __main__ in its own process (sys.argv), and
    # its hooks feed the probe's own counters.
    "plan/probe.py": {"sys", "probe"},
    # PyTorch has no hook before a backward starts nor one that changes the tensors named as inputs:
    # fleet's torch.autograd.backward/grad stand in for torch's while a sharding strategy holds them
    # (sharding.autograd._Patch, the one owner; torch's are back at fleet.stop_worker() and at exit).
    "sharding/autograd.py": {"torch"},
    # distributed_model gives the user's model DDP's surface, reached by attribute in DDP's API:
    # model.module (set past nn.Module's __setattr__: no submodule), model.no_sync(),
    # model.require_backward_grad_sync.
    "api.py": {"model"},
    # The undo log puts back the attributes its caller asked it to keep (undo.attrs(obj, names)).
    "sparse/undo.py": {"obj"},
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
        f"{module}:{line}: {describe(target)}"
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


def test_the_check_sees_writes_spelled_as_calls():
    """Writes that are not assignment statements (issue 37: seven of them went unseen)."""
    source = """
import torch

def patch(model, cls, fn):
    setattr(torch.autograd, "backward", fn)
    setattr(cls, fn.__name__, fn)
    object.__setattr__(model, "module", model)
    torch.nn.Module.__setattr__(model, "flag", True)
    vars(model)["a"] = 1
    model.__dict__["b"] = 2
    model.__dict__.update(c=3)
    model.d += 1

class Owner:
    def __init__(self):
        setattr(self, "a", 1)
        object.__setattr__(self, "b", 2)
        self.__dict__["c"] = 3

        def later():
            self.d = 4  # a closure over its own self

    @classmethod
    def make(cls):
        setattr(cls, "e", 5)
"""
    found = [describe(target) for _, target in foreign_writes(ast.parse(source))]
    assert found == [
        "setattr(torch.autograd, 'backward', fn)",
        "setattr(cls, fn.__name__, fn)",  # a function's parameter called cls is no class of its own
        "object.__setattr__(model, 'module', model)",
        "torch.nn.Module.__setattr__(model, 'flag', True)",
        "vars(model)['a'] = ...",
        "model.__dict__['b'] = ...",
        "model.__dict__.update(c=3)",
        "model.d = ...",
    ]
    roots = [_root(target) for _, target in foreign_writes(ast.parse(source))]
    assert roots == ["torch", "cls", "model", "model", "model", "model", "model", "model"]
