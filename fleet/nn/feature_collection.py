"""SparseFeatureCollection: many sparse features in one module, their tables pulled and pushed together.

A CTR model has tens of sparse features (DLRM: 8 to 26), each a bag of ids per sample pooled into
one vector. As separate :class:`~fleet.nn.SparseEmbeddingBag` modules, each feature costs its own
pull and push per server per step; here every table of the collection is pulled in **one request
per server** per forward, and (in a parameter-server job) every sparse table of the optimizer is
pushed in one request per server per step. This is the role of TorchRec's
``EmbeddingBagCollection`` with a ``KeyedJaggedTensor``, in fleet's style:

- each :class:`FeatureTable` is a table with its own dimension, pooling mode, ``padding_idx``,
  optimizer, initializer and life cycle (any :class:`~fleet.nn.SparseEmbedding` argument);
  several features may share one table (``features=[...]``), pulled once for all of them;
- the input is jagged: a :class:`JaggedFeatures` (keys, values, lengths or offsets, optional
  per-id weights: the layout of TorchRec's ``KeyedJaggedTensor``, which is accepted as it is when
  TorchRec is installed; fleet does not depend on it), or a dict ``{feature: 2-D tensor of bags}``
  / ``{feature: {"ids": ..., "offsets": ...}}`` (``nn.EmbeddingBag``'s ``offsets``: where each bag
  starts, one per bag) / ``{feature: {"ids": ..., "lengths": ...}}`` (ids per bag), either with
  an optional ``"weights"`` (one per id), or the tuples ``(values, lengths)`` / ``(values, lengths, weights)``;
- the output is a dict ``{feature: [batch, dim]}`` in the collection's feature order
  (``torch.cat(list(out.values()), 1)`` is TorchRec's ``KeyedTensor.values()``).

Each table is a :class:`~fleet.nn.SparseEmbeddingBag` child (``collection.tables[name]``), so its
rows, ``state_dict`` entries, optimizer and backend are those of a bag module in every mode;
only the pull is shared.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fleet.nn.bag_kernels import TableBags, sum_bags, sum_bags_gradient, sum_bags_many, unique_inverse
from fleet.nn.sparse_embedding import SparseEmbedding
from fleet.nn.sparse_embedding_bag import MODES, SparseEmbeddingBag, bag_of_entries, pool, sums_natively
from fleet.nn.torch_signature import refuse_unknown
from fleet.sparse import backends
from fleet.sparse.native import kernels

# What a FeatureTable passes on to its table: SparseEmbedding's keyword arguments.
_TABLE_ARGUMENTS = set(inspect.signature(SparseEmbedding.__init__).parameters) - {
    "self", "sizes", "embedding_dim", "num_embeddings", "unknown"
}  # fmt: skip


class FeatureTable:
    """One table of a :class:`SparseFeatureCollection`: ``FeatureTable("user", 32, features=["user_id"])``.

    ``features`` (default: ``[name]``) are the input features looked up in it; ``mode`` is the
    pooling of each bag (sum, mean, max); ``padding_idx`` an id that contributes nothing; every other
    keyword argument is :class:`~fleet.nn.SparseEmbedding`'s (``initializer``, ``optimizer``,
    ``seed``, ``entry``, ``max_rows``, ``ttl_steps``, ``decay``, ``state_dict_rows``).
    """

    def __init__(
        self,
        name: str,
        dim: int,
        features: Sequence[str] | None = None,
        mode: str = "sum",
        padding_idx: int | None = None,
        **table: Any,
    ):
        if not isinstance(name, str) or not name or "." in name:
            raise ValueError(f"FeatureTable name must be a non-empty string without '.', got {name!r}")
        if isinstance(features, str):
            raise TypeError(f"FeatureTable {name!r}: features is a list of feature names, got the string {features!r}")
        self.name = name
        self.dim = dim
        self.features = tuple(features) if features is not None else (name,)
        if not self.features or not all(isinstance(f, str) and f for f in self.features):
            raise ValueError(f"FeatureTable {name!r}: features must be non-empty strings, got {list(self.features)}")
        if mode not in MODES:
            raise ValueError(f"FeatureTable {name!r}: mode must be one of {', '.join(MODES)}; got {mode!r}")
        unknown = sorted(set(table) - _TABLE_ARGUMENTS)
        if unknown:
            refuse_unknown(f"FeatureTable {name!r}", {k: table[k] for k in unknown})
        self.mode = mode
        self.padding_idx = padding_idx
        self.table = table

    def __repr__(self) -> str:
        return f"FeatureTable({self.name!r}, {self.dim}, features={list(self.features)}, mode={self.mode!r})"


class JaggedFeatures:
    """Bags of ids for several features: TorchRec's ``KeyedJaggedTensor`` layout, without TorchRec.

    ``values`` holds every feature's ids, feature after feature (each feature's bags in batch
    order); ``lengths`` (``[features * batch]``) the ids per bag, or ``offsets``
    (``[features * batch + 1]``) where each bag starts; ``weights`` one per id (``mode="sum"``).
    """

    def __init__(
        self,
        keys: Sequence[str],
        values: torch.Tensor,
        lengths: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
    ):
        if (lengths is None) == (offsets is None):
            raise ValueError("JaggedFeatures takes lengths or offsets (one of the two)")
        if lengths is None:
            offsets = torch.as_tensor(offsets).to(torch.int64)
            if offsets.dim() != 1 or offsets.numel() < 1 or int(offsets[0]) != 0:
                raise ValueError("JaggedFeatures: offsets must be 1-D and start at 0")
            lengths = offsets.diff()
        self._keys = list(keys)
        self._values = values
        self._lengths = torch.as_tensor(lengths).to(torch.int64)
        self._weights = weights

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def lengths(self) -> torch.Tensor:
        return self._lengths

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights


# One feature's bags: (ids, offsets [bags + 1], per-id weights or None).
Bags = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def _lengths_to_offsets(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])


def _bag_offsets(given: Any, n: int, lengths: bool) -> torch.Tensor | None:
    """The ``[bags + 1]`` offsets of bags of ``n`` ids from their 1-D starts (or ``lengths``); None where
    ``given`` describes no such bags (checked and converted in one native pass)."""
    if not isinstance(given, torch.Tensor) or given.dtype != torch.int64:  # (an int64 tensor: as it is)
        given = torch.as_tensor(given).to(torch.int64)
    if given.dim() != 1:
        return None
    out = torch.empty(given.numel() + 1, dtype=torch.int64)
    return out if kernels.bag_offsets(given.contiguous().numpy(), n, lengths, out.numpy()) else None


def _check_ids(feature: str, values: torch.Tensor) -> torch.Tensor:
    if not isinstance(values, torch.Tensor) or values.dtype.is_floating_point or values.dtype == torch.bool:
        got = values.dtype if isinstance(values, torch.Tensor) else type(values).__name__
        raise TypeError(f"feature {feature!r}: ids must be an integer tensor, got {got}")
    return values.to(torch.int64)


def _from_jagged(features: Any) -> dict[str, Bags]:
    """Each feature's bags from a KeyedJaggedTensor-like object (keys(), values(), lengths(), weights_or_none())."""
    keys = list(features.keys())
    values, lengths = features.values(), features.lengths().to(torch.int64)
    weights = features.weights_or_none() if hasattr(features, "weights_or_none") else None
    if not keys:
        raise ValueError("the jagged features have no keys")
    if lengths.dim() != 1 or lengths.numel() % len(keys):
        raise ValueError(
            f"the jagged features' lengths ({lengths.numel()}) are not one per bag of each of {len(keys)} keys"
        )
    if bool((lengths < 0).any()) or int(lengths.sum()) != values.numel():
        raise ValueError(
            f"the jagged features' lengths add up to {int(lengths.sum())}, not to the {values.numel()} ids"
        )
    if weights is not None and weights.numel() != values.numel():
        raise ValueError(f"the jagged features carry {weights.numel()} weights for {values.numel()} ids")
    batch = lengths.numel() // len(keys)
    per_key = lengths.view(len(keys), batch)
    ends = _lengths_to_offsets(per_key.sum(1)).tolist()
    out = {}
    for k, key in enumerate(keys):
        lo, hi = ends[k], ends[k + 1]
        ids = _check_ids(key, values[lo:hi])
        out[key] = (ids, _lengths_to_offsets(per_key[k]), None if weights is None else weights[lo:hi])
    return out


