"""distributed_loader: each worker iterates its own shard of the user's DataLoader.

Epochs follow the wrapped DataLoader: every new pass over the loader is a new epoch with a
new order, whether or not the script calls ``set_epoch`` (which still works, and wins). One
process keeps exactly the batches and order the unconverted script had, drawing from the same
random generators; several workers share a permutation of ``strategy.seed + epoch`` (as
DistributedSampler), which every worker computes alike without communicating.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, Sampler, SequentialSampler

from fleet.data import whole_batches
from fleet.telemetry import timing

_END = object()


class ShardedLoader:
    """A DataLoader over this worker's shard, with epochs, resumable positions and ``set_epoch``."""

    def __init__(
        self, loader: DataLoader, num_shards: int, shard: int, seed: int = 0, split_batches: bool | None = None
    ):
        if split_batches not in (None, True, False):
            raise TypeError(
                f"fleet.distributed_loader: split_batches must be True, False or None, got {split_batches!r}"
            )
        self.position = 0  # batches taken from the current epoch, for checkpoints
        self.num_shards = num_shards
        self.shard = shard
        self.epoch = 0
        self._skip = 0
        self._begun = False  # has a pass over the current epoch started (the next pass is a new epoch)
        self._epoch_given = False  # set_epoch() named the epoch of the next pass
        self._finished = False  # the last pass ran to the end of its epoch
        self._epoch_rng: dict[str, Any] | None = None  # generators' states when this epoch's pass began
        self._resume_rng: dict[str, Any] | None = None
        self._generator = loader.generator
        # split_batches: True, every item is a step's global batch, split (fleet.data.whole_batches); False, items
        # are dealt out whole; None, items that may be whole batches are split in equal shares.
        self._split_batches = split_batches
        # Items that may be whole batches (fleet.data.whole_batches): samples/s counts each batch's samples.
        self._count_samples = split_batches is True or whole_batches.may_hold_batches(loader)
        self._always_whole = split_batches is True or (
            split_batches is None and self._count_samples and loader.batch_size is None
        )
        self._whole: bool | None = True if self._always_whole else None  # None: decided at the first item
        if split_batches is False:
            self._whole = False
        self._share = (1, 1)  # the last split batch's samples, and this worker's of them
        self._weight_read = True  # share_weight was read since the last uneven batch
        self._uneven_warned = False
        self.map_style = not isinstance(loader.dataset, IterableDataset)
        self.sampler: _ResumableSampler | None = None
        self._own_order: _SkippingSampler | None = None
        shards_itself = not self.map_style and getattr(loader.dataset, "shards_itself", False)
        if shards_itself:
            if split_batches:
                raise ValueError(
                    "fleet.distributed_loader: this dataset (fleet.SlotDataset) reads only this worker's files "
                    "already; split_batches=True would split its batches again: drop it"
                )
            self.num_shards, self.shard = 1, 0  # fleet.SlotDataset: already this worker's share
        # One process checks whole batches as a job would split them (not a dataset that shards itself).
        self._check_whole = num_shards == 1 and not shards_itself and self._count_samples and split_batches is not False
        # Every worker reads every item of a loader of whole batches, in one order, and splits each.
        self._split = self.num_shards > 1 and (split_batches is True or (split_batches is None and self._count_samples))
        if not self.map_style:
            self.loader = loader
            return
        if not isinstance(loader.sampler, RandomSampler | SequentialSampler):
            raise TypeError(
                f"fleet.distributed_loader can shard a DataLoader built with shuffle=True or False, but this one uses "
                f"a custom {type(loader.sampler).__name__}. Build the loader with "
                "sampler=DistributedSampler(dataset, fleet.worker_num(), fleet.worker_index()) yourself instead."
            )
        if loader.batch_sampler is not None and type(loader.batch_sampler).__name__ != "BatchSampler":
            raise TypeError(
                f"fleet.distributed_loader cannot shard a custom batch_sampler ({type(loader.batch_sampler).__name__})."
            )
        self.sampler = _ResumableSampler(
            loader.dataset,
            num_replicas=1 if self._split else num_shards,
            rank=0 if self._split else shard,
            shuffle=isinstance(loader.sampler, RandomSampler),
            seed=seed,
            drop_last=loader.drop_last,
        )
        self.loader = _rebuild(loader, self.sampler)
        if num_shards == 1:
            # One process keeps the unconverted script's order: the user's own sampler, drawing
            # from the same generators at the same moments, until set_epoch asks for seeded epochs.
            self._own_order = _SkippingSampler(loader.sampler)
            self._own_loader = _rebuild(loader, self._own_order)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._skip = 0  # a resumed position belongs to the epoch it was saved in
            self._resume_rng = None
        self.epoch = epoch
        self._epoch_given = True
        self._own_order = None  # from now on the order is DistributedSampler's, seeded by epoch
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Where this worker is: the epoch, the batches already taken from it, and whether it ended."""
        state: dict[str, Any] = {"epoch": self.epoch, "position": self.position, "finished": self._finished}
        if self._epoch_rng is not None and not self._finished:
            state["epoch_rng"] = self._epoch_rng
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next pass continues an unfinished epoch after the batches already trained on;
        a finished epoch resumes at the start of the next one."""
        epoch, position = int(state["epoch"]), int(state["position"])
        finished = bool(state.get("finished", False))
        if not finished and position > 0 and self._length() is not None:
            finished = position >= self._length()  # saved inside the loop body, after the last batch
        if finished:
            epoch, position = epoch + 1, 0
        self._set_epoch_number(epoch)
        self._skip = self.position = position
        self._resume_rng = state.get("epoch_rng") if position else None
        self._begun = False
        self._finished = False
        self._epoch_given = False

    def _set_epoch_number(self, epoch: int) -> None:
        self.epoch = epoch
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        if self._begun and not self._epoch_given:
            self._set_epoch_number(self.epoch + 1)  # a new pass is a new epoch, as with DataLoader(shuffle=True)
            self._skip, self._resume_rng = 0, None
        self._begun, self._epoch_given, self._finished = True, False, False
        skip, self._skip = self._skip, 0
        resume_rng, self._resume_rng = self._resume_rng, None
        self.position = skip
        return self._batches(skip, resume_rng)

    def _batches(self, skip: int, resume_rng: dict[str, Any] | None) -> Iterator[Any]:
        loader = self._own_loader if self._own_order is not None else self.loader
        order = self._own_order if self._own_order is not None else self.sampler
        now = torch.get_rng_state()  # the checkpoint's, when resuming
        if resume_rng is not None:
            # Rewind the generators to where they were when the interrupted epoch began, so this
            # pass draws the same order (and worker seeds) it drew then. Afterwards the global one
            # goes back to the checkpoint's state, which the interrupted run had at that point; the
            # loader's own generator (not in the checkpoint) is right where those draws left it.
            _set_generator_states(resume_rng, self._generator)
        self._epoch_rng = _generator_states(self._generator)
        if order is not None and not self._split:
            order.skip_next(skip * (loader.batch_size or 1))
            batches: Iterator[Any] = iter(loader)
        else:
            workers, drop_last = self.num_shards, loader.drop_last
            if self._split:
                mine = whole_batches.share(
                    iter(loader), workers, self.shard, self._always_whole,
                    lambda items: _even_share(items, workers, self.shard, drop_last), self._decided,
                    self._seen, uneven=self._split_batches is True,
                )  # fmt: skip
            else:
                mine = _even_share(iter(loader), workers, self.shard, drop_last)
            batches = (batch for i, batch in enumerate(mine) if i >= skip)
            if self._split:
                batches = self._uneven_warning(batches)  # after the skipped batches: the ones the script sees
        if self._check_whole:
            batches = _checked(batches, self._split_batches is True, self._always_whole)
        if self._count_samples:
            batches = _counting_samples(batches)
        first = next(batches, _END)  # the samplers draw their seeds lazily, at the first batch
        if resume_rng is not None or (skip and order is not None):
            # (Checkpoints from before epoch_rng: at least leave the checkpoint's state untouched.)
            torch.set_rng_state(now)
        if first is _END:
            self._finished = True
            return
        self.position += 1
        yield first
        for batch in batches:
            self.position += 1
            yield batch
        self._finished = True

    def _decided(self, whole: bool) -> None:
        self._whole = whole

    def _seen(self, total: int, mine: int) -> None:
        self._share = (total, mine)
        self._weight_read = total % self.num_shards == 0  # an uneven batch: was share_weight read for it?

    @property
    def share_weight(self) -> float:
        """This worker's share of the last batch, times the workers: ``W * mine / batch`` (1.0 in one process and
        whenever the batch splits evenly). With ``split_batches=True``, ``loss_fn(out, y) * loader.share_weight``
        (a mean loss) makes the workers' averaged gradient the batch's mean gradient, as one process's, also on
        a batch that does not split evenly (docs/data.md)."""
        self._weight_read = True
        total, mine = self._share
        return self.num_shards * mine / total if self._split else 1.0

    def _uneven_warning(self, batches: Iterator[Any]) -> Iterator[Any]:
        """Warn once, after an uneven batch's step, when the script did not read ``share_weight`` for it."""
        for batch in batches:
            yield batch
            if not self._weight_read and not self._uneven_warned:
                self._uneven_warned = True
                total, mine = self._share
                warnings.warn(
                    f"fleet.distributed_loader(split_batches=True): a batch of {total} samples was split unevenly "
                    f"over {self.num_shards} workers (this one took {mine}); the average of the workers' mean "
                    "losses then weighs each worker's samples by its share, not as one process's mean over the "
                    "batch. Multiply the loss by loader.share_weight (1.0 for even shares) to train as one "
                    "process does, or make the batch a multiple of the workers (drop_last=True for a short last "
                    "batch).",
                    stacklevel=2,
                )

    def _length(self) -> int | None:
        try:
            return len(self)
        except TypeError:
            return None

    def __len__(self) -> int:
        if self.map_style and not self._split:
            return len(self.loader)
        total = len(self.loader)  # every item, when they are whole batches each worker splits
        if self._split and self._whole is not False:
            return total  # raises TypeError for an iterable dataset without __len__, as DataLoader does
        return total // self.num_shards if self.loader.drop_last else -(-total // self.num_shards)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["loader"], name)


