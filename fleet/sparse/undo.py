"""An undo log that makes a table operation all-or-nothing.

Why: a table operation is a sequence of whole-batch torch ops, and any of them can fail --
above all an allocation when the server runs out of memory. Before this log a failure
half-way left the table half-changed for good (the id index already held ids whose rows
were never allocated, so every later pull failed with ``index out of range``). Now every
change to a table's live state is recorded just before it is made, as the step that undoes
it, and a failure anywhere rolls the steps back, newest first, then re-raises: the table is
exactly as before and keeps working.

What is recorded is small: the old values at the positions a batch writes (a batch's worth,
gathered before the write), Python attributes, and references to tensors that an operation
replaces (growing storage allocates new tensors, so the old ones are kept, not copied).
Writes beyond a table's live length need no record: nothing reads there.

Tensors are named by a getter, not held, wherever storage may be replaced later in the same
operation: the undo must write into the tensor the table holds when it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Getter = Callable[[], torch.Tensor]


class UndoLog:
    """Steps that put a table back as it was; :meth:`rollback` runs them newest first."""

    def __init__(self) -> None:
        self._steps: list[Callable[[], None]] = []

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, step: Callable[[], None]) -> None:
        """Record a step that undoes the change about to be made."""
        self._steps.append(step)

    def rows(self, get: Getter, index: torch.Tensor, old: torch.Tensor | None = None) -> None:
        """Before ``get()`` changes at ``index`` (dim 0; repeats allowed): keep the old rows.

        ``old``: the rows at ``index`` already gathered by the caller (saves a second gather).
        """
        if old is None:
            old = get().index_select(0, index)
        self._steps.append(lambda: get().index_copy_(0, index, old))

    def span(self, get: Getter, lo: int, hi: int) -> None:
        """Before ``get()[lo:hi]`` changes: keep a copy of it."""
        old = get()[lo:hi].clone()
        self._steps.append(lambda: get()[lo:hi].copy_(old))

    def attrs(self, obj: Any, *names: str) -> None:
        """Before attributes of ``obj`` change (or their objects are replaced): keep their values."""
        saved = [(name, getattr(obj, name)) for name in names]

        def restore() -> None:
            for name, value in saved:
                setattr(obj, name, value)

        self._steps.append(restore)

    def rollback(self) -> None:
        while self._steps:
            self._steps.pop()()


def field_getter(obj: Any, attr: str, key: str | None = None) -> Getter:
    """A getter of ``obj.<attr>`` (or ``obj.<attr>[key]`` for a dict of tensors), resolved when called."""
    if key is None:
        return lambda: getattr(obj, attr)
    return lambda: getattr(obj, attr)[key]