# A feature's bags as a dict: "ids" with "offsets" (each bag's start, [batch], as nn.EmbeddingBag's offsets)
# or "lengths" (ids per bag, [batch]), and optional "weights" (one per id).
BAG_KEYS = ("ids", "offsets", "lengths", "weights")


def _from_bag_dict(name: str, given: Mapping[str, Any]) -> Bags:
    keys = set(given)
    if "ids" not in keys or len(keys & {"offsets", "lengths"}) != 1 or not keys <= set(BAG_KEYS):
        raise ValueError(
            f"feature {name!r}: a dict of bags holds 'ids' and one of 'offsets' (each bag's start, as "
            f"nn.EmbeddingBag's offsets) or 'lengths' (ids per bag), and optionally 'weights'; got {sorted(keys)}"
        )
    ids = _check_ids(name, given["ids"]).reshape(-1)
    if "lengths" in given:
        offsets = _bag_offsets(given["lengths"], ids.numel(), lengths=True)
        if offsets is None:
            raise ValueError(f"feature {name!r}: lengths must be 1-D, >= 0, adding up to the {ids.numel()} ids")
    else:
        offsets = _bag_offsets(given["offsets"], ids.numel(), lengths=False)
        if offsets is None:
            raise ValueError(
                f"feature {name!r}: offsets must be 1-D, start at 0 and not decrease, within the {ids.numel()} ids "
                "(one per bag: where it starts, as nn.EmbeddingBag's offsets without include_last_offset)"
            )
    weights = given.get("weights")
    if weights is not None and weights.numel() != ids.numel():
        raise ValueError(f"feature {name!r}: {weights.numel()} weights for {ids.numel()} ids")
    return ids, offsets, None if weights is None else weights.reshape(-1)


