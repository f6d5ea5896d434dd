"""Sparse embedding tables: where a ``fleet.nn.SparseEmbedding``'s rows live, chosen by the strategy.

A table module (``fleet.nn.SparseEmbedding``) registers its placeholder parameter here, so
that engines find the tables an optimizer holds (:func:`modules_in`) without importing
``fleet.nn``; each forward asks the active strategy for its :class:`TableBackend` and falls
back to the module's :class:`LocalRows`:

- single process: :class:`LocalRows`, a table in this process;
- collective: the same local table, with each step's row gradients merged over the workers
  first (:class:`LocalRows` with an ``exchange``), so every worker's copy stays identical;
- parameter server: rows pulled from the servers (:mod:`fleet.ps.rows`); the wrapped
  optimizer pushes their gradients.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

from fleet.ps.optim import OptimizerSpec, initial_rows
from fleet.ps.sparse_table import SparseTable

_BY_PLACEHOLDER: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()

Exchange = Callable[[Any, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]


class TableModule(Protocol):
    """What engines may use of a table module (``fleet.nn.SparseEmbedding``)."""

    placeholder: torch.nn.Parameter
    embedding_dim: int
    initializer: Any
    seed: int
    optimizer_override: OptimizerSpec | None

    def table_config(self, spec: OptimizerSpec) -> dict[str, Any]: ...

    def take_gradients(self) -> tuple[torch.Tensor, torch.Tensor]: ...


class TableBackend(Protocol):
    def pull(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows for unique int64 ``ids``."""

    def step(self, optimizer_class: type, group: dict[str, Any]) -> None:
        """The optimizer holding the table stepped: apply the pending row gradients (if this backend does)."""


def register(placeholder: torch.nn.Parameter, module: TableModule) -> None:
    _BY_PLACEHOLDER[id(placeholder)] = module


def module_of(placeholder: torch.Tensor) -> TableModule | None:
    module = _BY_PLACEHOLDER.get(id(placeholder))
    return module if module is not None and module.placeholder is placeholder else None


def any_registered() -> bool:
    return bool(_BY_PLACEHOLDER)


def modules_in(
    optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]] | None = None
) -> list[tuple[TableModule, dict[str, Any]]]:
    """The table modules whose placeholder is in ``optimizer`` (or in ``groups`` of it), with their group."""
    found = []
    for group in optimizer.param_groups if groups is None else groups:
        for p in group["params"]:
            module = module_of(p)
            if module is not None:
                found.append((module, group))
    return found


class LocalRows:
    """A table in this process (every module has one; it is the backend without a strategy)."""

    def __init__(self, module: TableModule):
        self._module = weakref.ref(module)
        self.table: SparseTable | None = None

    def pull(self, ids: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            return self.table.pull(ids)
        module = self._module()
        return initial_rows(ids, module.embedding_dim, module.initializer, module.seed)

    def step(self, optimizer_class: type, group: dict[str, Any], exchange: Exchange | None = None) -> None:
        module = self._module()
        ids, grads = module.take_gradients()
        lr = float(group["lr"])
        if exchange is not None:
            ids, grads = exchange(module, ids, grads, lr)
        self.apply(optimizer_class, group, ids, grads, lr)

    def apply(
        self, optimizer_class: type, group: dict[str, Any], ids: torch.Tensor, grads: torch.Tensor, lr: float
    ) -> None:
        module = self._module()
        if self.table is None:
            spec = module.optimizer_override or OptimizerSpec.from_torch(optimizer_class, group)
            self.table = SparseTable(module.embedding_dim, spec, module.initializer, module.seed)
        if ids.numel():
            self.table.apply_gradient(ids, grads, lr)


class ExchangedRows:
    """Collective mode: the module's local table, each step's row gradients merged over the workers first."""

    def __init__(self, local: LocalRows, exchange: Exchange):
        self.local = local
        self.exchange = exchange

    def pull(self, ids: torch.Tensor) -> torch.Tensor:
        return self.local.pull(ids)

    def step(self, optimizer_class: type, group: dict[str, Any]) -> None:
        self.local.step(optimizer_class, group, self.exchange)
