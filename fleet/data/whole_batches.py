"""DataLoaders whose items are already whole batches: detect them, split each across the workers, count samples.

Some loaders hand out one training step's batch per item: ``batch_size=None`` (the dataset
yields batches), or ``batch_size=1`` with a ``collate_fn`` that builds a mini-batch (DLRM's
loader). Dealing such items out to the workers, as one deals samples, would make every step's
global batch W times larger than the unconverted script's. Instead every worker reads every
item, in the same order, and keeps its 1/W slice of each one's samples: each step's global
batch is the item, so the job does one process's steps on the same batches (mean losses
averaged over equal shares are the batch's mean loss).

Splitting needs to know where the samples are (:mod:`fleet.data.batch_split`): the first dimension
of a tensor, the bags of a ``{"ids", "offsets" | "lengths"}`` dict, the bags of jagged features;
every part of the item must hold the same number, a multiple of the worker count unless
``split_batches=True`` asked for ``torch.tensor_split``'s uneven shares. An item that is not like
that is refused, naming what is wrong and how to change the loader, never split differently.

The number of samples in a batch (for samples/s) is that number (else the first dimension of its
first tensor).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader, default_collate

from fleet.data import batch_split

_END = object()


def may_hold_batches(loader: DataLoader) -> bool:
    """Whether the loader's items may be whole batches: ``batch_size=None``, or 1 with a custom ``collate_fn``."""
    if loader.batch_size is None:
        return loader.batch_sampler is None  # a batch_sampler batches samples itself (batch_size is None then too)
    return loader.batch_size == 1 and loader.collate_fn is not default_collate


def samples_in(batch: Any) -> int | None:
    """The batch's samples (:mod:`fleet.data.batch_split`; else its first tensor's first dimension; None without one)."""
    return batch_split.first_samples(batch)


class WholeBatchError(ValueError):
    """A loader of whole batches whose items fleet cannot split across the workers as one process would."""


def _refuse(why: str, num_shards: int | str, problem: str) -> WholeBatchError:
    return WholeBatchError(
        f"fleet.distributed_loader: this DataLoader's items are whole batches ({why}), so every worker reads "
        f"each one and keeps its 1/{num_shards} of the samples, keeping the global batch of one process; but "
        f"{problem}. Either make every item's parts hold the samples: tensors on their first dimension, bags of "
        "ids as {'ids': ..., 'offsets': ...} (nn.EmbeddingBag's offsets, one per sample) or {'ids': ..., "
        "'lengths': ...}, or a fleet.nn.JaggedFeatures, which fleet splits by sample (docs/data.md); or let the "
        f"DataLoader batch single samples (batch_size = the global batch / {num_shards}, the default collate_fn) "
        "so fleet deals out samples; or slice each batch yourself by fleet.worker_index() and iterate the loader "
        "without fleet.distributed_loader."
    )


def check(batch: Any, why: str) -> int:
    """The samples of ``batch``, a whole batch; :class:`WholeBatchError` if it cannot be split (one process checks
    with ``split_batches=True`` what a job splits, so the refusal comes before going distributed)."""
    n, problem = batch_split.samples(batch)
    if problem is not None:
        raise _refuse(why, "W", problem)
    return n


def split(batch: Any, num_shards: int, shard: int, why: str, uneven: bool = False) -> tuple[Any, int, int]:
    """(worker ``shard``'s samples of ``batch``, the batch's samples, this worker's): equal shares, or with
    ``uneven`` (``split_batches=True``) ``torch.tensor_split``'s (the first ``n % num_shards`` workers one more)."""
    n, problem = batch_split.samples(batch)
    if problem is None and n % num_shards and not uneven:
        problem = (
            f"a batch holds {n} samples, not a multiple of the {num_shards} workers (equal shares keep the "
            "step's mean loss that of one process on the batch; fleet.distributed_loader(loader, "
            "split_batches=True) splits it unevenly, a loss weighted by loader.share_weight keeping it)"
        )
    if problem is None and n < num_shards:
        problem = (
            f"a batch holds {n} samples, fewer than the {num_shards} workers (a worker would get none: "
            "drop_last=True drops a short last batch)"
        )
    if problem is not None:
        raise _refuse(why, num_shards, problem)
    start, stop = batch_split.bounds(n, num_shards, shard)
    return batch_split.take(batch, start, stop), n, stop - start


def share(
    items: Iterator[Any],
    num_shards: int,
    shard: int,
    always: bool,
    deal: Callable[[Iterator[Any]], Iterator[Any]],
    decided: Callable[[bool], None],
    seen: Callable[[int, int], None] = lambda total, mine: None,
    uneven: bool = False,
) -> Iterator[Any]:
    """This worker's part of a stream every worker reads in full.

    Whole batches (``always``: ``batch_size=None`` or ``split_batches=True``; else a first item of
    more than one sample) are split, unevenly with ``uneven``; items of one sample each are dealt
    out by ``deal``, as samples are. ``decided(whole)`` is told which, at the first item;
    ``seen(batch's samples, this worker's)`` before each split batch is yielded.
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
    why = describe(always, n, uneven)
    for item in _chain(first, items):
        piece, total, mine = split(item, num_shards, shard, why, uneven)
        seen(total, mine)
        yield piece


def describe(always: bool, n: int | None, split_batches: bool) -> str:
    """Why a loader's items are taken as whole batches, for messages."""
    if split_batches:
        return "fleet.distributed_loader(loader, split_batches=True)"
    return "batch_size=None" if always else f"batch_size=1 with a collate_fn that returns {n} samples"


def _chain(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from rest