def _from_dict(features: Mapping[str, Any]) -> dict[str, Bags]:
    out = {}
    for name, given in features.items():
        if isinstance(given, torch.Tensor):
            ids = _check_ids(name, given)
            if ids.dim() != 2:
                raise ValueError(
                    f"feature {name!r}: a tensor is a 2-D batch of bags, got {ids.dim()}-D; pass "
                    "{'ids': ..., 'offsets': ...} or (values, lengths) for bags of varied length"
                )
            batch, width = ids.shape
            out[name] = (ids.reshape(-1), torch.arange(batch + 1) * width, None)
        elif isinstance(given, Mapping):
            out[name] = _from_bag_dict(name, given)
        elif isinstance(given, tuple | list) and len(given) in (2, 3):
            lengths = {"ids": given[0], "lengths": given[1]}
            out[name] = _from_bag_dict(name, lengths if len(given) == 2 else {**lengths, "weights": given[2]})
        else:
            raise TypeError(
                f"feature {name!r}: expected a 2-D tensor of bags, {{'ids': ..., 'offsets' or 'lengths': ...}}, "
                f"(values, lengths) or (values, lengths, weights); got {type(given).__name__}"
            )
    return out


def _entry_clicks(layout: list[tuple[torch.Tensor, torch.Tensor | None, int]], labels: torch.Tensor) -> torch.Tensor:
    """Each kept entry's label (its sample's), feature after feature: ``layout`` holds each feature's (offsets [bags
    + 1], kept entries or None, number of ids)."""
    per_feature = []
    for offsets, keep, size in layout:
        bag_of, bags = bag_of_entries(torch.Size([size]), offsets, True)
        if labels.numel() != bags:
            raise ValueError(f"record_clicks got {labels.numel()} labels for {bags} samples: one per sample")
        per_entry = torch.where(bag_of >= 0, labels[bag_of.clamp(min=0)], 0.0)
        per_feature.append(per_entry if keep is None else per_entry[keep])
    return torch.cat(per_feature)