def _rebuild(loader: DataLoader, sampler: Sampler) -> DataLoader:
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        generator=loader.generator,
        persistent_workers=loader.persistent_workers if loader.num_workers > 0 else False,
    )


def _generator_states(generator: torch.Generator | None) -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if generator is not None:
        state["loader"] = generator.get_state()
    return state


def _set_generator_states(state: dict[str, Any], generator: torch.Generator | None) -> None:
    torch.set_rng_state(state["torch"])
    if generator is not None and "loader" in state:
        generator.set_state(state["loader"])


def _even_share(batches: Iterator[Any], num_shards: int, shard: int, drop_last: bool) -> Iterator[Any]:
    """This shard's batches of a stream every worker reads in full: the same number on every worker.

    The stream is taken in rounds of ``num_shards`` consecutive batches, one per worker. When
    it ends part-way through a round, that last round is dropped (``drop_last=True``, like
    DistributedSampler's) or completed with the first batches of the epoch again, so that
    every worker still gets exactly one more (``drop_last=False``, DistributedSampler's
    padding): no worker is left waiting in a collective for a batch that never comes.
    """
    first: list[Any] = []  # the epoch's first batches, kept to complete a last partial round
    round_: list[Any] = []
    for batch in batches:
        if len(first) < num_shards - 1:
            first.append(batch)
        round_.append(batch)
        if len(round_) == num_shards:
            yield round_[shard]
            round_ = []
    if round_ and not drop_last:
        round_ += (first * num_shards)[: num_shards - len(round_)]
        yield round_[shard]


