"""SparseEmbedding: embedding rows keyed by arbitrary int64 ids, with no vocabulary size.

One module serves every mode. Each forward looks up the batch's unique ids, as a
leaf tensor that collects the per-row gradients, and expands them to the batch
through the inverse index. Where the rows live:

- single process and collective mode: a local :class:`~fleet.ps.sparse_table.SparseTable`,
  updated whenever the optimizer that holds this module's parameters steps (a
  torch optimizer step hook, so even an unwrapped ``torch.optim.SGD`` trains it).
  With N collective workers the (ids, row gradients) are all-gathered and every
  worker applies the same averaged update, so the tables stay identical;
- parameter-server mode: rows are pulled from the servers; the wrapped optimizer
  (:mod:`fleet.ps.worker`) pushes the row gradients.

The module owns a zero-size placeholder ``nn.Parameter`` so that it appears in
``model.parameters()``: the optimizer holding the placeholder is the one that
updates the rows, with its class and hyper-parameters unless ``optimizer`` overrides them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from fleet.ps.optim import InitializerSpec, OptimizerSpec, initial_rows
from fleet.ps.sparse_table import SparseTable

_BY_PLACEHOLDER: weakref.WeakValueDictionary[int, SparseEmbedding] = weakref.WeakValueDictionary()


def _initializer(value: Any) -> InitializerSpec:
    if value is None:
        return InitializerSpec()
    if isinstance(value, InitializerSpec):
        return value
    if isinstance(value, dict):
        return InitializerSpec.from_config(value)
    if isinstance(value, str):
        return InitializerSpec(kind=value)  # type: ignore[arg-type]
    raise TypeError(f"initializer must be an InitializerSpec, a dict or a kind name, got {type(value).__name__}")


def _optimizer(value: Any) -> OptimizerSpec | None:
    """None (follow the dense optimizer), an OptimizerSpec, a dict, or (torch optimizer class, kwargs)."""
    if value is None or isinstance(value, OptimizerSpec):
        return value
    if isinstance(value, dict):
        return OptimizerSpec.from_config(value)
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], type):
        probe = value[0]([torch.zeros(1, requires_grad=True)], **value[1])
        return OptimizerSpec.from_torch(value[0], probe.param_groups[0])
    raise TypeError("optimizer must be None, an OptimizerSpec, a dict, or (torch.optim class, kwargs)")


class SparseEmbedding(nn.Module):
    """``SparseEmbedding(16)(ids)`` -> ``[*ids.shape, 16]``; rows are created on first touch."""

    def __init__(
        self,
        embedding_dim: int,
        initializer: InitializerSpec | dict | str | None = None,
        optimizer: Any = None,
        seed: int | None = None,
    ):
        super().__init__()
        if isinstance(embedding_dim, bool) or not isinstance(embedding_dim, int) or embedding_dim <= 0:
            raise ValueError(f"embedding_dim must be an int > 0, got {embedding_dim!r}")
        self.embedding_dim = embedding_dim
        self.initializer = _initializer(initializer)
        self.optimizer_override = _optimizer(optimizer)
        self.seed = 0 if seed is None else int(seed)
        self.placeholder = nn.Parameter(torch.empty(0))
        _BY_PLACEHOLDER[id(self.placeholder)] = self
        self.remote: Any = None
        """Set by the parameter-server optimizer: an object with ``pull(unique_ids) -> rows``."""
        self.table: SparseTable | None = None
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def extra_repr(self) -> str:
        return f"{self.embedding_dim}, initializer={self.initializer.kind}, seed={self.seed}"

    def table_config(self, spec: OptimizerSpec) -> dict[str, Any]:
        return {
            "dim": self.embedding_dim,
            "optimizer": (self.optimizer_override or spec).to_config(),
            "initializer": self.initializer.to_config(),
            "seed": self.seed,
        }

    # ------------------------------------------------------------------ lookup
    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.remote is not None:
            return self.remote.pull(ids)
        if self.table is not None:
            return self.table.pull(ids)
        return initial_rows(ids, self.embedding_dim, self.initializer, self.seed)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            raise TypeError(f"SparseEmbedding takes integer ids, got {ids.dtype}")
        unique, inverse = torch.unique(ids.reshape(-1).to(torch.int64), return_inverse=True)
        rows = self._rows(unique)
        if torch.is_grad_enabled() and self.training:
            rows = rows.detach().requires_grad_(True)
            self._pending.append((unique, rows))
        return rows.index_select(0, inverse).reshape(*ids.shape, self.embedding_dim)

    def take_gradients(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, row gradients) of every forward since the last call; ids may repeat."""
        pending, self._pending = self._pending, []
        if not pending:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, self.embedding_dim)
        ids = torch.cat([u for u, _ in pending])
        grads = torch.cat([r.grad if r.grad is not None else torch.zeros_like(r) for _, r in pending])
        return ids, grads.detach()

    # ------------------------------------------------------------------ local updates
    def local_table(self, spec: OptimizerSpec) -> SparseTable:
        if self.table is None:
            self.table = SparseTable(self.embedding_dim, self.optimizer_override or spec, self.initializer, self.seed)
        return self.table

    def apply_local(self, optimizer_class: type, group: dict[str, Any]) -> None:
        """Apply this step's row gradients to the local table (averaged over collective workers)."""
        ids, grads = self.take_gradients()
        lr = float(group["lr"])
        if _row_exchange is not None:
            ids, grads = _row_exchange(self, ids, grads, lr)
        self.apply_rows(optimizer_class, group, ids, grads, lr)

    def apply_rows(
        self, optimizer_class: type, group: dict[str, Any], ids: torch.Tensor, grads: torch.Tensor, lr: float
    ) -> None:
        table = self.local_table(OptimizerSpec.from_torch(optimizer_class, group))
        if ids.numel():
            table.apply_gradient(ids, grads, lr)


