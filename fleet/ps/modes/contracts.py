"""What an update mode drives, declared: the client's calls, the worker's dense tables, the wrapped optimizer.

The modes sit below the client and the worker (both import them), so they cannot name the
classes they drive. They declare here what they use of them instead, as protocols:
:class:`ServerCalls` is the part of ``fleet.ps.client.client.PSClient`` a mode and its row
backends call, :class:`DenseTables` the worker's flat tables (``fleet.ps.worker.dense_tables``),
:class:`WorkerHost` the wrapped optimizer (``fleet.ps.worker.optimizer.PSOptimizer``). A client
or a stand-in that has these methods can be driven by every mode; nothing here imports them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

import torch

from fleet.ps.protocol.wire import SparsePush
from fleet.sparse.backends import TableModule


class ServerCalls(Protocol):
    """The parameter-server requests of an update mode; each returns a future at once (``PSClient``'s methods)."""

    num_servers: int

    def push_dense_grad(
        self, table_id: int, grad: torch.Tensor, step: int, lr: float, present: torch.Tensor | None = None
    ) -> Future: ...

    def push_dense_delta(self, table_id: int, delta: torch.Tensor) -> Future: ...

    def pull_sparse(self, table_id: int, ids: torch.Tensor, min_version: int = 0) -> Future: ...

    def pull_sparse_many(self, requests: Sequence[tuple[int, torch.Tensor, int]]) -> Future: ...

    def push_sparse_grads_many(self, pushes: Sequence[SparsePush]) -> Future: ...

    def push_sparse_delta(
        self, table_id: int, ids: torch.Tensor, deltas: torch.Tensor, step: int = 0, clicks: torch.Tensor | None = None
    ) -> Future: ...

    def sparse_rows(self, table_id: int) -> Future: ...

    def shrink(self, table_id: int, threshold: float | None = None, timeout_s: float | None = None) -> Future: ...

    def export_sparse(self, table_id: int) -> Future: ...

    def read_sparse_page(self, table_id: int, server: int, start: int) -> Future: ...

    def write_sparse_rows(
        self, table_id: int, ids: torch.Tensor, fields: dict[str, torch.Tensor], replace: bool = False
    ) -> Future: ...


class DenseEntry(Protocol):
    """One param group's flat dense table on a worker."""

    table_id: int
    version: int
    base: torch.Tensor
    params: list[torch.Tensor]

    @property
    def lr(self) -> float: ...

    def values(self) -> torch.Tensor: ...

    def grads(self) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def mark_clean(self) -> None: ...


class DenseTables(Protocol):
    """A worker's dense tables: pulled from the servers, then adopted into the parameters."""

    @property
    def entries(self) -> Sequence[DenseEntry]: ...

    def pull(
        self, entries: Sequence[DenseEntry] | None = None, min_versions: Sequence[int] | None = None
    ) -> list[Future]: ...

    def adopt(
        self,
        futures: Sequence[Future],
        entries: Sequence[DenseEntry] | None = None,
        version: bool = True,
        base: bool = False,
        check: Callable[[DenseEntry, torch.Tensor], None] | None = None,
    ) -> None: ...


class WorkerHost(Protocol):
    """What a worker policy uses of the wrapped optimizer (``fleet.ps.worker.optimizer.PSOptimizer``)."""

    client: ServerCalls
    tables: DenseTables
    # (table module, param group index, rows): the rows are the backend the mode's rows() made
    sparse: list[tuple[TableModule, int, Any]]

    @property
    def inner(self) -> torch.optim.Optimizer: ...