def _pool_union(
    table: SparseEmbeddingBag,
    ids: list[torch.Tensor],
    lengths: list[torch.Tensor],
    weights: list[torch.Tensor | None],
    pull: Any,
    training: bool,
) -> tuple[torch.Tensor, list[torch.Tensor], Any, Any]:
    """The lookup and pooling of one table's features (``ids``, bag ``lengths`` and per-id ``weights`` or None of
    each) as the collection's forward does them, for the worker holding the table (``pull`` reads its rows), on the
    union of every worker's bags: (the unique ids; each feature's pooled bags; ``clicks(labels)``: each unique id's
    clicks from one label per bag, as ``record_clicks`` counts them; ``gradient(upstream, divisor=1)``: the unique
    rows' gradient ``[unique, dim]`` given each feature's pooled gradient, as one process's backward gives it,
    divided by ``divisor`` (the holder's mean over the workers), or None when not ``training``).

    Why no autograd where the bags are plain sums (``sums_natively``): the holder needs only the rows' gradient,
    which ``bag_kernels.sum_bags_gradient`` gives directly, bit for bit autograd's; elsewhere (mean, max,
    weights, a padding id) the rows are a leaf requiring grad and ``gradient`` runs autograd's backward."""
    kept, keeps = [], []
    for feature_ids in ids:
        k, keep = table.kept_ids(feature_ids)
        kept.append(k)
        keeps.append(keep)
    unique, inverse = unique_inverse(kept[0] if len(kept) == 1 else torch.cat(kept))
    rows = pull(unique)
    mines, offsets_of, at = [], [], 0
    for feature_ids, k, feature_lengths in zip(ids, kept, lengths, strict=True):
        mines.append(inverse[at : at + k.numel()])
        # one native pass where the lengths add up to the feature's ids (every worker's do)
        offsets = _bag_offsets(feature_lengths, feature_ids.numel(), True)
        offsets_of.append(offsets if offsets is not None else _lengths_to_offsets(feature_lengths))
        at += k.numel()
    direct = all(
        sums_natively(rows, mine, keep, offsets, table.mode, w, True)
        for mine, keep, offsets, w in zip(mines, keeps, offsets_of, weights, strict=True)
    )
    if training and not direct:
        rows = rows.detach().requires_grad_(True)
    pooled, layout = [], []
    with torch.set_grad_enabled(training and not direct):
        for feature_ids, mine, keep, offsets, w in zip(ids, mines, keeps, offsets_of, weights, strict=True):
            if direct:
                pooled.append(sum_bags(rows, mine, offsets, graph=False))
            else:
                pooled.append(pool(rows, mine, keep, feature_ids.shape, offsets, table.mode, w, True))
            layout.append((offsets, keep, feature_ids.numel()))

    def clicks(labels: torch.Tensor) -> torch.Tensor:
        return torch.zeros(unique.numel()).index_add_(0, inverse.reshape(-1), _entry_clicks(layout, labels))

    if not direct:

        def gradient(upstream: list[torch.Tensor], divisor: int = 1) -> torch.Tensor:
            torch.autograd.backward(pooled, upstream)
            grad = rows.grad if rows.grad is not None else torch.zeros_like(rows)
            return grad.div_(divisor) if divisor != 1 else grad

        return unique, pooled, clicks, gradient if training else None
    size = rows.shape  # (the rows themselves are not kept for the step)

    def sums_gradient(upstream: list[torch.Tensor], divisor: int = 1) -> torch.Tensor:
        # autograd's sum of one leaf's gradients: the last feature's first (its node ran first), each next one
        # added to the running sum; then divided by ``divisor`` (one feature: in the kernel's pass)
        if len(upstream) == 1:
            return sum_bags_gradient(upstream[0], mines[0], offsets_of[0], size[0], divisor)
        total = None
        for mine, offsets, grad in reversed(list(zip(mines, offsets_of, upstream, strict=True))):
            part = sum_bags_gradient(grad, mine, offsets, size[0])
            total = part if total is None else total.add_(part)
        if total is None:
            return torch.zeros(size)
        return total.div_(divisor) if divisor != 1 else total

    return unique, pooled, clicks, sums_gradient if training else None


