"""Sparse embedding tables: where a ``fleet.nn.SparseEmbedding``'s rows live, chosen by the strategy.

A table module (``fleet.nn.SparseEmbedding``) registers its placeholder parameter here, so
that engines find the tables an optimizer holds (:func:`modules_in`) without importing
``fleet.nn``; each forward asks the active strategy for its :class:`TableBackend` and falls
back to the module's :class:`LocalRows`:

- single process: :class:`LocalRows`, a table in this process;
- collective: the same local table, with each step's row gradients merged over the workers
  first (:class:`LocalRows` with an ``exchange``), so every worker's copy stays identical;
- parameter server: rows pulled from the servers (:mod:`fleet.ps.modes.rows`), whose update
  mode picks them.

**One owner applies row gradients:** the backend's :meth:`TableBackend.step`, run by one torch
optimizer step hook (:func:`step_tables`) when the optimizer holding a module's placeholder steps.
A local table (single process, collective, and geo's cache of the servers' rows) applies them
there; rows the servers update have no local step (theirs refuses): the parameter-server update
mode sends their gradients and the servers apply them.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from fleet.sparse import nonfinite
from fleet.sparse.optim import OptimizerSpec, initial_rows
from fleet.sparse.table import SparseTable

_BY_PLACEHOLDER: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_ORDER: dict[int, int] = {}  # registration order, so that every worker walks its tables alike

Exchange = Callable[[Any, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]


class TableModule(Protocol):
    """What engines may use of a table module (``fleet.nn.SparseEmbedding``)."""

    placeholder: torch.nn.Parameter
    embedding_dim: int
    initializer: Any
    seed: int
    optimizer_override: OptimizerSpec | None
    lifecycle: Any

    def table_config(self, spec: OptimizerSpec) -> dict[str, Any]: ...

    def backend(self) -> TableBackend: ...

    def take_gradients(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...


class TableBackend(Protocol):
    def pull(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows for unique int64 ``ids``."""

    def step(self, optimizer_class: type, group: dict[str, Any]) -> None:
        """The optimizer holding the table stepped: apply the pending row gradients (the one place they are)."""

    def num_rows(self) -> int:
        """The rows the table holds now (all of its shards)."""

    def shrink(self, threshold: float | None) -> int:
        """Evict expired rows (and rows scoring below ``threshold``); return how many went."""

    def export(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, rows) of every row the table holds (all shards), for serving."""

    def rows_state(self) -> dict[str, Any]:
        """Every row with its per-row fields (``ids``, ``rows``, ``steps``, ``state.*``, ``stats.*``), for state_dict."""

    def load_rows_state(self, state: dict[str, Any], replace: bool) -> None:
        """Put rows back (``ids`` and ``rows``, optional per-row fields); ``replace``: drop every other row."""


@runtime_checkable
class BatchedRows(Protocol):
    """A backend that pulls together with the backends of the same ``batch_key()`` (one client's tables on the
    parameter servers): one request per server for all their tables (:func:`pull_many`, :func:`prefetch_many`)."""

    def batch_key(self) -> object:
        """Backends with the same key (compared by identity) pull together."""

    @staticmethod
    def pull_together(backends: list[Any], ids: list[torch.Tensor]) -> list[torch.Tensor]:
        """Rows of each backend's unique ``ids``, in one request per server for all their tables."""

    @staticmethod
    def prefetch_together(backends: list[Any], ids: list[torch.Tensor]) -> Future | None:
        """A future of every backend's rows, pulled in the background; None where rows must be fresh (sync)."""


@runtime_checkable
class PrefetchedRows(Protocol):
    """A backend that can start pulling a coming batch's rows in the background (``SparseEmbedding.prefetch``)."""

    def prefetch(self, ids: torch.Tensor) -> Future | None:
        """A future of the rows of unique ``ids``, or None where the forward must pull them itself."""

    def collect(self, future: Future) -> torch.Tensor | None:
        """A prefetch's rows, or None when it failed (the forward then pulls again)."""


_IMPLEMENTS: dict[tuple[type, type], bool] = {}


