"""Tables sharded table-wise: each table held whole by one worker, a collection's bags pooled where they live.

``DistributedStrategy(table_placement="table_wise")`` (collective and sharding mode) gives every
sparse table one holder, chosen by :func:`holders` so that the workers' shares of the tables' widths
are about even (TorchRec's table-wise sharding). A holder keeps its tables whole: ``max_rows``,
eviction and admission are one process's, not split over shares.

How a ``fleet.nn.SparseFeatureCollection`` trains on such tables (TorchRec's table-wise pooled
layout, :meth:`TableWiseRows.pool_together`):

- **forward**: each worker sends each holder its bags of the holder's tables (the ids and bag
  lengths as they are, duplicates included: one all-to-all); the holder joins every worker's
  bags, in worker order (the union batch one process trains on), looks their rows up and pools
  them exactly as one process does, and sends each worker the pooled vectors of its own bags
  (``[batch, dim]`` per feature: a second all-to-all). Rows never travel, and the requester does
  no unique, no pooling and no routing by id.
- **step**: each worker sends the gradients of its pooled vectors to the holders (one
  all-to-all); the holder runs the pooling's backward over the union batch (the one process's
  backward, given the same output gradients) and applies its row optimizer to the mean over the
  workers, as :class:`~fleet.collective.sharded_rows.ShardedRows` does with row gradients.

Each worker's loss is its own batch's mean, so its pooled gradients are ``N`` times those of one
process on the union (exactly, for ``N`` a power of two); the holder divides the rows' gradients by
``N`` (in the bag-gradient kernel's pass, where the bags are plain sums). So the rows follow one process on the union of the batches, and the test checks them to
1e-6 (every row optimizer, 2 and 3 workers).

The pooled path covers collections whose tables are all table-wise in one group, on CPU tensors;
per-id weights travel with the ids, and a table with a life cycle (admission, TTL, ``max_rows``)
counts its clicks on the holder, from the labels ``record_clicks`` gives each worker's forward,
which travel with the pooled gradients. Every other lookup of a table-wise table, and a table
module called on its own, takes the row path of :class:`~fleet.collective.sharded_rows.ShardedRows`
(ids to the holder, rows back, row gradients at the step), which is exact as well.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fleet.collective.sharded_rows import ShardedRows
from fleet.errors import FleetError
from fleet.sparse import nonfinite
from fleet.sparse.backends import all_modules
from fleet.sparse.native import kernels

Pooler = Callable[
    [
        Any,
        list[torch.Tensor],
        list[torch.Tensor],
        list[torch.Tensor | None],
        Callable[[torch.Tensor], torch.Tensor],
        bool,
    ],
    tuple[
        torch.Tensor,
        list[torch.Tensor],
        Callable[[torch.Tensor], torch.Tensor],
        Callable[[list[torch.Tensor], int], torch.Tensor] | None,
    ],
]
"""``pooler(module, ids per feature, bag lengths per feature, per-id weights per feature or None, pull, training)``
-> (the unique ids, each feature's pooled bags, ``clicks(labels)``: each unique id's clicks from one label per bag,
``gradient(upstream, divisor)``: the unique rows' gradient given each feature's pooled gradient, divided by
``divisor``, None when not training):
the table module's own lookup, pooling, click count and backward (``fleet.nn.SparseFeatureCollection``'s), run by
the holder on the union batch with ``pull`` reading its rows."""


def holders(widths: list[int], workers: int) -> list[int]:
    """Each table's holder: the widest tables first, each to the worker with the least width so far (ties: the
    lowest rank; equal widths: the first table first). The same on every worker: it depends on the widths only."""
    load = [0] * workers
    out = [0] * len(widths)
    for t in sorted(range(len(widths)), key=lambda t: (-widths[t], t)):
        j = min(range(workers), key=lambda w: (load[w], w))
        out[t] = j
        load[j] += widths[t]
    return out


def holder_of(module: Any, workers: int) -> int:
    """``module``'s holder among ``workers``: :func:`holders` over every table module of this process, in creation
    order (every worker builds the same modules, so every worker finds the same holder)."""
    modules = all_modules()
    return holders([int(m.embedding_dim) for m in modules], workers)[modules.index(module)]


def sharded_backend(placement: str, module: Any, group: Any, *args: Any, **kwargs: Any) -> ShardedRows:
    """The backend of a table sharded across the workers of ``group``: row-wise (``table_placement="sharded"``
    or "auto") or whole on one holder (``"table_wise"``); the arguments are :class:`ShardedRows`'."""
    if placement == "table_wise":
        return TableWiseRows(module, holder_of(module, dist.get_world_size(group)), group, *args, **kwargs)
    return ShardedRows(module, group, *args, **kwargs)