def _checked(batches: Iterator[Any], split_batches: bool, always: bool) -> Iterator[Any]:
    """One process's whole batches, unchanged, checked for what a job would split: with ``split_batches=True``
    every batch (a WholeBatchError, as a job raises it); else a first item found to be a whole batch that a job
    could not split gets a warning, so that the user meets it before going distributed."""
    first = True
    for batch in batches:
        if split_batches:
            whole_batches.check(batch, whole_batches.describe(True, None, True))
        elif first:
            n = whole_batches.samples_in(batch)
            if always or (n is not None and n > 1):
                try:
                    whole_batches.check(batch, whole_batches.describe(always, n, False))
                except whole_batches.WholeBatchError as err:
                    warnings.warn(f"{err} (In one process the batches pass unchanged; fleetrun refuses them.)",
                                  stacklevel=2)  # fmt: skip
        first = False
        yield batch


def _counting_samples(batches: Iterator[Any]) -> Iterator[Any]:
    """Tell the step timing each batch's samples (its first tensor's first dimension), not one per item."""
    recorder = timing.recorder()
    for batch in batches:
        n = whole_batches.samples_in(batch)
        if n:
            recorder.set_batch_size(n, inferred=True)
        yield batch


def _skipping(indices: Iterator[Any], skip: int) -> Iterator[Any]:
    for i, index in enumerate(indices):
        if i >= skip:
            yield index


class _ResumableSampler(DistributedSampler):
    """DistributedSampler that can start an epoch part-way, after ``skip`` indices."""

    _skip = 0

    def skip_next(self, indices: int) -> None:
        """The next epoch starts after ``indices`` indices (a resumed position)."""
        self._skip = indices

    def __iter__(self) -> Iterator[Any]:
        skip, self._skip = self._skip, 0
        return _skipping(super().__iter__(), skip)


class _SkippingSampler(Sampler):
    """The user's own sampler, able to start an epoch part-way, after ``skip`` indices."""

    _skip = 0

    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def skip_next(self, indices: int) -> None:
        """The next epoch starts after ``indices`` indices (a resumed position)."""
        self._skip = indices

    def __iter__(self) -> Iterator[Any]:
        skip, self._skip = self._skip, 0
        return _skipping(iter(self.sampler), skip)

    def __len__(self) -> int:
        return len(self.sampler)


def shard_loader(loader: Any, num_shards: int, shard: int, seed: int = 0, split_batches: bool | None = None) -> Any:
    if not isinstance(loader, DataLoader):
        raise TypeError(f"fleet.distributed_loader needs a torch.utils.data.DataLoader, got {type(loader).__name__}.")
    return ShardedLoader(loader, num_shards, shard, seed, split_batches)


__all__ = ["ShardedLoader", "shard_loader"]