class SparseFeatureCollection(nn.Module):
    """``SparseFeatureCollection([FeatureTable("t0", 16, ["f0", "f1"]), ...])(features)`` -> ``{feature: [B, dim]}``.

    It is also a sequence of its tables, as the ``nn.ModuleList`` of ``nn.EmbeddingBag`` it replaces:
    ``len(collection)``, ``for table in collection``, ``collection[k]`` (the k-th table, or by name) give
    the :class:`~fleet.nn.SparseEmbeddingBag` tables, each callable as ``nn.EmbeddingBag`` is
    (``table(ids, offsets, per_sample_weights)``). Called one by one they pull one by one; the
    collection's own forward pulls every table in one request per server.
    """

    def __init__(self, tables: Sequence[FeatureTable]):
        super().__init__()
        tables = list(tables)
        if not tables or not all(isinstance(t, FeatureTable) for t in tables):
            raise TypeError("SparseFeatureCollection takes a non-empty list of fleet.nn.FeatureTable")
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"SparseFeatureCollection: table names repeat: {names}")
        self.feature_names: list[str] = [f for t in tables for f in t.features]
        repeated = sorted({f for f in self.feature_names if self.feature_names.count(f) > 1})
        if repeated:
            raise ValueError(f"SparseFeatureCollection: features {repeated} are looked up in more than one table")
        self.tables = nn.ModuleDict(
            {
                # include_last_offset=False: a table called on its own takes nn.EmbeddingBag's offsets; the
                # collection's forward pools with its own [bags + 1] offsets.
                t.name: SparseEmbeddingBag(t.dim, t.mode, padding_idx=t.padding_idx, **t.table)
                for t in tables
            }
        )
        self._features = {t.name: t.features for t in tables}
        self._feature_set = frozenset(self.feature_names)
        # The last training forward's per-table layout (each feature's offsets and kept entries), for record_clicks.
        # (None: the table's bags were pooled by its holder, fleet.collective.table_wise)
        self._layout: dict[str, list[tuple[torch.Tensor, torch.Tensor | None, int]] | None] = {}
        # A prefetch: (a copy of each feature's ids, the plans made of them, the future of their rows)
        self._prefetched: tuple[list[torch.Tensor], list[tuple], Any] | None = None

    def extra_repr(self) -> str:
        return f"features={self.feature_names}"

    def __len__(self) -> int:
        return len(self.tables)

    def __iter__(self) -> Iterator[SparseEmbeddingBag]:
        return iter(self.tables.values())

    def __getitem__(self, key: int | str) -> SparseEmbeddingBag:
        """The table at position ``key`` (as a ModuleList's) or named ``key``."""
        if isinstance(key, str):
            return self.tables[key]
        return list(self.tables.values())[key]

    def features_of(self, table: str) -> tuple[str, ...]:
        """The names of the features table ``table`` pools (its ``FeatureTable``'s)."""
        return tuple(self._features[table])

    def ids_by_table(self, features: Any) -> dict[str, torch.Tensor]:
        """Each table's ids in ``features``, duplicates included: what a forward looks up, for tools that
        count them (fleet.plan's probe counts each table's unique ids per step); nothing is pulled."""
        bags = self._bags(features)
        return {name: torch.cat([bags[f][0].reshape(-1) for f in fs]) for name, fs in self._features.items()}

    def _bags(self, features: Any) -> dict[str, Bags]:
        if isinstance(features, Mapping):
            bags = _from_dict(features)
        elif all(hasattr(features, m) for m in ("keys", "values", "lengths")):
            bags = _from_jagged(features)
        else:
            raise TypeError(
                "SparseFeatureCollection takes fleet.nn.JaggedFeatures, a torchrec KeyedJaggedTensor, or a dict "
                f"{{feature: bags}}; got {type(features).__name__}"
            )
        missing = [f for f in self.feature_names if f not in bags]
        unknown = [f for f in bags if f not in self._feature_set]
        if missing or unknown:
            raise ValueError(
                f"SparseFeatureCollection: features missing from the input: {missing}; not in the collection: "
                f"{unknown} (its features: {self.feature_names})"
            )
        sizes = {f: b[1].numel() - 1 for f, b in bags.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"SparseFeatureCollection: the features' batch sizes differ: {sizes}")
        for name, table in self.tables.items():
            for feature in self._features[name]:
                if bags[feature][2] is not None and table.mode != "sum":
                    raise ValueError(
                        f"feature {feature!r}: per-id weights need mode='sum' (as torch); table {name!r} is "
                        f"mode={table.mode!r}"
                    )
        return bags

    def _plan(self, bags: dict[str, Bags]) -> list[tuple]:
        """Per table: (name, module, its features' kept ids, keep masks, the unique ids, the inverse index)."""
        plans = []
        for name, table in self.tables.items():
            kept, keeps = [], []
            for feature in self._features[name]:
                ids, keep = table.kept_ids(bags[feature][0])
                kept.append(ids)
                keeps.append(keep)
            unique, inverse = unique_inverse(kept[0] if len(kept) == 1 else torch.cat(kept))
            plans.append((name, table, kept, keeps, unique, inverse))
        return plans

    def prefetch(self, features: Any) -> None:
        """Start pulling a coming batch's rows now, so that its forward need not wait for them.

        Where rows may be a step old anyway (parameter server, ``update="async"``) every table's rows
        are pulled in the background, one request per server, while this step computes; elsewhere
        it does nothing. Call it with the next batch before this step's ``optimizer.step()``; the
        forward whose batch has the same ids uses it.
        """
        if not backends.can_prefetch([table.backend() for table in self.tables.values()]):
            self._prefetched = None  # the forward pulls (and reads its input): doing it now would be done twice
            return
        bags = self._bags(features)
        plans = self._plan(bags)
        future = backends.prefetch_many([(table.backend(), unique) for _, table, _, _, unique, _ in plans])
        # A copy of the ids (the caller may refill its tensors in place before the forward): the forward whose
        # ids equal them takes these plans (unique ids, inverse) and rows instead of making them again.
        seen = [bags[f][0].clone() for f in self.feature_names]
        self._prefetched = (seen, plans, future) if future is not None else None

    def _take_prefetch(self, bags: dict[str, Bags]) -> tuple[list[tuple], Any] | None:
        """The prefetch made of exactly these bags' ids (its plans and rows' future), else None; used once."""
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is None:
            return None
        seen, plans, future = prefetched
        if not all(torch.equal(bags[f][0], ids) for f, ids in zip(self.feature_names, seen, strict=True)):
            return None
        return plans, future

    def _pull(self, plans: list[tuple], where: list[Any], future: Any = None) -> list[torch.Tensor]:
        """Each plan's rows, from its table's backend (``where``, in the plans' order)."""
        if future is not None:
            rows = backends.collect_many(future)
            if rows is not None:
                return rows
        return backends.pull_many([(backend, plan[4]) for backend, plan in zip(where, plans, strict=True)])

    def _pooled_where_held(
        self, bags: dict[str, Bags], training: bool, where: list[Any]
    ) -> dict[str, torch.Tensor] | None:
        """Every feature's pooled bags, pooled by the workers holding the tables (tables sharded table-wise:
        ``fleet.collective.table_wise``; ``where``: each table's backend), or None where the rows come here to be
        pooled."""
        requests = [[bags[f] for f in self._features[name]] for name in self.tables]
        got = backends.pool_many(where, requests, training, _pool_union)
        if got is None:
            return None
        out = {f: vector for name, vectors in zip(self.tables, got, strict=True)
               for f, vector in zip(self._features[name], vectors, strict=True)}  # fmt: skip
        if training:
            self._layout = {name: None for name in self.tables}
        return {f: out[f] for f in self.feature_names}

    def forward(self, features: Any) -> dict[str, torch.Tensor]:
        bags = self._bags(features)
        training = torch.is_grad_enabled() and self.training
        where = [table.backend() for table in self.tables.values()]  # asked once a forward: the strategy's choice
        pooled = self._pooled_where_held(bags, training, where)
        if pooled is not None:
            return pooled
        prefetched = self._take_prefetch(bags)
        plans, future = prefetched if prefetched is not None else (self._plan(bags), None)
        pulled = self._pull(plans, where, future)
        out: dict[str, torch.Tensor] = {}
        summed: list[TableBags] = []  # the tables whose every feature is a plain sum: pooled by one node
        summed_features: list[str] = []
        for (name, table, kept, keeps, unique, inverse), rows in zip(plans, pulled, strict=True):
            rows = table.track(unique, rows, inverse)
            at = 0
            layout, mines = [], []
            for feature, ids, keep in zip(self._features[name], kept, keeps, strict=True):
                values, offsets, weights = bags[feature]
                mines.append(inverse[at : at + ids.numel()])
                at += ids.numel()
                layout.append((offsets, keep, values.numel()))
            features = self._features[name]
            if all(sums_natively(rows, mine, keep, bags[f][1], table.mode, bags[f][2], True)
                   for f, mine, keep in zip(features, mines, keeps, strict=True)):  # fmt: skip
                summed.append((rows, [(mine, bags[f][1]) for f, mine in zip(features, mines, strict=True)]))
                summed_features.extend(features)
            else:
                for feature, mine, keep in zip(features, mines, keeps, strict=True):
                    values, offsets, weights = bags[feature]
                    out[feature] = pool(rows, mine, keep, values.shape, offsets, table.mode, weights, True)
            if training:
                self._layout[name] = layout
        if summed:
            out.update(zip(summed_features, sum_bags_many(summed), strict=True))
        return {f: out[f] for f in self.feature_names}

    def record_clicks(self, labels: torch.Tensor) -> None:
        """Feed the clicks of the last training forward's samples (``labels``: one per sample): every id of a
        sample's bags, in every feature, gets its label (the tables' show/click statistics)."""
        if not self._layout:
            raise RuntimeError("record_clicks follows a training forward of this SparseFeatureCollection")
        labels = torch.as_tensor(labels).detach().to(torch.float32).reshape(-1)
        for name, layout in self._layout.items():
            if layout is None:  # pooled by its holder, which counts the clicks from the labels at the step
                self.tables[name].backend().add_labels(labels)
            else:
                self.tables[name].add_clicks(_entry_clicks(layout, labels))
        self._layout = {}
