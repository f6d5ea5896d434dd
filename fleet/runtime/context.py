"""The job this process belongs to: one context per process, set by ``fleet.init``.

Everything below the public face (``fleet.nn``, the step recorder, the wrapped optimizer,
checkpoints) reaches the job through :func:`current` and :func:`strategy`, never through
``fleet.api``'s globals. This module imports nothing heavy, so torch-free modules may use it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

from fleet.roles.role import RoleInfo

__all__ = [
    "GRAD_SYNC_FLAG",
    "ActiveStrategy",
    "Job",
    "current",
    "no_sync",
    "read_grad_sync_flag",
    "set_current",
    "strategy",
]

GRAD_SYNC_FLAG = "require_backward_grad_sync"
"""DDP's attribute: False before a forward makes the backward after it skip the gradient reduction."""


class ActiveStrategy(Protocol):
    """What the layers below the strategies may ask of the one this process trains under
    (``fleet.strategies.base.Strategy`` implements it); they never import the strategies."""

    config: Any
    """The validated ``fleet.DistributedStrategy``."""

    def no_sync(self) -> AbstractContextManager: ...

    def defer_reduction(self, defer: bool) -> None: ...

    def table_backend(self, module: Any) -> Any: ...

    def all_reduce(self, values: Any, op: str = "sum") -> Any: ...

    def inference_state(self, model: Any) -> dict[str, Any]: ...

    def barrier(self) -> None: ...


class Job(Protocol):
    """This process's view of the job (``fleet.api.FleetContext`` implements it)."""

    role: RoleInfo
    strategy: Any
    """The job's ``fleet.DistributedStrategy``."""

    @property
    def active_strategy(self) -> ActiveStrategy | None: ...

    def process_group(self, timeout_s: float) -> Any: ...


_current: Job | None = None


def current() -> Job | None:
    """This process's job context, or None before ``fleet.init`` (and after ``fleet.stop_worker``)."""
    return _current


def set_current(context: Job | None) -> None:
    global _current
    _current = context


def strategy() -> ActiveStrategy | None:
    """The strategy this process trains under, once one was chosen (None before, or without fleet.init)."""
    return _current.active_strategy if _current is not None else None


def no_sync() -> AbstractContextManager:
    """DDP's ``no_sync()`` under the strategy this process trains with (nothing to pause without one).

    Looked up when called, so a model carrying it stays picklable and copyable.
    """
    chosen = strategy()
    return chosen.no_sync() if chosen is not None else nullcontext()


def read_grad_sync_flag(module: Any, args: Any) -> None:
    """A forward pre-hook: DDP's ``model.require_backward_grad_sync``, read where DDP reads it (at each forward
    with autograd on), so that ``model.require_backward_grad_sync = False`` on the micro-batches before the
    last skips their reductions, as nanoGPT's loop expects. A module-level function: the model stays picklable."""
    import torch

    chosen = strategy()
    if chosen is not None and torch.is_grad_enabled():
        chosen.defer_reduction(not module.__dict__.get(GRAD_SYNC_FLAG, True))
