"""A batch's samples: how many there are, and the batch of samples ``[start, stop)``, whatever its structure.

A batch is a tensor, or tuples, lists, namedtuples and mappings of its parts. Each part holds the
batch's samples in one of three layouts:

- a **tensor**: its first dimension is the samples;
- **bags of ids**, as ``fleet.nn.SparseFeatureCollection``'s dict input spells them: a mapping of
  ``"ids"`` with ``"offsets"`` (where each sample's bag starts, one per sample: ``nn.EmbeddingBag``'s
  ``offsets``) or ``"lengths"`` (ids per sample), and optionally ``"weights"`` (one per id). Samples
  ``[start, stop)`` are those bags: their ids and weights, offsets counted from their first id;
- **jagged features**: an object with ``keys()``, ``values()`` and ``lengths()`` (``fleet.nn.JaggedFeatures``,
  TorchRec's ``KeyedJaggedTensor``): ``lengths()`` holds ``len(keys) x samples`` bags, key after key.
  The slice is built again as ``type(features)(keys=..., values=..., lengths=..., weights=...)``.

Every part must hold the same number of samples; anything else (a value that is not a tensor, a
0-d tensor, parts that disagree) is a problem that :func:`samples` names, never split otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

BAG_KEYS = frozenset({"ids", "offsets", "lengths", "weights"})


def _is_bags(value: Any) -> bool:
    return (
        isinstance(value, Mapping)
        and "ids" in value
        and set(value) <= BAG_KEYS
        and len(set(value) & {"offsets", "lengths"}) == 1
        and all(isinstance(v, torch.Tensor) or v is None for v in value.values())
    )


def _is_jagged(value: Any) -> bool:
    return not isinstance(value, Mapping | torch.Tensor) and all(
        callable(getattr(value, m, None)) for m in ("keys", "values", "lengths")
    )


def _parts(batch: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(path, part) depth-first through tuples, lists and mappings, stopping at tensors, bags and jagged features."""
    if _is_bags(batch) or _is_jagged(batch):
        yield path or "the batch", batch
    elif isinstance(batch, Mapping):
        for key, value in batch.items():
            yield from _parts(value, f"{path}[{key!r}]")
    elif isinstance(batch, tuple | list):
        for i, value in enumerate(batch):
            yield from _parts(value, f"{path}[{i}]")
    else:
        yield path or "the batch", batch


def _bag_starts(bags: Mapping[str, Any]) -> tuple[torch.Tensor | None, str | None]:
    """(each bag's start and the end of the last, [samples + 1]; or None and what is wrong)."""
    ids = bags["ids"]
    if ids.dim() != 1:
        return None, f"its ids are {ids.dim()}-D, not 1-D"
    if "lengths" in bags:
        lengths = bags["lengths"]
        if lengths.dim() != 1 or bool((lengths < 0).any()) or int(lengths.sum()) != ids.numel():
            return None, f"its lengths are not 1-D, >= 0, adding up to its {ids.numel()} ids"
        return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int64), None
    offsets = bags["offsets"]
    if offsets.dim() != 1 or (offsets.numel() and int(offsets[0]) != 0) or bool((offsets.diff() < 0).any()):
        return None, "its offsets are not 1-D, starting at 0, not decreasing (one per sample: where its bag starts)"
    if offsets.numel() and int(offsets[-1]) > ids.numel():
        return None, f"its offsets point past its {ids.numel()} ids"
    return torch.cat([offsets, offsets.new_tensor([ids.numel()])]).to(torch.int64), None


def _count(part: Any) -> tuple[int | None, str]:
    """(the samples in one part, or None; how it looks, for messages)."""
    if isinstance(part, torch.Tensor):
        return (int(part.shape[0]) if part.dim() else None), str(tuple(part.shape))
    if _is_bags(part):
        starts, problem = _bag_starts(part)
        return (None, f"bags: {problem}") if starts is None else (starts.numel() - 1, f"{starts.numel() - 1} bags")
    keys, lengths = list(part.keys()), part.lengths()
    if not keys or lengths.dim() != 1 or lengths.numel() % len(keys):
        return None, f"jagged features: {lengths.numel()} lengths for {len(keys)} keys"
    if bool((lengths < 0).any()) or int(lengths.sum()) != part.values().numel():
        return None, f"jagged features: lengths do not add up to the {part.values().numel()} values"
    return lengths.numel() // len(keys), f"{len(keys)} keys x {lengths.numel() // len(keys)} samples"