def implements(backend: Any, protocol: type) -> bool:
    """``isinstance(backend, protocol)`` for a runtime-checkable protocol here, answered once per backend class.

    Why: a runtime check against a ``Protocol`` looks up each of its members, every time (about 2 % of a
    one-process W6 step, asked for every table on every pull); the members are methods of the class.
    """
    key = (type(backend), protocol)
    known = _IMPLEMENTS.get(key)
    if known is None:
        known = _IMPLEMENTS[key] = isinstance(backend, protocol)
    return known


def batched(backend: Any) -> bool:
    """Whether ``backend`` pulls together with others (:class:`BatchedRows`)."""
    return implements(backend, BatchedRows)


def per_row_fields(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A rows state's per-row fields (``rows``, ``steps``, ``state.*``, ``stats.*``): what a table's rows are set to."""
    return {k: v for k, v in state.items() if k in ("rows", "steps") or k.startswith(("state.", "stats."))}


def register(placeholder: torch.nn.Parameter, module: TableModule) -> None:
    _BY_PLACEHOLDER[id(placeholder)] = module
    _ORDER[id(placeholder)] = len(_ORDER)


def module_of(placeholder: torch.Tensor) -> TableModule | None:
    module = _BY_PLACEHOLDER.get(id(placeholder))
    return module if module is not None and module.placeholder is placeholder else None


def any_registered() -> bool:
    return bool(_BY_PLACEHOLDER)


def all_modules() -> list[Any]:
    """Every table module alive in this process, in creation order."""
    return [m for key, m in sorted(_BY_PLACEHOLDER.items(), key=lambda kv: _ORDER[kv[0]])]


def shrink_all(threshold: float | None) -> None:
    """``fleet.shrink`` where each process holds its tables (or its replica of them): every backend shrinks."""
    for module in all_modules():
        module.backend().shrink(threshold)


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


def pull_many(requests: list[tuple[TableBackend, torch.Tensor]]) -> list[torch.Tensor]:
    """Rows for each ``(backend, unique ids)``. Backends that can pull together (one client's tables on the
    parameter servers: the same ``batch_key()``) do, in one request per server; the others pull alone."""
    out: list[torch.Tensor | None] = [None] * len(requests)
    together: dict[tuple[type, int], list[int]] = {}
    for i, (backend, ids) in enumerate(requests):
        if batched(backend):
            together.setdefault((type(backend), id(backend.batch_key())), []).append(i)
        else:
            out[i] = backend.pull(ids)
    for (kind, _), members in together.items():
        rows = kind.pull_together([requests[i][0] for i in members], [requests[i][1] for i in members])
        for i, got in zip(members, rows, strict=True):
            out[i] = got
    return out  # type: ignore[return-value]


def pool_many(backends: list[Any], features: list[list[tuple]], training: bool, pooler: Any) -> list | None:
    """Each table's features' pooled bags, pooled where the tables live (tables held whole by one worker each,
    of one process group: ``pool_together``), or None where these backends do not pool (the caller pulls rows
    and pools them itself). ``features[t]``: table ``t``'s features as ``(ids, offsets [batch + 1], weights)``;
    ``pooler``: the caller's lookup and pooling, which the holders run (see ``fleet.collective.table_wise``)."""
    kind = type(backends[0])
    if not hasattr(kind, "pool_together") or any(type(b) is not kind for b in backends):
        return None
    if not kind.pools(backends, features):
        return None
    return kind.pool_together(backends, features, training, pooler)


def can_prefetch(backends: list[Any]) -> bool:
    """Whether :func:`prefetch_many` may start a pull for these backends: a caller skips preparing a coming
    batch's unique ids where it cannot (a local table, tables sharded across the workers), work the forward
    would do again."""
    if not backends or not all(batched(b) for b in backends):  # a local table: nothing to pull ahead
        return False
    keys = {(type(b), id(b.batch_key())) for b in backends}
    return len(keys) == 1 and getattr(backends[0], "pulls_ahead", True)


def prefetch_many(requests: list[tuple[TableBackend, torch.Tensor]]) -> Any | None:
    """Start pulling each ``(backend, unique ids)`` in the background, where rows may be a step old anyway
    (parameter server, ``update="async"``): a future of the rows for :func:`collect_many`, or None where
    these backends cannot prefetch together (then the forward pulls)."""
    keys = {(type(b), id(b.batch_key())) if batched(b) else None for b, _ in requests}
    if len(keys) != 1 or None in keys:
        return None
    kind = type(requests[0][0])
    return kind.prefetch_together([b for b, _ in requests], [ids for _, ids in requests])


def collect_many(future: Any) -> list[torch.Tensor] | None:
    """A :func:`prefetch_many`'s rows, or None when it failed (the forward then pulls again, guarded)."""
    try:
        return future.result()
    except Exception:  # noqa: BLE001 - e.g. a server restarted meanwhile: pulled again through the guard
        return None


def step_tables(optimizer: torch.optim.Optimizer, args: Any = (), kwargs: Any = None) -> None:
    """Global step hook: an optimizer holding a table module's placeholder steps the module's backend; backends
    that step together (tables sharded across the workers, of one process group: ``batch_key``) step at once."""
    if not _BY_PLACEHOLDER:  # every optimizer step of the process passes here
        return
    together: dict[tuple[type, int], list[tuple[Any, dict[str, Any]]]] = {}
    for module, group in modules_in(optimizer):
        backend = module.backend()
        if hasattr(backend, "step_together"):  # tables sharded across the workers: one exchange for all
            together.setdefault((type(backend), id(backend.batch_key())), []).append((backend, group))
        else:
            backend.step(type(optimizer), group)
    for (kind, _), members in together.items():
        kind.step_together(members, type(optimizer))


register_optimizer_step_post_hook(step_tables)


class LocalRows:
    """A table in this process (every module has one; it is the backend without a strategy)."""

    def __init__(self, module: TableModule):
        self._module = weakref.ref(module)
        self.table: SparseTable | None = None
        # "given": rows given before the first step (optimizer not known yet); "saved": a loaded save
        self._provisional: str | None = None
        self.steps = 0  # steps of this table, skipped ones too (named in the non-finite warning)

    def adopt(self, table: SparseTable) -> None:
        """Serve from ``table`` from now on (``fleet.load_for_inference``: the rows of an exported model)."""
        self.table = table

    def pull(self, ids: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            return self.table.pull(ids)
        module = self._module()
        if module.lifecycle.entry is not None:  # nothing admitted yet
            return torch.zeros(ids.numel(), module.embedding_dim)
        return initial_rows(ids, module.embedding_dim, module.initializer, module.seed)

    def step(
        self,
        optimizer_class: type,
        group: dict[str, Any],
        exchange: Exchange | None = None,
        where: str = "in collective mode",
    ) -> None:
        """Apply the pending row gradients (merged over the workers first with an ``exchange``, named ``where``)."""
        module = self._module()
        ids, grads, clicks = module.take_gradients()
        lr = float(group["lr"])
        if exchange is not None:
            if module.lifecycle.active:  # clicks ride along as one more column, summed, not averaged
                column = clicks if clicks is not None else torch.zeros(ids.numel())
                grads = torch.cat([grads, column.unsqueeze(1)], 1)
            ids, grads = exchange(module, ids, grads, lr)
            clicks = None
        self.apply(optimizer_class, group, ids, grads, lr, clicks, where if exchange is not None else "in one process")

    def apply(
        self,
        optimizer_class: type,
        group: dict[str, Any],
        ids: torch.Tensor,
        grads: torch.Tensor,
        lr: float,
        clicks: torch.Tensor | None = None,
        where: str = "in one process",
        checked: bool = False,
    ) -> None:
        """One step of the table; ``grads`` may carry the clicks as a last column (exchanged rows).

        ``where`` (the mode, for errors): "in one process", "in collective mode", ...; ``checked``: the caller
        found ``grads``, ``clicks`` and ``lr`` finite already (a sharded table's owner: each sender checked its
        own gradients, and a flag of any sender's NaN or Inf skipped the step before this call).

        A step whose gradients (or lr) hold NaN or Inf is skipped whole, or raises under
        ``nonfinite="error"`` (:mod:`fleet.sparse.nonfinite`). In collective mode ``grads`` are the
        exchanged sum, so every worker's replica skips the same steps.
        """
        module = self._module()
        self.steps += 1
        if not checked and not nonfinite.finite(grads, clicks, lr):
            nonfinite.refuse(f"sparse table of {type(module).__name__}(dim {module.embedding_dim})", self.steps, where)
            return
        if self.table is None or self._provisional:
            spec = module.optimizer_override or OptimizerSpec.from_torch(
                optimizer_class, group, rows=True, where=f"for a fleet.nn.{type(module).__name__} {where}"
            )
            if self.table is None or self.table.optimizer != spec:
                self.table = self._new_table(spec, self.table)
            self._provisional = None
        if grads.shape[1] == module.embedding_dim + 1:
            grads, clicks = grads[:, :-1], grads[:, -1]
        self.table.apply_gradient(ids, grads, lr, clicks)

    def _new_table(self, spec: OptimizerSpec, rows: SparseTable | None = None) -> SparseTable:
        """A table for ``spec``, holding ``rows``' rows (their optimizer state too when it is a loaded save)."""
        module = self._module()
        table = SparseTable(module.embedding_dim, spec, module.initializer, module.seed, module.lifecycle)
        if rows is not None:
            state = rows.state_dict()
            if self._provisional == "saved":  # the optimizer must be the saved one's kind (else a clear error)
                table.load_state_dict(state)
            else:  # given rows: values (and statistics) only; the optimizer state starts fresh
                keep = {k: v for k, v in state.items() if k == "rows" or k.startswith("stats.")}
                table.write_rows(state["ids"], keep)
        return table

    def rows_state(self) -> dict[str, Any]:
        if self.table is None:
            return {"ids": torch.empty(0, dtype=torch.int64), "rows": torch.empty(0, self._module().embedding_dim)}
        self.table.sort_by_id()  # a table loaded from the state dict then holds its rows in the same slots
        return self.table.state_dict()

    def load_rows_state(self, state: dict[str, Any], replace: bool) -> None:
        module = self._module()
        if replace and "optimizer" in state:  # a whole table's save: exact, table-wide header included
            spec = OptimizerSpec.from_config(json.loads(state["optimizer"]))
            self.table = SparseTable(module.embedding_dim, spec, module.initializer, module.seed, module.lifecycle)
            self.table.load_state_dict(state)
            self._provisional = "saved"
            return
        if replace and not state["ids"].numel():
            self.table, self._provisional = None, None
            return
        if self.table is None:  # rows before the first step: kept under a stand-in optimizer until it
            spec = module.optimizer_override or OptimizerSpec(kind="sgd", lr=0.0)
            self.table = SparseTable(module.embedding_dim, spec, module.initializer, module.seed, module.lifecycle)
            self._provisional = "given"
        fields = per_row_fields(state)
        if not set(fields) <= set(self.table.copy_rows(slice(0, 0))):
            fields = {k: v for k, v in fields.items() if k == "rows" or k.startswith("stats.")}
        self.table.write_rows(state["ids"], fields, replace)

    def pending_rows(self) -> dict[str, Any] | None:
        """Rows this table took before its first step, for a backend that takes over (the servers), else None:
        given rows (``load_rows``, ``from_pretrained``: ids and rows) or a loaded state dict (every per-row field)."""
        if self.table is None or self._provisional is None:
            return None
        state = self.table.state_dict()
        if self._provisional == "given":
            return {"ids": state["ids"], "rows": state["rows"]}
        return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and k != "deleted"}

    def num_rows(self) -> int:
        return len(self.table) if self.table is not None else 0

    def shrink(self, threshold: float | None) -> int:
        return self.table.shrink(threshold) if self.table is not None else 0

    def export(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.table is None:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, self._module().embedding_dim)
        return self.table.export()


class ExchangedRows:
    """Collective mode: the module's local table, each step's row gradients merged over the workers first."""

    def __init__(self, local: LocalRows, exchange: Exchange, where: str = "in collective mode"):
        self.local = local
        self.exchange = exchange
        self.where = where

    def pull(self, ids: torch.Tensor) -> torch.Tensor:
        return self.local.pull(ids)

    def step(self, optimizer_class: type, group: dict[str, Any]) -> None:
        self.local.step(optimizer_class, group, self.exchange, self.where)

    def num_rows(self) -> int:
        return self.local.num_rows()

    def shrink(self, threshold: float | None) -> int:
        return self.local.shrink(threshold)

    def export(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.local.export()

    def rows_state(self) -> dict[str, Any]:
        return self.local.rows_state()

    def load_rows_state(self, state: dict[str, Any], replace: bool) -> None:
        self.local.load_rows_state(state, replace)