def _lengths(offsets: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each feature's bag lengths from its offsets ``[bags + 1]``: one ``diff`` over them all where every feature
    has the same number of bags (a collection's forward: a diff per feature cost more than the values)."""
    if len({int(o.numel()) for o in offsets}) == 1:
        return list(torch.stack(offsets).diff(dim=1).unbind(0))
    return [o.diff() for o in offsets]


def _nonfinite_flags(per_table: list[list[torch.Tensor]], lrs: list[float]) -> list[int]:
    """Each table's flag (1: its gradients or its lr hold NaN or Inf), as ``nonfinite.finite(*grads, lr)`` gives it.
    Why one native call for every table's gradients: a Python check per table cost more than the values (W6: 8
    tables of 256 x 16..64 floats a step); where one is not finite (or is not a contiguous float32 array), each
    table is checked on its own."""
    try:
        first = kernels.all_finite_each([g.numpy() for grads in per_table for g in grads])
    except (TypeError, RuntimeError):  # not plain contiguous CPU float32 arrays: checked one by one
        first = None
    if first == -1:
        return [0 if math.isfinite(lr) else 1 for lr in lrs]
    return [0 if nonfinite.finite(*grads, lr) else 1 for grads, lr in zip(per_table, lrs, strict=True)]


class _Held:
    """One pooled forward of the tables this worker holds: what the step's backward needs (the unique ids, the
    number of features, each worker's number of bags, the rows' gradient from the pooled gradients, and the clicks
    of the union's labels)."""

    __slots__ = ("unique", "features", "bags", "gradient", "clicks")

    def __init__(
        self,
        unique: torch.Tensor,
        features: int,
        bags: list[int],
        gradient: Callable[[list[torch.Tensor], int], torch.Tensor],
        clicks: Callable[[torch.Tensor], torch.Tensor],
    ):
        self.unique, self.features, self.bags, self.gradient, self.clicks = unique, features, bags, gradient, clicks


class TableWiseRows(ShardedRows):
    """A table module held whole by worker ``holder`` of ``group`` (the rest as :class:`ShardedRows`)."""

    same_owners = False

    def __init__(self, module: Any, holder: int, *args: Any, **kwargs: Any):
        self.holder = holder
        self._held: list[_Held] = []  # the holder's: pooled forwards awaiting their step
        self._sent: list[list[torch.Tensor]] = []  # every worker's: its pooled vectors (leaves) of each forward
        self._labels: list[torch.Tensor | None] = []  # and the labels record_clicks gave for each (None: none)
        self.pooled = 0  # forwards whose bags were pooled by the holder (the rest took the row path)
        super().__init__(module, *args, **kwargs)

    @property
    def counts_holder(self) -> int:  # type: ignore[override]
        return self.holder  # the only share holding rows keeps the table-wide counts

    def owners(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.full_like(ids, self.holder, dtype=torch.int64)

    def _splits(self) -> int:
        return 1  # the holder keeps the whole table: its max_rows too

    def _what(self, action: str) -> str:
        module = self._module()
        name = type(module).__name__ if module is not None else "SparseEmbedding"
        return f"{action} a {name}(dim {self.shard.embedding_dim}) held by worker {self.holder} (table-wise)"

    # ------------------------------------------------------------------ the pooled path
    @staticmethod
    def pools(backends: list[TableWiseRows], features: list[list[tuple]]) -> bool:
        """Whether :meth:`pool_together` serves these tables' bags (see the module docstring): CPU tensors, and
        per-id weights that need no gradient."""
        first = backends[0]
        if first.device.type != "cpu" or any(b.group is not first.group for b in backends):
            return False
        return all(
            ids.device.type == "cpu" and (w is None or (w.device.type == "cpu" and not w.requires_grad))
            for bags in features
            for ids, _, w in bags
        )

    @classmethod
    def pool_together(
        cls, backends: list[TableWiseRows], features: list[list[tuple]], training: bool, pooler: Pooler
    ) -> list[list[torch.Tensor]]:
        """Each table's features' pooled vectors ``[batch, dim]`` for this worker's bags (``features[t]``: table
        ``t``'s features as ``(ids, offsets [batch + 1], per-id weights or None)``), pooled by their holders. ``training``: keep
        what the step needs (every worker must agree)."""
        first = backends[0]
        world, rank = first.workers, first.rank
        batch = int(features[0][0][1].numel()) - 1
        dims = [b.shard.embedding_dim for b in backends]
        width = sum(d * len(f) for d, f in zip(dims, features, strict=True))
        announce = first._announcing("pool", width, 0.0)
        what = first._what("pooling the bags of")
        # to holder j, for each of its tables: every feature's bag lengths, then every feature's ids, then (weighted
        # tables) every feature's weights, their float32 bits as int64 (exact both ways). A holder's own bags do not
        # travel: it pools them as they are (the same values), and its own pooled vectors stay here.
        pieces: list[list[torch.Tensor]] = [[] for _ in range(world)]
        weighted = [int(w is not None) for bags in features for _, _, w in bags]  # feature after feature
        counts = [int(ids.numel()) for bags in features for ids, _, _ in bags]  # each feature's ids
        lengths = _lengths([offsets for bags in features for _, offsets, _ in bags])
        first_feature = 0
        for backend, bags in zip(backends, features, strict=True):
            j, f0 = backend.holder, first_feature
            first_feature += len(bags)
            if j == rank:
                continue
            row = pieces[j]
            row.extend(lengths[f0 : f0 + len(bags)])
            row.extend(ids.reshape(-1) for ids, _, _ in bags)
            row.extend(
                w.reshape(-1).to(torch.float32).view(torch.int32).to(torch.int64) for _, _, w in bags if w is not None
            )
        sizes = [sum(int(p.numel()) for p in row) for row in pieces]
        header = torch.tensor([batch, int(training), *counts, *weighted], dtype=torch.int64).expand(world, -1)
        got, heads, _ = first.exchange_pieces(
            [p for row in pieces for p in row], sizes, header, None, torch.int64, what, announce
        )
        assert heads is not None
        n_all = len(weighted)
        if any(h[1] != heads[0][1] or h[2 + n_all :] != heads[0][2 + n_all :] for h in heads):
            cls._refuse_mixed(heads, what, n_all)
        bags_of = [h[0] for h in heads]
        # the tables held here, pooled over the union of every worker's bags (worker order)
        at = [0] * world
        reply: list[list[torch.Tensor]] = [[] for _ in range(world)]
        own: list[list[torch.Tensor]] = []  # this worker's pooled vectors of the tables it holds, table order
        first_feature = 0
        for backend, bags in zip(backends, features, strict=True):
            n_features = len(bags)
            flags = weighted[first_feature : first_feature + n_features]
            fs = range(first_feature, first_feature + n_features)
            first_feature += n_features
            if backend.holder != rank:
                continue
            per_feature_lengths: list[list[torch.Tensor]] = [[] for _ in range(n_features)]
            per_feature_ids: list[list[torch.Tensor]] = [[] for _ in range(n_features)]
            per_feature_weights: list[list[torch.Tensor]] = [[] for _ in range(n_features)]
            for i in range(world):
                if i == rank:
                    for f, (ids, _, w) in enumerate(bags):
                        per_feature_lengths[f].append(lengths[fs[f]])
                        per_feature_ids[f].append(ids.reshape(-1))
                        if w is not None:
                            per_feature_weights[f].append(w.reshape(-1).to(torch.float32))
                    continue
                block, b, head = got[i], bags_of[i], heads[i]
                received = block[at[i] : at[i] + n_features * b].view(n_features, b)
                at[i] += n_features * b
                ends = [head[2 + f] for f in fs]
                for f in range(n_features):
                    per_feature_lengths[f].append(received[f])
                    per_feature_ids[f].append(block[at[i] : at[i] + ends[f]])
                    at[i] += ends[f]
                for f in range(n_features):
                    if flags[f]:
                        per_feature_weights[f].append(
                            block[at[i] : at[i] + ends[f]].to(torch.int32).view(torch.float32)
                        )
                        at[i] += ends[f]
            weights = [torch.cat(w) if flag else None for w, flag in zip(per_feature_weights, flags, strict=True)]
            pooled = backend.pool_here([torch.cat(x) for x in per_feature_ids],
                                       [torch.cat(x) for x in per_feature_lengths], weights, bags_of, training,
                                       pooler)  # fmt: skip
            pooled = [p.detach() for p in pooled] if any(p.requires_grad for p in pooled) else pooled
            start = 0
            for i in range(world):
                (own if i == rank else reply[i]).append([p[start : start + bags_of[i]] for p in pooled])
                start += bags_of[i]
        send = [p for row in reply for table in row for p in table]
        sizes = [sum(int(p.numel()) for table in row for p in table) for row in reply]
        recv = [0] * world
        for t, backend in enumerate(backends):
            if backend.holder != rank:
                recv[backend.holder] += batch * dims[t] * len(features[t])
        back, _, _ = first.exchange_pieces(send, sizes, None, recv, torch.float32, what)
        # a copy of each holder's block: the received block is a view of shared memory, valid until the next
        # exchange; the vectors are views of it (the pooled vectors of this worker's own tables: of the pooling)
        blocks = [back[j].clone() if recv[j] and j != rank else None for j in range(world)]
        out: list[list[torch.Tensor]] = []
        at = [0] * world
        mine = iter(own)
        for t, backend in enumerate(backends):
            j, dim = backend.holder, dims[t]
            if j == rank:
                vectors = next(mine)
            else:
                vectors = []
                block = blocks[j]
                assert block is not None
                for _ in features[t]:
                    vectors.append(block[at[j] : at[j] + batch * dim].view(batch, dim))
                    at[j] += batch * dim
            if training:
                for vector in vectors:
                    vector.requires_grad_(True)
            backend.received(vectors, training)
            out.append(vectors)
        return out

    @staticmethod
    def _refuse_mixed(heads: list[list[int]], what: str, n_all: int) -> None:
        """The workers called the collection differently (:meth:`pool_together`'s headers: training, each feature's
        ids and whether it has weights): the error naming what differs (different numbers of ids pass)."""
        if len({h[1] for h in heads}) > 1:
            training_on = [i for i, h in enumerate(heads) if h[1]]
            raise FleetError(
                f"{what}: workers {training_on} look up to train (grad enabled, module.train()) and the others to "
                "evaluate; every worker must call the collection in the same way"
            )
        for f in range(n_all):
            if len({h[2 + n_all + f] for h in heads}) > 1:
                with_weights = [i for i, h in enumerate(heads) if h[2 + n_all + f]]
                raise FleetError(
                    f"{what}: workers {with_weights} pass per-id weights for feature {f} of the collection and the "
                    "others do not; every worker must give the same kind of input"
                )

    def pool_here(
        self,
        ids: list[torch.Tensor],
        lengths: list[torch.Tensor],
        weights: list[torch.Tensor | None],
        bags_of: list[int],
        training: bool,
        pooler: Pooler,
    ) -> list[torch.Tensor]:
        """The union batch's bags of each feature pooled as one process pools them (``pooler``: the collection's
        plan and pooling, given the same ids in the same order)."""
        unique, pooled, clicks, gradient = pooler(self._module(), ids, lengths, weights, self.local.pull, training)
        if training:
            assert gradient is not None
            self._held.append(_Held(unique, len(pooled), bags_of, gradient, clicks))
        return pooled

    def received(self, vectors: list[torch.Tensor], training: bool) -> None:
        """This worker's pooled vectors of one forward came back (kept for the step when ``training``)."""
        self.pooled += 1
        if training:
            self._sent.append(vectors)
            self._labels.append(None)

    def add_labels(self, labels: torch.Tensor) -> None:
        """The clicks of the last training forward: one label per sample (``record_clicks``), counted by the holder
        for every id of the sample's bags (a table with a life cycle: they travel with the pooled gradients)."""
        if not self._sent:
            raise RuntimeError("record_clicks follows a training forward of the collection, before its step")
        bags = self._sent[-1][0].shape[0]
        if labels.numel() != bags:
            raise ValueError(f"record_clicks got {labels.numel()} labels for {bags} samples: one per sample")
        self._labels[-1] = labels.detach().to(torch.float32).reshape(-1)

    def take_sent(self) -> list[tuple[list[torch.Tensor], torch.Tensor | None]]:
        """The pooled vectors of every training forward since the last step, each with its labels or None: their
        gradients (and the labels) go to the holder."""
        sent = list(zip(self._sent, self._labels, strict=True))
        self._sent, self._labels = [], []
        return sent

    def take_held(self) -> list[_Held]:
        """The holder's pooled forwards since the last step (their backward runs at the step)."""
        held, self._held = self._held, []
        return held

    @property
    def awaits_pooled_step(self) -> bool:
        """Whether pooled forwards wait for their step (else the table steps by its rows)."""
        return bool(self._sent)

    @classmethod
    def step_together(cls, items: list[tuple[ShardedRows, dict[str, Any]]], optimizer_class: type) -> None:
        """Tables whose lookups were pooled here step by their pooled gradients; the others by their rows."""
        # (every item is a TableWiseRows: fleet.sparse.backends.step_tables groups the backends by class)
        pooled = [(b, g) for b, g in items if b.awaits_pooled_step]  # type: ignore[attr-defined]
        by_rows = [(b, g) for b, g in items if not b.awaits_pooled_step]  # type: ignore[attr-defined]
        if by_rows:
            super().step_together(by_rows, optimizer_class)
        if pooled:
            cls._step_pooled(pooled, optimizer_class)  # type: ignore[arg-type]

    @classmethod
    def _step_pooled(cls, items: list[tuple[TableWiseRows, dict[str, Any]]], optimizer_class: type) -> None:
        first = items[0][0]
        world, rank = first.workers, first.rank
        announce = first._announcing("pooled step", len(items), float(items[0][1]["lr"]))
        what = first._what("sending pooled gradients to")
        # A holder's own gradients do not travel: it takes them as they are (the same values).
        pieces: list[list[torch.Tensor]] = [[] for _ in range(world)]
        own: dict[int, list[torch.Tensor]] = {}
        per_table: list[list[torch.Tensor]] = []
        for t, (backend, _) in enumerate(items):
            clicks = backend.shard.lifecycle.active  # the labels ride along: a table counting its clicks
            grads = []
            for vectors, labels in backend.take_sent():
                grads.extend(v.grad if v.grad is not None else torch.zeros_like(v) for v in vectors)
                if clicks:
                    grads.append(labels if labels is not None else torch.zeros(vectors[0].shape[0]))
            grads = [g.detach().to(torch.float32) for g in grads]
            if backend.holder == rank:
                own[t] = grads
            else:
                pieces[backend.holder].extend(grads)
            per_table.append(grads)
        bad = _nonfinite_flags(per_table, [float(group["lr"]) for _, group in items])
        sizes = [sum(int(p.numel()) for p in row) for row in pieces]
        got, heads, _ = first.exchange_pieces(
            [p for row in pieces for p in row], sizes, torch.tensor(bad, dtype=torch.int64).expand(world, -1), None,
            torch.float32, what, announce,
        )  # fmt: skip
        assert heads is not None
        at = [0] * world
        for t, (backend, group) in enumerate(items):
            if backend.holder != rank:
                continue
            held = backend.take_held()
            clicks = backend.shard.lifecycle.active
            mine = iter(own[t])
            dim = backend.shard.embedding_dim
            ids, grads, counted = [], [], []
            for forward in held:
                upstream = []
                for _ in range(forward.features):
                    parts = []
                    for i in range(world):
                        if i == rank:
                            parts.append(next(mine))
                            continue
                        n = forward.bags[i] * dim
                        parts.append(got[i][at[i] : at[i] + n].view(forward.bags[i], dim))
                        at[i] += n
                    upstream.append(torch.cat(parts))
                ids.append(forward.unique)
                grads.append(forward.gradient(upstream, world))  # the mean over the workers: divided there
                if clicks:  # the union's labels, worker after worker, counted per unique id as one process does
                    labels = []
                    for i in range(world):
                        if i == rank:
                            labels.append(next(mine))
                            continue
                        labels.append(got[i][at[i] : at[i] + forward.bags[i]])
                        at[i] += forward.bags[i]
                    counted.append(forward.clicks(torch.cat(labels)))
            lr = float(group["lr"])
            if any(row[t] for row in heads):
                nonfinite.refuse(f"sparse table of {backend.shard.name}(dim {backend.shard.embedding_dim})", None,
                                 backend.where)  # fmt: skip
                continue
            block = torch.cat(grads) if len(grads) > 1 else grads[0].detach()
            if clicks:  # summed over the workers, not averaged: one more column, as on the row path
                block = torch.cat([block, torch.cat(counted).unsqueeze(1)], 1)
            unique = torch.cat(ids) if len(ids) > 1 else ids[0]
            backend.local.apply(optimizer_class, group, unique, block, lr, where=backend.where)
