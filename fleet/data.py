"""distributed_loader: each worker iterates its own shard of the user's DataLoader."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from fleet import timing


class ShardedLoader:
    """A DataLoader over this worker's shard; ``set_epoch(e)`` reshuffles like DistributedSampler."""

    def __init__(self, loader: DataLoader, num_shards: int, shard: int, seed: int = 0):
        self.position = 0  # batches taken from the current epoch, for checkpoints
        self._skip = 0
        self.num_shards = num_shards
        self.shard = shard
        self.epoch = 0
        if isinstance(loader.batch_size, int) and loader.batch_size > 0:
            timing.recorder().set_batch_size(loader.batch_size, inferred=True)  # for samples/s
        if isinstance(loader.dataset, IterableDataset):
            self.sampler = None
            self.loader = loader
            if getattr(loader.dataset, "shards_itself", False):  # fleet.SlotDataset: already this worker's share
                self.num_shards, self.shard = 1, 0
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
            num_replicas=num_shards,
            rank=shard,
            shuffle=isinstance(loader.sampler, RandomSampler),
            seed=seed,
            drop_last=loader.drop_last,
        )
        self.loader = DataLoader(
            loader.dataset,
            batch_size=loader.batch_size,
            sampler=self.sampler,
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory,
            drop_last=loader.drop_last,
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            generator=loader.generator,
            persistent_workers=loader.persistent_workers if loader.num_workers > 0 else False,
        )

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._skip = 0  # a resumed position belongs to the epoch it was saved in
        self.epoch = epoch
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, int]:
        """Where this worker is: the epoch and the batches already taken from it."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume: the next iteration of epoch ``state["epoch"]`` skips the batches already trained on."""
        self.set_epoch(int(state["epoch"]))
        self._skip = self.position = int(state["position"])

    def __iter__(self) -> Iterator[Any]:
        skip, self._skip = self._skip, 0
        self.position = skip
        if self.sampler is not None:
            self.sampler.skip = skip * (self.loader.batch_size or 1)
            if skip:
                # Creating a DataLoader iterator draws a base seed from the global RNG. The run
                # being resumed drew it at the start of this epoch, before the checkpoint's RNG
                # state was taken: drawing again here would shift every later random number.
                rng = torch.get_rng_state()
                batches: Iterator[Any] = iter(self.loader)
                torch.set_rng_state(rng)
            else:
                batches = iter(self.loader)
        else:
            mine = _even_share(iter(self.loader), self.num_shards, self.shard, self.loader.drop_last)
            batches = (batch for i, batch in enumerate(mine) if i >= skip)
        for batch in batches:
            self.position += 1
            yield batch

    def __len__(self) -> int:
        if self.sampler is not None:
            return len(self.loader)
        total = len(self.loader)  # raises TypeError for an iterable dataset without __len__, as DataLoader does
        return total // self.num_shards if self.loader.drop_last else -(-total // self.num_shards)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["loader"], name)


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


class _ResumableSampler(DistributedSampler):
    """DistributedSampler that can start an epoch part-way, after ``skip`` indices."""

    skip = 0

    def __iter__(self) -> Iterator[Any]:
        indices = super().__iter__()
        skip, self.skip = self.skip, 0
        for i, index in enumerate(indices):
            if i >= skip:
                yield index


def shard_loader(loader: Any, num_shards: int, shard: int, seed: int = 0) -> Any:
    if not isinstance(loader, DataLoader):
        raise TypeError(f"fleet.distributed_loader needs a torch.utils.data.DataLoader, got {type(loader).__name__}.")
    return ShardedLoader(loader, num_shards, shard, seed)


__all__ = ["ShardedLoader", "shard_loader"]
