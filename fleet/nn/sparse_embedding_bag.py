"""SparseEmbeddingBag: ``nn.EmbeddingBag`` over a sparse table, for multi-hot features.

A multi-hot feature (a user's last clicked items, a document's words) is a bag of ids per
sample, pooled into one vector: the sum, mean or max of its rows, optionally weighted per id.
The module takes ``nn.EmbeddingBag``'s inputs (``input`` + ``offsets``, or a 2-D ``input`` whose
rows are the bags; ``per_sample_weights``; ``include_last_offset``) and returns its outputs on the
rows of a fleet table, keyed by arbitrary int64 ids.

It is a :class:`~fleet.nn.SparseEmbedding` (same table, initializer, optimizer, life cycle and
backend in every mode); only the forward differs. The batch's unique ids are pulled once and
pooled with ``torch.nn.functional.embedding_bag`` over those unique rows through the inverse
index, so no tensor of one row per looked-up id is built, and the gradient the table receives is
one row per unique id, as from ``SparseEmbedding``.

``padding_idx`` is an **id** (any int64, not a position): its entries are left out of every bag
(they count for neither the sum nor a mean's divisor, as in torch), and the id is never looked up,
so it gets no row and no gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fleet.nn import torch_signature
from fleet.nn.bag_kernels import sum_bags
from fleet.nn.sparse_embedding import SparseEmbedding

MODES = ("sum", "mean", "max")


class SparseEmbeddingBag(SparseEmbedding):
    """``SparseEmbeddingBag(16, mode="sum")(ids, offsets)`` -> ``[bags, 16]``; rows are created on first touch.

    ``SparseEmbeddingBag(num_embeddings, embedding_dim, mode="sum", sparse=True, ...)`` takes
    ``nn.EmbeddingBag``'s signature: the same table, with ``num_embeddings`` as an id bound (ids outside
    ``[0, num_embeddings)`` raise ``IndexError``), ``padding_idx`` torch's index, and torch's other
    arguments as :mod:`fleet.nn.torch_signature` says. In fleet's own form (no ``num_embeddings``) any
    int64 id is a row and ``padding_idx`` is such an id; ``mode`` may come second (``SparseEmbeddingBag(16,
    "sum")``). ``mode``, ``padding_idx`` and ``include_last_offset`` are ``nn.EmbeddingBag``'s; every other
    keyword argument is :class:`~fleet.nn.SparseEmbedding`'s (``initializer``, ``optimizer``, ``seed``,
    ``entry``, ``max_rows``, ``ttl_steps``, ``decay``, ``state_dict_rows``).
    """

    def __init__(
        self,
        *sizes: Any,
        mode: str | None = None,
        padding_idx: int | None = None,
        include_last_offset: bool = False,
        num_embeddings: int | None = None,
        embedding_dim: int | None = None,
        **table: Any,
    ):
        owner = type(self).__name__
        given = torch_signature.sizes(owner, sizes, num_embeddings, embedding_dim, "mode")
        if given.second is not None:
            if mode is not None:
                raise TypeError(f"{owner} got the mode twice (second argument and mode=)")
            mode = given.second
        mode = "mean" if mode is None else mode
        if mode not in MODES:
            raise ValueError(f"{owner} mode must be one of {', '.join(MODES)}; got {mode!r}")
        if padding_idx is not None and (isinstance(padding_idx, bool) or not isinstance(padding_idx, int)):
            raise TypeError(f"padding_idx must be an int id (or None), got {type(padding_idx).__name__}")
        if given.num_embeddings is not None:
            padding_idx = torch_signature.torch_padding(owner, given.num_embeddings, padding_idx)
        super().__init__(embedding_dim=given.embedding_dim, num_embeddings=given.num_embeddings, **table)
        self.mode = mode
        self.padding_idx = padding_idx
        self.include_last_offset = bool(include_last_offset)
        # The last training forward's bag layout (input shape, offsets, kept entries), for record_clicks.
        self._layout: tuple[torch.Size, torch.Tensor | None, torch.Tensor | None] | None = None

    def extra_repr(self) -> str:
        bag = f", mode={self.mode!r}"
        if self.padding_idx is not None:
            bag += f", padding_idx={self.padding_idx}"
        if self.include_last_offset:
            bag += ", include_last_offset=True"
        return super().extra_repr() + bag

    # ------------------------------------------------------------------ lookup
    def kept_ids(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the flat ids but the padding id's, the mask of kept entries or None when all are kept)."""
        flat = ids.reshape(-1)
        if self.padding_idx is None:
            return flat, None
        keep = flat != self.padding_idx
        if bool(keep.all()):
            return flat, None
        return flat[keep], keep

    def prefetch(self, input: torch.Tensor) -> None:  # noqa: A002 - nn.EmbeddingBag's name
        """Start fetching the rows of a coming batch's ``input`` (see :meth:`SparseEmbedding.prefetch`)."""
        super().prefetch(self.kept_ids(self._check_ids(input))[0])

    def _check_bags(
        self, ids: torch.Tensor, offsets: torch.Tensor | None, weights: torch.Tensor | None
    ) -> torch.Tensor | None:
        if ids.dim() == 2:
            if offsets is not None:
                raise ValueError(
                    "SparseEmbeddingBag: offsets must be None for a 2-D input (each row is a bag of "
                    f"{ids.shape[1]} ids), got offsets of shape {list(offsets.shape)}"
                )
        elif ids.dim() == 1:
            if offsets is None:
                raise ValueError(
                    "SparseEmbeddingBag: a 1-D input needs offsets (where each bag starts in it), or pass a 2-D "
                    "input whose rows are the bags"
                )
            if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.is_floating_point():
                shape = list(offsets.shape) if isinstance(offsets, torch.Tensor) else type(offsets).__name__
                raise ValueError(f"SparseEmbeddingBag: offsets must be a 1-D integer tensor, got {shape}")
            offsets = offsets.to(torch.int64)
        else:
            raise ValueError(
                f"SparseEmbeddingBag takes a 1-D input with offsets or a 2-D input of bags, got {ids.dim()}-D"
            )
        if weights is not None:
            if self.mode != "sum":
                raise ValueError(
                    f"SparseEmbeddingBag: per_sample_weights need mode='sum' (as torch), got {self.mode!r}"
                )
            if weights.shape != ids.shape:
                raise ValueError(
                    f"SparseEmbeddingBag: per_sample_weights of shape {list(weights.shape)} for an input of "
                    f"shape {list(ids.shape)}: one weight per id"
                )
        return offsets

    def forward(  # type: ignore[override]  # nn.EmbeddingBag's signature, not SparseEmbedding's
        self,
        input: torch.Tensor,  # noqa: A002 - nn.EmbeddingBag's name
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        ids = self._check_ids(input)
        offsets = self._check_bags(ids, offsets, per_sample_weights)
        kept, keep = self.kept_ids(ids)
        rows, inverse = self._gather(kept)
        if torch.is_grad_enabled() and self.training:
            self._layout = (ids.shape, offsets, keep)
        return pool(rows, inverse, keep, ids.shape, offsets, self.mode, per_sample_weights, self.include_last_offset)

    def record_clicks(self, labels: torch.Tensor) -> None:
        """Feed the clicks of the last forward's bags (``labels``: one per bag); each id of a bag gets its label."""
        if not self._pending or self._layout is None:
            raise RuntimeError("record_clicks follows a training forward of this SparseEmbeddingBag")
        shape, offsets, keep = self._layout
        bag_of, bags = bag_of_entries(shape, offsets, self.include_last_offset)
        labels = torch.as_tensor(labels).detach().to(torch.float32).reshape(-1)
        if labels.numel() != bags:
            raise ValueError(f"record_clicks got {labels.numel()} labels for {bags} bags: one per bag")
        per_entry = torch.where(bag_of >= 0, labels[bag_of.clamp(min=0)], 0.0)
        if keep is not None:
            per_entry = per_entry[keep]
        self.add_clicks(per_entry)


def sums_natively(
    rows: torch.Tensor,
    inverse: torch.Tensor,
    keep: torch.Tensor | None,
    offsets: torch.Tensor | None,
    mode: str,
    weights: torch.Tensor | None,
    include_last_offset: bool,
) -> bool:
    """Whether :func:`pool` pools these bags with ``fleet.nn.bag_kernels.sum_bags`` (unweighted sums of every entry
    over float32 rows, ``[bags + 1]`` offsets covering the ids): then the rows' gradient is
    ``bag_kernels.sum_bags_gradient``'s."""
    return bool(
        mode == "sum"
        and keep is None
        and weights is None
        and include_last_offset
        and offsets is not None
        and rows.dtype == torch.float32
        and inverse.dim() == 1
        and offsets.numel()
        and int(offsets[-1]) == inverse.numel()
    )


def pool(
    rows: torch.Tensor,
    inverse: torch.Tensor,
    keep: torch.Tensor | None,
    shape: torch.Size,
    offsets: torch.Tensor | None,
    mode: str,
    weights: torch.Tensor | None,
    include_last_offset: bool,
) -> torch.Tensor:
    """Bags of ``rows`` (unique rows; ``inverse``: the row of each kept entry of an input of ``shape``; ``keep``:
    which entries are kept, None for all) pooled as ``nn.EmbeddingBag`` pools them."""
    if sums_natively(rows, inverse, keep, offsets, mode, weights, include_last_offset):
        return sum_bags(rows, inverse, offsets)  # the common case: the same values, a native backward
    padding = None
    if keep is not None:
        # The padding id's entries point at one zero row past the unique rows, which
        # embedding_bag's padding_idx leaves out of every bag (and of a mean's divisor).
        padding = rows.shape[0]
        rows = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
        inverse = torch.full(keep.shape, padding, dtype=torch.int64).masked_scatter_(keep, inverse)
    return F.embedding_bag(
        inverse.view(shape),
        rows,
        offsets,
        mode=mode,
        per_sample_weights=weights,
        include_last_offset=include_last_offset,
        padding_idx=padding,
    )


def bag_of_entries(shape: torch.Size, offsets: torch.Tensor | None, include_last: bool) -> tuple[torch.Tensor, int]:
    """(the bag of each entry of a flat input, -1 for entries past the last bag; the number of bags)."""
    if offsets is None:  # 2-D: each row is a bag
        return torch.arange(shape[0]).repeat_interleave(shape[1]), shape[0]
    starts = offsets[:-1] if include_last else offsets
    position = torch.arange(shape[0])
    bag_of = torch.bucketize(position, starts, right=True) - 1
    if include_last and offsets.numel():
        bag_of = torch.where(position < offsets[-1], bag_of, -1)
    return bag_of, starts.numel()
