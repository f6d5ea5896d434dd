"""SparseEmbedding: embedding rows keyed by arbitrary int64 ids, with no vocabulary size.

One module serves every mode. Each forward looks up the batch's unique ids, as a
leaf tensor that collects the per-row gradients, and expands them to the batch
through the inverse index. Where the rows live is the active strategy's choice
(:mod:`fleet.sparse.backends`): a local table in a single process, the same table with
each step's row gradients merged over the workers in collective mode, rows on the
servers in parameter-server mode. Whatever the backend, its ``step`` is the one place
that applies the row gradients, run when the optimizer holding this module's placeholder
steps (a torch optimizer step hook, so even an unwrapped ``torch.optim.SGD`` trains it);
rows on the servers are applied there, from the pushes of the wrapped optimizer.

The module owns a zero-size placeholder ``nn.Parameter`` so that it appears in
``model.parameters()``: the optimizer holding the placeholder is the one that
updates the rows, with its class and hyper-parameters unless ``optimizer`` overrides them.
The rows always step with that optimizer's current learning rate (so LR schedulers apply to
them): an override's ``lr`` is not used; give the module its own param group for another rate.

The rows are in ``state_dict()`` as the module's extra state (:mod:`fleet.nn.rows_state`: ids,
rows, per-row optimizer state and statistics; read from the servers in bounded pages in a
parameter-server job), unless ``state_dict_rows=False``; :meth:`SparseEmbedding.from_pretrained`
and :meth:`SparseEmbedding.load_rows` give rows, :meth:`SparseEmbedding.dense_weight` copies an
id range out as an ``nn.Embedding``-style weight.

A long-running CTR job bounds its table with a life cycle (:mod:`fleet.sparse.lifecycle`):
``entry`` (``fleet.CountFilterEntry(n)`` / ``fleet.ProbabilityEntry(p)``) admits new ids,
``ttl_steps`` and ``max_rows`` evict rows, ``fleet.shrink()`` evicts on demand. The
servers (or the local table) enforce it; :meth:`SparseEmbedding.num_rows` says how many
rows the table holds now, and :meth:`SparseEmbedding.record_clicks` feeds the click counts
that, with the show counts, rank rows for eviction.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from fleet.nn import rows_state, torch_signature
from fleet.nn.bag_kernels import unique_inverse
from fleet.runtime import context
from fleet.sparse import backends as tables
from fleet.sparse import native
from fleet.sparse.lifecycle import Entry, LifeCycle
from fleet.sparse.optim import InitializerSpec, OptimizerSpec, initial_rows


def _initializer(value: Any, owner: str = "SparseEmbedding") -> InitializerSpec:
    if value is None:
        return InitializerSpec()
    if isinstance(value, InitializerSpec):
        return value
    if isinstance(value, dict):
        return InitializerSpec.from_config(value)
    if isinstance(value, str):
        return InitializerSpec(kind=value)  # type: ignore[arg-type]
    raise TypeError(
        f"{owner}: initializer must be an InitializerSpec, a dict or a kind name, got {type(value).__name__}"
    )


def _optimizer(value: Any, owner: str = "SparseEmbedding") -> OptimizerSpec | None:
    """None (follow the dense optimizer), an OptimizerSpec, a dict, or (torch optimizer class, kwargs)."""
    if value is None or isinstance(value, OptimizerSpec):
        return value
    if isinstance(value, dict):
        return OptimizerSpec.from_config(value)
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], type):
        probe = value[0]([torch.zeros(1, requires_grad=True)], **value[1])
        return OptimizerSpec.from_torch(value[0], probe.param_groups[0], rows=True, where=f"as a {owner}'s optimizer")
    raise TypeError("optimizer must be None, an OptimizerSpec, a dict, or (torch.optim class, kwargs)")


class SparseEmbedding(nn.Module):
    """``SparseEmbedding(16)(ids)`` -> ``[*ids.shape, 16]``; rows are created on first touch.

    ``SparseEmbedding(num_embeddings, embedding_dim, ...)`` takes ``nn.Embedding``'s signature: the
    same table, with ``num_embeddings`` as an id bound (ids outside ``[0, num_embeddings)`` raise
    ``IndexError``) and torch's arguments as :mod:`fleet.nn.torch_signature` says. Every other
    argument is fleet's, by keyword (``initializer`` may also come second: ``SparseEmbedding(16, "zeros")``).

    ``state_dict_rows=False`` leaves the rows out of ``state_dict()`` (a marker that refuses to
    load) for a table too big to copy; ``fleet.save_checkpoint`` / ``save_persistables`` keep them.
    """

    def __init__(
        self,
        *sizes: Any,
        initializer: InitializerSpec | dict | str | None = None,
        optimizer: Any = None,
        seed: int | None = None,
        entry: Entry | None = None,
        max_rows: int | None = None,
        ttl_steps: int | None = None,
        decay: float = 0.999,
        state_dict_rows: bool = True,
        num_embeddings: int | None = None,
        embedding_dim: int | None = None,
        **unknown: Any,
    ):
        super().__init__()
        owner = type(self).__name__
        native.require(f"fleet.nn.{owner}")  # here, not at the first step: a job without the engine stops at once
        given = torch_signature.sizes(owner, sizes, num_embeddings, embedding_dim, "initializer")
        if given.second is not None:
            if initializer is not None:
                raise TypeError(f"{owner} got the initializer twice (second argument and initializer=)")
            initializer = given.second
        torch_args = torch_signature.torch_arguments(owner, given.num_embeddings, given.embedding_dim, unknown)
        self.embedding_dim = given.embedding_dim
        self.num_embeddings = given.num_embeddings
        """The id bound of torch's signature (ids in ``[0, num_embeddings)``), or None: any int64 id."""
        self.initializer = _initializer(initializer, owner)
        self.optimizer_override = _optimizer(optimizer, owner)
        self.seed = 0 if seed is None else int(seed)
        self.lifecycle = LifeCycle.from_config(
            {"entry": entry.to_config() if entry is not None else None, "max_rows": max_rows,
             "ttl_steps": ttl_steps, "decay": decay}
        )  # fmt: skip
        self.state_dict_rows = bool(state_dict_rows)
        """Whether ``state_dict()`` holds the rows (False: a marker that refuses to load; see rows_state)."""
        self.placeholder = nn.Parameter(torch.empty(0))
        tables.register(self.placeholder, self)
        self.local = tables.LocalRows(self)
        """The table in this process: the backend unless the strategy provides another."""
        # (unique ids, their rows as a leaf collecting the gradient, inverse index, clicks) per forward
        self._pending: list[list[Any]] = []
        self._prefetched: tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any] | None = None
        if torch_args.weight is not None:  # nn.Embedding's _weight: the rows of ids 0 .. num_embeddings-1
            self.load_rows(torch.arange(given.num_embeddings), torch_args.weight)

    def extra_repr(self) -> str:
        life = "".join(f", {k}={v}" for k, v in self.lifecycle.to_config().items())
        bound = f"{self.num_embeddings}, " if self.num_embeddings is not None else ""  # torch's (n, dim)
        return f"{bound}{self.embedding_dim}, initializer={self.initializer.kind}, seed={self.seed}{life}"

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name != "weight":
                raise
        n = self.__dict__.get("num_embeddings")
        copy = ".dense_weight()" if n is not None else ".dense_weight(n)"
        upto = f"0..{n - 1}" if n is not None else "0..n-1"
        raise AttributeError(
            f"{type(self).__name__} has no .weight: its rows are keyed by id, created on first touch, and live in a "
            f"table (on the servers in a parameter-server job). {copy} copies the rows of ids {upto} out as an "
            "nn.Embedding-style weight (a copy: writing to it changes no row); load_rows(ids, values), or _weight= "
            "in torch's signature, sets rows"
        ) from None

    def table_config(self, spec: OptimizerSpec) -> dict[str, Any]:
        return {
            "dim": self.embedding_dim,
            "optimizer": (self.optimizer_override or spec).to_config(),
            "initializer": self.initializer.to_config(),
            "seed": self.seed,
            **self.lifecycle.to_config(),
        }

    def num_rows(self) -> int:
        """The rows the table holds now (over all servers in a parameter-server job)."""
        return self.backend().num_rows()

    def backend(self) -> tables.TableBackend:
        """Where the rows live now: the active strategy's choice, else this process's table."""
        strategy = context.strategy()
        chosen = strategy.table_backend(self) if strategy is not None else None
        return chosen if chosen is not None else self.local

    # ------------------------------------------------------------------ rows in and out
    @classmethod
    def from_pretrained(
        cls, embeddings: torch.Tensor, ids: torch.Tensor | None = None, **kwargs: Any
    ) -> SparseEmbedding:
        """A table starting from given rows: ``embeddings[i]`` is the row of ``ids[i]`` (default: id ``i``).

        ``kwargs`` go to the constructor (``optimizer``, ``seed``, ...); see :meth:`load_rows`.
        """
        if not isinstance(embeddings, torch.Tensor) or embeddings.dim() != 2:
            raise ValueError(f"{cls.__name__}.from_pretrained takes a 2-D tensor of rows [num_rows, embedding_dim]")
        module = cls(embedding_dim=int(embeddings.shape[1]), **kwargs)
        module.load_rows(torch.arange(embeddings.shape[0]) if ids is None else ids, embeddings)
        return module

    def load_rows(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        """Set the rows of ``ids`` (unique) to ``values`` ``[len(ids), embedding_dim]``, in any mode.

        The rows are created if missing (whatever an ``entry`` would admit) and their optimizer
        state starts fresh; other rows stay. In a parameter-server job they go to the servers in
        requests under the request limits; called before ``fleet.distributed_optimizer``, worker 0
        sends them when the table is created there. Every worker calls it with the same rows.
        """
        ids = self._check_ids(torch.as_tensor(ids)).reshape(-1)
        if torch.unique(ids).numel() != ids.numel():
            raise ValueError(f"{type(self).__name__}.load_rows: ids must be unique")
        if not isinstance(values, torch.Tensor) or not values.dtype.is_floating_point:
            raise ValueError(f"{type(self).__name__}.load_rows: values must be a floating-point tensor")
        if tuple(values.shape) != (ids.numel(), self.embedding_dim):
            raise ValueError(
                f"{type(self).__name__}.load_rows: values have shape {tuple(values.shape)}, expected "
                f"({ids.numel()}, {self.embedding_dim})"
            )
        rows = values.detach().to(torch.float32)
        self.backend().load_rows_state({"ids": ids, "rows": rows}, replace=False)

    def dense_weight(self, num_ids: int | None = None) -> torch.Tensor:
        """A copy of the rows of ids ``0 .. num_ids-1`` as a ``[num_ids, embedding_dim]`` tensor (``.weight``).

        ``num_ids`` defaults to ``num_embeddings`` where the module has that bound (torch's signature).

        Row ``i`` is id ``i``'s row: the table's value where it holds one, else what a lookup
        returns (the initial value, or zeros while an ``entry`` has not admitted the id). For
        ``nn.Embedding``-style inference tools; ids outside the range are not in it.
        """
        if num_ids is None and self.num_embeddings is not None:
            num_ids = self.num_embeddings
        if isinstance(num_ids, bool) or not isinstance(num_ids, int) or num_ids < 0:
            raise ValueError(f"dense_weight(num_ids) takes an int >= 0, got {num_ids!r}")
        state = self.backend().rows_state()
        ids = torch.arange(num_ids)
        if self.lifecycle.entry is not None:
            out = torch.zeros(num_ids, self.embedding_dim)
        else:
            out = initial_rows(ids, self.embedding_dim, self.initializer, self.seed)
        held = (state["ids"] >= 0) & (state["ids"] < num_ids)
        out[state["ids"][held]] = state["rows"][held]
        return out

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for key, value in rows_state.capture(self).items():  # the rows (fleet.nn.rows_state)
            destination[prefix + key] = value

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        ours = prefix + rows_state.PREFIX
        for key in [k for k in unexpected_keys if k.startswith(ours)]:
            unexpected_keys.remove(key)
        if ours + "meta" in state_dict:
            rows_state.restore(self, rows_state.table_rows(state_dict, prefix[:-1]), prefix[:-1])
        elif prefix + "placeholder" in state_dict and rows_state.expected():
            warnings.warn(
                f"{type(self).__name__} {prefix[:-1]!r}: the state dict has no rows (saved before fleet kept a table's "
                "rows in state_dict); the table keeps the rows it has",
                stacklevel=2,
            )

    # ------------------------------------------------------------------ lookup
    def prefetch(self, ids: torch.Tensor) -> None:
        """Start fetching the rows of a coming batch's ``ids`` now, so its forward need not wait for them.

        Where the rows are remote and may be a step old (parameter server, ``update="async"``)
        the pull runs in the background while this step computes; elsewhere it does nothing
        (a sync step's rows must include the step before it). Call it with the next batch's
        ids before this step's ``optimizer.step()``; the forward that gets the same ids uses it.
        """
        ids = self._check_ids(ids)
        unique, inverse = unique_inverse(ids.reshape(-1))
        backend = self.backend()
        future = backend.prefetch(unique) if tables.implements(backend, tables.PrefetchedRows) else None
        # a copy: the caller may refill its ids tensor in place before the forward, which must then pull again
        self._prefetched = (ids.clone(), unique, inverse, future) if future is not None else None

    def _check_ids(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            raise TypeError(f"{type(self).__name__} takes integer ids, got {ids.dtype}")
        ids = ids.to(torch.int64)
        torch_signature.check_bound(type(self).__name__, ids, self.num_embeddings)
        return ids

    def _lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(unique ids, their rows, inverse index): from a prefetch of these ids, or pulled now."""
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None:
            seen, unique, inverse, future = prefetched
            if seen.shape == ids.shape and torch.equal(seen, ids):
                rows = self.backend().collect(future)
                if rows is not None:
                    return unique, rows, inverse
        unique, inverse = unique_inverse(ids.reshape(-1))
        return unique, self.backend().pull(unique), inverse

    def _gather(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows of ``ids``' unique ids, inverse index shaped as ``ids``); when training, the rows are a
        leaf whose gradient (one per unique id) the next optimizer step takes to the table."""
        unique, rows, inverse = self._lookup(ids)
        inverse = inverse.view(ids.shape)
        return self.track(unique, rows, inverse), inverse

    def track(self, unique: torch.Tensor, rows: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        """``rows`` of the ``unique`` ids a forward looked up (``inverse``: each entry's row), as the leaf whose
        gradient the next optimizer step takes to the table, when training; else ``rows``. For modules that
        pull several tables' rows at once (``fleet.nn.SparseFeatureCollection``)."""
        if torch.is_grad_enabled() and self.training:
            rows = rows.detach().requires_grad_(True)
            self._pending.append([unique, rows, inverse, None])
        return rows

    def forward(self, ids: torch.Tensor, *unexpected: Any) -> torch.Tensor:
        if unexpected:  # (ids, offsets), as nn.EmbeddingBag
            raise TypeError(
                f"{type(self).__name__} takes the ids only, got {1 + len(unexpected)} arguments; "
                "for bags of ids (ids, offsets, per_sample_weights) use fleet.nn.SparseEmbeddingBag"
            )
        ids = self._check_ids(ids)
        rows, inverse = self._gather(ids)
        return rows.index_select(0, inverse.reshape(-1)).reshape(*ids.shape, self.embedding_dim)

    def record_clicks(self, labels: torch.Tensor) -> None:
        """Feed the clicks of the last forward's samples (``labels``: one per sample, the ids' first dim).

        Each id of a sample gets that sample's label as clicks; they travel with the row gradients
        and raise the rows' scores (Paddle's show/click statistics).
        """
        if not self._pending:
            raise RuntimeError(f"record_clicks follows a training forward of this {type(self).__name__}")
        inverse = self._pending[-1][2]
        labels = torch.as_tensor(labels).detach().to(torch.float32).reshape(-1)
        if inverse.dim() == 0 or labels.numel() != inverse.shape[0]:
            raise ValueError(
                f"record_clicks got {labels.numel()} labels for ids of shape {list(inverse.shape)}: one per sample"
            )
        self.add_clicks(labels.view(-1, *([1] * (inverse.dim() - 1))).expand(inverse.shape).reshape(-1))

    def add_clicks(self, per_entry: torch.Tensor) -> None:
        """The last forward's clicks: ``per_entry`` (one per entry of its inverse index) summed per unique id."""
        unique, _, inverse, _ = self._pending[-1]
        self._pending[-1][3] = torch.zeros(unique.numel()).index_add_(0, inverse.reshape(-1), per_entry)

    def take_gradients(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(ids, row gradients, clicks or None) of every forward since the last call; ids may repeat."""
        pending, self._pending = self._pending, []
        if not pending:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, self.embedding_dim), None
        if len(pending) == 1:  # one forward a step (the usual case): no copies
            unique, rows, _, clicks = pending[0]
            return unique, (rows.grad if rows.grad is not None else torch.zeros_like(rows)).detach(), clicks
        ids = torch.cat([u for u, *_ in pending])
        grads = torch.cat([r.grad if r.grad is not None else torch.zeros_like(r) for _, r, *_ in pending])
        clicks = None
        if any(c is not None for *_, c in pending):
            clicks = torch.cat([c if c is not None else torch.zeros(u.numel()) for u, _, _, c in pending])
        return ids, grads.detach(), clicks
