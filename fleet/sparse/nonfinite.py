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


def _all_finite(t: torch.Tensor) -> bool:
    """Whether every element of a floating-point tensor is finite, without a mask the size of ``t``.

    Why not ``torch.isfinite(t).all()``: it writes a bool tensor as large as ``t`` and was 10x
    slower (3.9 ms for W2's 500k dense gradients, run on every push of every worker and server).
    A NaN or Inf element makes the sum non-finite, so a finite sum settles it in one pass; a
    non-finite sum may also be an overflow of finite values, which ``aminmax`` (NaN-propagating)
    tells apart. A contiguous float32 CPU tensor (every gradient fleet checks) takes the native
    one-pass, vectorised check of the exponent bits instead.
    """
    if t.dtype is torch.float32 and t.is_cpu and t.is_contiguous():
        return bool(kernels.all_finite((t if not t.requires_grad else t.detach()).view(-1).numpy()))
    if bool(torch.isfinite(t.sum())):
        return True
    low, high = torch.aminmax(t)
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


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
