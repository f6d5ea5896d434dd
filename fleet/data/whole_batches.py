"""DataLoaders whose items are already whole batches: detect them, split each across the workers, count samples.

Some loaders hand out one training step's batch per item: ``batch_size=None`` (the dataset
yields batches), or ``batch_size=1`` with a ``collate_fn`` that builds a mini-batch (DLRM's
loader). Dealing such items out to the workers, as one deals samples, would make every step's
global batch W times larger than the unconverted script's. Instead every worker reads every
item, in the same order, and keeps its 1/W slice of each one's samples: each step's global
batch is the item, so the job does one process's steps on the same batches (mean losses
averaged over equal shares are the batch's mean loss).

Splitting needs to know which dimension holds the samples: it is the first dimension, which
every tensor of the item must share, divisible by the worker count. An item that is not like
that is refused, naming what is wrong and how to change the loader, never split differently.

The number of samples in a batch (for samples/s) is the first dimension of its first tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, default_collate

_END = object()


def may_hold_batches(loader: DataLoader) -> bool:
    """Whether the loader's items may be whole batches: ``batch_size=None``, or 1 with a custom ``collate_fn``."""
    if loader.batch_size is None:
        return loader.batch_sampler is None  # a batch_sampler batches samples itself (batch_size is None then too)
    return loader.batch_size == 1 and loader.collate_fn is not default_collate


def _leaves(batch: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(path, leaf) depth-first through tuples, lists and mappings."""
    if isinstance(batch, Mapping):
        for key, value in batch.items():
            yield from _leaves(value, f"{path}[{key!r}]")
    elif isinstance(batch, tuple | list):
        for i, value in enumerate(batch):
            yield from _leaves(value, f"{path}[{i}]")
    else:
        yield path or "the batch", batch


def samples_in(batch: Any) -> int | None:
    """The first dimension of the batch's first tensor (None without a tensor of at least one dimension)."""
    for _, leaf in _leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return None


def _rebuild(batch: Any, take: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(batch, Mapping):
        return type(batch)({key: _rebuild(value, take) for key, value in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(_rebuild(value, take) for value in batch))
    if isinstance(batch, tuple | list):
        return type(batch)(_rebuild(value, take) for value in batch)
    return take(batch)


class WholeBatchError(ValueError):
    """A loader of whole batches whose items fleet cannot split across the workers as one process would."""


def split(batch: Any, num_shards: int, shard: int, why: str) -> Any:
    """Worker ``shard``'s equal slice of every tensor of ``batch`` along the first (sample) dimension."""
    leaves = list(_leaves(batch))
    problem = None
    others = [f"{path}: {type(leaf).__name__}" for path, leaf in leaves if not isinstance(leaf, torch.Tensor)]
    shapes = {path: tuple(leaf.shape) for path, leaf in leaves if isinstance(leaf, torch.Tensor)}
    firsts = {shape[0] if shape else None for shape in shapes.values()}
    if others:
        problem = f"it holds values that are not tensors ({', '.join(others[:4])}), which fleet cannot split"
    elif not shapes:
        problem = "it holds no tensor"
    elif len(firsts) != 1 or None in firsts:
        listed = ", ".join(f"{path}: {shape}" for path, shape in list(shapes.items())[:6])
        problem = f"its tensors do not share a first (sample) dimension ({listed})"
    else:
        n = next(iter(firsts))
        if n % num_shards:
            problem = (
                f"a batch holds {n} samples, not a multiple of the {num_shards} workers (equal shares keep the "
                "step's mean loss that of one process on the batch)"
            )
    if problem is not None:
        raise WholeBatchError(
            f"fleet.distributed_loader: this DataLoader's items are whole batches ({why}), so every worker reads "
            f"each one and keeps its 1/{num_shards} of the samples, keeping the global batch of one process; but "
            f"{problem}. Either make every item's tensors share their first dimension, the samples, in a multiple "
            f"of {num_shards} (e.g. lengths instead of offsets for bags, and a batch size divisible by the worker "
            f"count, the last batch included, or drop it); or let the DataLoader batch single samples "
            f"(batch_size = the global batch / {num_shards}, the default collate_fn) so fleet deals out samples; or "
            "slice each batch yourself by fleet.worker_index() and iterate the loader without "
            "fleet.distributed_loader."
        )
    size = next(iter(firsts)) // num_shards
    return _rebuild(batch, lambda t: t[shard * size : (shard + 1) * size])


def share(
    items: Iterator[Any],
    num_shards: int,
    shard: int,
    always: bool,
    deal: Callable[[Iterator[Any]], Iterator[Any]],
    decided: Callable[[bool], None],
) -> Iterator[Any]:
    """This worker's part of a stream every worker reads in full.

    Whole batches (``always``: ``batch_size=None``; else a first item of more than one sample)
    are split; items of one sample each are dealt out by ``deal``, as samples are.
    ``decided(whole)`` is told which, at the first item.
    """
    first = next(items, _END)
    if first is _END:
        return
    n = samples_in(first)
    whole = always or (n is not None and n > 1)
    decided(whole)
    if not whole:
        yield from deal(_chain(first, items))
        return
    why = "batch_size=None" if always else f"batch_size=1 with a collate_fn that returns {n} samples"
    for item in _chain(first, items):
        yield split(item, num_shards, shard, why)


def _chain(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from rest