# Set by the collective strategy: merges a table's (ids, row gradients) over the workers, so that
# every worker applies the same update and the local tables stay identical.
RowExchange = Callable[["SparseEmbedding", torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
_row_exchange: RowExchange | None = None


def set_row_exchange(exchange: RowExchange | None) -> None:
    global _row_exchange
    _row_exchange = exchange


def module_of(placeholder: torch.Tensor) -> SparseEmbedding:
    """The SparseEmbedding whose placeholder parameter this is."""
    module = _BY_PLACEHOLDER.get(id(placeholder))
    if module is None or module.placeholder is not placeholder:
        raise KeyError("not a SparseEmbedding placeholder")
    return module


def all_gather_rows(
    ids: torch.Tensor, grads: torch.Tensor, group: Any, active: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every worker's (ids, grads), merged; gradients divided by the ``active`` workers (averaged)."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    dim = grads.shape[1]
    count = torch.tensor([ids.numel()], dtype=torch.int64)
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    longest = max(int(c.item()) for c in counts)
    padded_ids = torch.zeros(longest, dtype=torch.int64)
    padded_ids[: ids.numel()] = ids
    padded = torch.zeros(longest, dim)
    padded[: ids.numel()] = grads
    all_ids = [torch.empty_like(padded_ids) for _ in range(world)]
    all_grads = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(all_ids, padded_ids, group=group)
    dist.all_gather(all_grads, padded, group=group)
    n = [int(c.item()) for c in counts]
    merged_ids = torch.cat([t[:k] for t, k in zip(all_ids, n, strict=True)])
    merged = torch.cat([t[:k] for t, k in zip(all_grads, n, strict=True)]).div_(active)
    return merged_ids, merged


def _on_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global step hook: an optimizer holding a SparseEmbedding's placeholder updates its local rows."""
    if not _BY_PLACEHOLDER:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            module = _BY_PLACEHOLDER.get(id(p))
            if module is not None and module.placeholder is p and module.remote is None:
                module.apply_local(type(optimizer), group)


register_optimizer_step_post_hook(_on_optimizer_step)


def sparse_modules(
    optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]] | None = None
) -> list[tuple[SparseEmbedding, dict[str, Any]]]:
    """The SparseEmbeddings whose placeholder is in ``optimizer`` (or in ``groups`` of it), with their group."""
    found = []
    for group in optimizer.param_groups if groups is None else groups:
        for p in group["params"]:
            module = _BY_PLACEHOLDER.get(id(p))
            if module is not None and module.placeholder is p:
                found.append((module, group))
    return found