def samples(batch: Any) -> tuple[int | None, str | None]:
    """(the samples every part of ``batch`` holds, None; or None and what keeps it from being split)."""
    parts = list(_parts(batch))
    others = [f"{path}: {type(p).__name__}" for path, p in parts if not isinstance(p, torch.Tensor)
              and not _is_bags(p) and not _is_jagged(p)]  # fmt: skip
    if others:
        return None, f"it holds values that are not tensors ({', '.join(others[:4])}), which fleet cannot split"
    if not parts:
        return None, "it holds no tensor"
    counts = {path: _count(p) for path, p in parts}
    firsts = {n for n, _ in counts.values()}
    if len(firsts) != 1 or None in firsts:
        listed = ", ".join(f"{path}: {shape}" for path, (_, shape) in list(counts.items())[:6])
        return None, f"its tensors do not share a first (sample) dimension ({listed})"
    return next(iter(firsts)), None


def _take_bags(bags: Mapping[str, Any], start: int, stop: int) -> Any:
    starts, _ = _bag_starts(bags)
    lo, hi = int(starts[start]), int(starts[stop])
    out = dict(bags)
    out["ids"] = bags["ids"][lo:hi]
    if bags.get("weights") is not None:
        out["weights"] = bags["weights"][lo:hi]
    if "lengths" in bags:
        out["lengths"] = bags["lengths"][start:stop]
    else:
        out["offsets"] = bags["offsets"][start:stop] - lo
    return type(bags)(out) if not isinstance(bags, dict) else out


def _take_jagged(features: Any, start: int, stop: int) -> Any:
    keys = list(features.keys())
    lengths, values = features.lengths(), features.values()
    weights = features.weights_or_none() if callable(getattr(features, "weights_or_none", None)) else None
    per_key = lengths.view(len(keys), -1)
    ends = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).view(-1)
    batch = per_key.shape[1]
    pieces = [(int(ends[k * batch + start]), int(ends[k * batch + stop])) for k in range(len(keys))]
    new_values = torch.cat([values[lo:hi] for lo, hi in pieces])
    new_weights = None if weights is None else torch.cat([weights[lo:hi] for lo, hi in pieces])
    return type(features)(keys=keys, values=new_values, lengths=per_key[:, start:stop].reshape(-1), weights=new_weights)


def take(batch: Any, start: int, stop: int) -> Any:
    """Samples ``[start, stop)`` of a batch whose :func:`samples` are known, in the batch's own structure."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if _is_bags(batch):
        return _take_bags(batch, start, stop)
    if _is_jagged(batch):
        return _take_jagged(batch, start, stop)
    if isinstance(batch, Mapping):
        return type(batch)({key: take(value, start, stop) for key, value in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(take(value, start, stop) for value in batch))
    return type(batch)(take(value, start, stop) for value in batch)


def bounds(n: int, num_shards: int, shard: int) -> tuple[int, int]:
    """Worker ``shard``'s samples of ``n`` as ``torch.tensor_split`` deals them: the first ``n % num_shards``
    workers one more."""
    size, extra = divmod(n, num_shards)
    start = shard * size + min(shard, extra)
    return start, start + size + (shard < extra)


def first_samples(batch: Any) -> int | None:
    """The batch's samples for samples/s: :func:`samples`, else the first dimension of its first tensor."""
    n, _ = samples(batch)
    if n is not None:
        return n
    for _, part in _parts(batch):
        if isinstance(part, torch.Tensor) and part.dim() > 0:
            return int(part.shape[0])
    return None
