"""What a row optimizer is: one object holding everything fleet needs to know about one update rule.

Why one object: the optimizer kind of a table travels as a name (``OptimizerSpec.kind``, a table's
save, a PS server's table config), and every place that used that name (the spec's fields and checks,
the per-row state a table stores, whether it counts steps, the native kernel's arguments, the
torch math it must equal, the torch class it stands for) asks the object instead. Adding a rule is a
new subclass in its own module and one line in :mod:`fleet.sparse.row_optimizers`.

The update contract: :meth:`RowOptimizer.update` is the plain-torch reference of the rule (what the
native kernel, ``apply_rows`` in ``fleet/sparse/csrc``, must equal within float32 rounding). It gets
``g`` with ``maximize`` and (unless :attr:`RowOptimizer.decoupled_weight_decay`) weight decay already
applied, and ``step`` either as an ``int`` (dense: one step for the whole block) or as an int64 tensor
``[rows]`` (each row's own step, already counted for this update).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import pydantic
import torch


class Hyper(pydantic.BaseModel, frozen=True, extra="forbid"):
    """An optimizer's own hyper-parameters (besides ``lr``, ``weight_decay`` and ``maximize``, which every rule
    reads); a subclass declares the fields, their defaults and their checks."""


def finite_non_negative(model: pydantic.BaseModel, *names: str) -> None:
    """Raise ``ValueError`` naming the first of ``names`` that is not a finite number >= 0."""
    for name in names:
        value = getattr(model, name)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value}")


class RowOptimizer:
    """One update rule for sparse table rows (and the PS servers' dense blocks, where it has a torch class)."""

    #: the kind's name: ``OptimizerSpec.kind``, in saves and on the wire
    name: ClassVar[str]
    #: its hyper-parameters (fields, defaults, checks)
    hyper: ClassVar[type[Hyper]]
    #: its entry in the native kernel (``OptKind`` in fleet/sparse/csrc/rows.cpp)
    native_kind: ClassVar[int]
    #: weight decay applied by the rule itself (AdamW), not added to the gradient
    decoupled_weight_decay: ClassVar[bool] = False
    #: the torch.optim classes it stands for, as errors name them (empty: a table-only rule, given as data)
    torch_names: ClassVar[tuple[str, ...]] = ()

    def state_names(self, spec: Any) -> tuple[str, ...]:
        """The per-row state tensors it keeps (``state.<name>`` in a save), in the kernel's order."""
        raise NotImplementedError

    def state_width(self, spec: Any) -> int | None:
        """Columns of each state tensor: None for one per element (``dim``), else that many (row-wise rules)."""
        return None

    def needs_step(self, spec: Any) -> bool:
        """Whether the math reads each row's step count (tables count steps only then)."""
        return False

    def initial_state(self, spec: Any, name: str) -> float:
        """The value a new row's state tensor ``name`` starts at."""
        return 0.0

    def update(
        self, spec: Any, param: torch.Tensor, g: torch.Tensor, state: dict[str, torch.Tensor], step: Any, lr: float
    ) -> None:
        """The rule in plain torch, in place on ``param`` and ``state`` (see the module docstring)."""
        raise NotImplementedError

    def native_params(self, spec: Any) -> tuple[float, ...]:
        """The rule's own hyper-parameters in the order its kernel reads them (``apply_rows``' hyper tuple)."""
        raise NotImplementedError

    def from_torch(self, optimizer_class: type, group: dict[str, Any], rows: bool, where: str) -> dict | None:
        """The spec config (without ``lr``, ``weight_decay``, ``maximize``) for a torch class it stands for, or None."""
        return None

    def torch_state(self, pieces: dict[str, torch.Tensor], step: int) -> dict[str, Any]:
        """One dense parameter's state as the torch.optim class keeps it, from the servers' state ``pieces``."""
        if step <= 0:
            return {}  # never stepped: torch has no state for it yet
        return {"step": torch.tensor(float(step)), **pieces}


def number(group: dict[str, Any], key: str, default: float) -> float:
    """A param group's hyper-parameter as a float (torch allows tensors for some)."""
    v = group.get(key, default)
    return float(v.item()) if isinstance(v, torch.Tensor) else float(v)
