"""``nn.Embedding``'s and ``nn.EmbeddingBag``'s signatures on a sparse table: replacing the class name converts it.

Two forms build a table:

- fleet's own, ``SparseEmbedding(16)`` / ``SparseEmbeddingBag(16, mode="sum")``: rows keyed by any
  int64 id, created on first touch. torch-only arguments are refused, each with what to write instead.
- torch's, ``SparseEmbedding(num_embeddings, embedding_dim, ...)`` / ``SparseEmbeddingBag(num_embeddings,
  embedding_dim, mode=..., sparse=..., ...)`` (positional or by keyword): the same table, whose
  ``num_embeddings`` is an **id bound**: a lookup of an id outside ``[0, num_embeddings)`` raises
  ``IndexError`` naming the id and the bound (torch's ``nn.Embedding`` raises ``IndexError``,
  ``nn.EmbeddingBag`` a ``RuntimeError``). torch's arguments keep
  their meaning where a sparse table has one:

  ``sparse``       True or False: the rows always get one gradient per looked-up id, and their
                   optimizer updates only the rows a step looks up (``sparse=True``'s behaviour with
                   torch's sparse optimizers). With ``sparse=False`` (torch's default) an optimizer with
                   momentum, Adam's moments or weight decay also moves the rows a step does not look up;
                   a table does not, so the form without ``sparse=True`` warns once, saying so.
  ``_weight``      the initial rows of ids ``0 .. num_embeddings-1`` (``[num_embeddings, embedding_dim]``),
                   as torch's ``from_pretrained`` passes them; without it rows start from the table's
                   initializer, not from torch's ``N(0, 1)`` draw (fleet cannot be seeded to torch's init).
  ``padding_idx``  (bags) torch's index, negative counted from ``num_embeddings``; its entries count for
                   nothing. ``SparseEmbedding`` has none: refused.
  ``max_norm`` (None), ``norm_type`` (2.0), ``scale_grad_by_freq`` (False), ``_freeze`` (False),
  ``device`` (None or CPU), ``dtype`` (None or float32): their defaults only; another value is refused.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

# nn.Embedding / nn.EmbeddingBag arguments that fleet's own form has no use for, and what to do instead.
TORCH_ONLY = {
    "sparse": "the rows' gradients are always sparse (one per looked-up id): drop it, or give the vocabulary size "
    "first for nn.Embedding's signature",
    "max_norm": "not supported on sparse tables",
    "norm_type": "not supported on sparse tables",
    "scale_grad_by_freq": "not supported on sparse tables",
    "_weight": "the rows come from the initializer (or load_rows / from_pretrained)",
    "_freeze": "not supported on sparse tables",
    "device": "the rows live on the CPU (or the servers)",
    "dtype": "the rows are float32",
}
BAG_ONLY = {
    "mode": "pooling ids into bags (sum, mean, max) is fleet.nn.SparseEmbeddingBag's",
    "include_last_offset": "bags of ids are fleet.nn.SparseEmbeddingBag's",
    "padding_idx": "fleet.nn.SparseEmbeddingBag has one (an id that contributes nothing); here, mask the rows",
}
# torch's defaults of the arguments a sparse table accepts only at their default.
_DEFAULT_ONLY = {"max_norm": None, "norm_type": 2.0, "scale_grad_by_freq": False, "_freeze": False}


def refuse_unknown(owner: str, unknown: dict[str, Any]) -> None:
    """Raise a TypeError naming ``unknown`` keyword arguments of ``owner`` and what to write instead."""
    if not unknown:
        return
    hints = []
    for name in unknown:
        hint = TORCH_ONLY.get(name) or BAG_ONLY.get(name)
        hints.append(f"{name!r} ({hint})" if hint else repr(name))
    raise TypeError(f"{owner} got unexpected keyword arguments: {'; '.join(hints)}")


def _size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Sizes:
    """What the positional arguments said: the id bound (None: any id), the dimension, and a second argument
    that is not a size (fleet's form: SparseEmbedding's initializer, SparseEmbeddingBag's mode) or None."""

    num_embeddings: int | None
    embedding_dim: int
    second: Any


def sizes(owner: str, args: tuple, num_embeddings: Any, embedding_dim: Any, second: str) -> Sizes:
    """Read ``owner(*args, num_embeddings=..., embedding_dim=...)``: ``(dim)``, ``(dim, <second>)``, or torch's
    ``(num_embeddings, embedding_dim)``, positionally or by keyword."""
    if len(args) > 2:
        raise TypeError(
            f"{owner} takes at most 2 positional arguments ((num_embeddings, embedding_dim) as torch, or "
            f"(embedding_dim, {second})), got {len(args)}: pass the others by keyword"
        )
    args = list(args)
    if len(args) == 2 and _size(args[1]):  # (num_embeddings, embedding_dim)
        if num_embeddings is not None or embedding_dim is not None:
            raise TypeError(f"{owner} got num_embeddings and embedding_dim both positionally and by keyword")
        num_embeddings, embedding_dim = args
        args = []
    elif len(args) == 1 and embedding_dim is not None:  # (num_embeddings, embedding_dim=...)
        if num_embeddings is not None:
            raise TypeError(f"{owner} got num_embeddings twice")
        num_embeddings = args.pop(0)
    elif args:
        if embedding_dim is not None:
            raise TypeError(f"{owner} got embedding_dim twice")
        embedding_dim = args.pop(0)
    if embedding_dim is None:
        raise TypeError(f"{owner} needs embedding_dim (the width of a row)")
    if not _size(embedding_dim) or embedding_dim <= 0:
        raise ValueError(f"embedding_dim must be an int > 0, got {embedding_dim!r}")
    if num_embeddings is not None and (not _size(num_embeddings) or num_embeddings <= 0):
        raise ValueError(f"{owner}: num_embeddings (the id bound) must be an int > 0, got {num_embeddings!r}")
    return Sizes(num_embeddings, embedding_dim, args[0] if args else None)


@dataclass(frozen=True)
class TorchArguments:
    """torch's arguments that mean something on a sparse table: the initial rows (``_weight``)."""

    weight: torch.Tensor | None = None


def torch_arguments(owner: str, num_embeddings: int | None, dim: int, given: dict[str, Any]) -> TorchArguments:
    """Take torch's keyword arguments out of ``given`` (the rest are refused): all refused in fleet's own form
    (``num_embeddings`` None), accepted with torch's meaning (module docstring) in torch's."""
    if num_embeddings is None:
        refuse_unknown(owner, given)
        return TorchArguments()
    torch_only = {k: given.pop(k) for k in list(given) if k in TORCH_ONLY}
    refuse_unknown(owner, given)
    for name, default in _DEFAULT_ONLY.items():
        if name in torch_only and torch_only[name] != default:
            raise TypeError(
                f"{owner}: {name}={torch_only[name]!r} is not supported on sparse tables (only {default!r})"
            )
    device = torch_only.get("device")
    if device is not None and torch.device(device).type != "cpu":
        raise TypeError(f"{owner}: device={device!r}: the rows live on the CPU (or the servers); drop it")
    if torch_only.get("dtype") not in (None, torch.float32):
        raise TypeError(f"{owner}: dtype={torch_only['dtype']}: the rows are float32; drop it")
    if torch_only.get("sparse") is not True:
        warnings.warn(
            f"{owner}(num_embeddings, embedding_dim) without sparse=True stands for torch's dense weight, whose "
            "optimizer (with momentum, Adam's moments or weight decay) also moves rows a step does not look up; a "
            "sparse table's optimizer updates only the rows a step looks up, as torch's sparse=True with a sparse "
            "optimizer. Pass sparse=True to say that is what you want (it silences this).",
            stacklevel=3,
        )
    weight = torch_only.get("_weight")
    if weight is not None:
        if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (num_embeddings, dim):
            shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise ValueError(f"{owner}: _weight must be a tensor [{num_embeddings}, {dim}], got {shape}")
        weight = weight.detach()
    return TorchArguments(weight=weight)


def torch_padding(owner: str, num_embeddings: int, padding_idx: int | None) -> int | None:
    """torch's ``padding_idx`` (an index, negative counted from the end) as the padding id."""
    if padding_idx is None:
        return None
    if not -num_embeddings <= padding_idx < num_embeddings:
        raise ValueError(f"{owner}: padding_idx must be within num_embeddings ({num_embeddings}), got {padding_idx}")
    return padding_idx + num_embeddings if padding_idx < 0 else padding_idx


def check_bound(owner: str, ids: torch.Tensor, num_embeddings: int | None) -> None:
    """Raise ``IndexError`` for an id outside ``[0, num_embeddings)`` (no bound: any id)."""
    if num_embeddings is None or ids.numel() == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= num_embeddings:
        bad = low if low < 0 else high
        raise IndexError(
            f"{owner}(num_embeddings={num_embeddings}): id {bad} is out of range [0, {num_embeddings}) (as in "
            "torch's table); leave num_embeddings out for a table of any int64 id"
        )
