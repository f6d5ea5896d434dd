"""Non-finite updates never reach a table: the one check every table owner runs, and what follows.

One bad batch (a NaN or Inf gradient) applied to a table would make it non-finite for good: an
optimizer's state (Adagrad's sum of squares, Adam's moments) keeps a NaN forever. So every place
that changes a table checks the update first -- a process's own table (``LocalRows.apply``, after
the collective exchange, so every replica decides alike), geo's cached rows and local step, the
parameter-server worker before it pushes, and each server shard for every push it receives --
and under the strategy's ``nonfinite`` option:

- ``"skip"`` (default, as AMP's ``GradScaler`` skips an inf step): the update is dropped whole,
  the table is exactly as before, and a warning names the table and the step;
- ``"error"``: :class:`NonFiniteUpdateError` names the table and the step instead.
"""

from __future__ import annotations

import math
import warnings

import torch

from fleet.errors import FleetError
from fleet.runtime import context
from fleet.sparse.native import kernels

POLICIES = ("skip", "error")


class NonFiniteUpdateError(FleetError, FloatingPointError):
    """An update holding NaN or Inf under ``nonfinite="error"``."""


def finite(*values: torch.Tensor | float | None) -> bool:
    """Whether every value (tensors, numbers such as a learning rate; None: absent) is finite."""
    for value in values:
        if value is None:
            continue
        if isinstance(value, torch.Tensor):
            if value.is_sparse:
                value = value.coalesce().values()
            if value.numel() and value.is_floating_point() and not _all_finite(value):
                return False
        elif not math.isfinite(float(value)):
            return False
    return True


def _all_finite(value: torch.Tensor) -> bool:
    # float32 on the CPU (every push a server checks): one native pass, no temporary bool tensor
    if value.dtype == torch.float32 and value.device.type == "cpu" and value.is_contiguous():
        return kernels.all_finite(value.detach().reshape(-1).numpy())
    return bool(torch.isfinite(value).all())


def policy() -> str:
    """The job's ``nonfinite`` option ("skip" without a strategy: one plain process)."""
    chosen = context.strategy()
    value = getattr(getattr(chosen, "config", None), "nonfinite", "skip") if chosen is not None else "skip"
    return value if value in POLICIES else "skip"


def refuse(table: str, step: int | str | None, where: str, rule: str | None = None) -> None:
    """An update of ``table`` at ``step`` holds NaN or Inf: warn that it is skipped, or raise under "error"."""
    rule = rule or policy()
    at = f" at step {step}" if step is not None else ""
    if rule == "error":
        raise NonFiniteUpdateError(
            f"{table}{at}: the update holds NaN or Inf ({where}); nonfinite='error' stops here. "
            "Find the batch that produced it, or set nonfinite='skip' to skip such updates."
        )
    warnings.warn(
        f"{table}{at}: the update holds NaN or Inf and was skipped ({where}); the table is as it was "
        "(nonfinite='skip')",
        RuntimeWarning,
        stacklevel=3,
    )


__all__ = ["POLICIES", "NonFiniteUpdateError", "finite", "policy", "refuse"]
