"""The job this process belongs to: one context per process, set by ``fleet.init``.

Everything below the public face (``fleet.nn``, the step recorder, the wrapped optimizer,
checkpoints) reaches the job through :func:`current` and :func:`strategy`, never through
``fleet.api``'s globals. This module imports nothing heavy, so torch-free modules may use it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fleet.api import FleetContext
    from fleet.strategies.base import Strategy

_current: FleetContext | None = None


def current() -> FleetContext | None:
    """This process's job context, or None before ``fleet.init`` (and after ``fleet.stop_worker``)."""
    return _current


def set_current(context: FleetContext | None) -> None:
    global _current
    _current = context


def strategy() -> Strategy | None:
    """The strategy this process trains under, once one was chosen (None before, or without fleet.init)."""
    return _current.active_strategy if _current is not None else None


def no_sync() -> AbstractContextManager:
    """DDP's ``no_sync()`` under the strategy this process trains with (nothing to pause without one).

    Looked up when called, so a model carrying it stays picklable and copyable.
    """
    chosen = strategy()
    return chosen.no_sync() if chosen is not None else nullcontext()
