"""distributed_loader epochs: reshuffled like the wrapped DataLoader, one process keeps the unconverted
script's order, and checkpoints resume inside an unfinished epoch or at the start of the next."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from fleet.data.loader import shard_loader

DATA = TensorDataset(torch.arange(23))


def _loader(**kwargs) -> DataLoader:
    return DataLoader(DATA, batch_size=4, **kwargs)


def _epochs(loader, epochs: int) -> list[list[list[int]]]:
    return [[batch[0].tolist() for batch in loader] for _ in range(epochs)]


@pytest.mark.parametrize("kwargs", [{"shuffle": True}, {"shuffle": False}, {"shuffle": True, "drop_last": True}])
@pytest.mark.parametrize("own_generator", [False, True])
def test_one_process_keeps_the_unconverted_scripts_batches_and_random_stream(kwargs, own_generator):
    def run(convert: bool):
        torch.manual_seed(7)
        generator = torch.Generator().manual_seed(3) if own_generator else None
        loader = _loader(generator=generator, **kwargs)
        if convert:
            loader = shard_loader(loader, 1, 0)
        batches = _epochs(loader, 3)
        return batches, torch.rand(3).tolist()  # later random numbers (dropout, ...) are the same too

    plain, converted = run(False), run(True)
    assert converted == plain
    if kwargs["shuffle"]:
        assert plain[0][0] != plain[0][1]  # the plain loader does reshuffle: the comparison means something


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_every_pass_is_a_new_epoch_and_set_epoch_wins(workers):
    shards = [shard_loader(_loader(shuffle=True), workers, rank) for rank in range(workers)]
    passes = [_epochs(shard, 3) for shard in shards]
    for epoch in range(3):
        union = sorted(i for rank in range(workers) for batch in passes[rank][epoch] for i in batch)
        assert union[: len(DATA)] == list(range(len(DATA))) or sorted(set(union)) == list(range(len(DATA)))
        assert len({len(passes[rank][epoch]) for rank in range(workers)}) == 1
    assert passes[0][0] != passes[0][1] != passes[0][2]
    if workers > 1:  # seeded epochs: set_epoch(e) gives epoch e's order, whenever it is called
        shards[0].set_epoch(1)
        assert _epochs(shards[0], 1)[0] == passes[0][1]
        shards[0].set_epoch(1)
        assert _epochs(shards[0], 1)[0] == passes[0][1]
    again = shard_loader(_loader(shuffle=True), workers, 0)
    again.set_epoch(5)
    assert _epochs(again, 1)[0] != _epochs(again, 1)[0]  # after the given epoch, passes go on to 6


class Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.randperm(17).tolist())  # an iterable that shuffles from the global generator


def _resume_case(make, workers: int, rank: int, stop_epoch: int, stop_batch: int, epochs: int = 3):
    """Batches after a checkpoint taken inside the loop at (stop_epoch, stop_batch), uninterrupted and resumed."""
    torch.manual_seed(11)
    loader = shard_loader(make(), workers, rank)
    uninterrupted, saved, after = [], None, []
    for epoch in range(epochs):
        for i, batch in enumerate(loader):
            values = batch[0].tolist() if isinstance(batch, list) else batch.tolist()
            if saved is not None:
                after.append(values)
            uninterrupted.append(values)
            if (epoch, i) == (stop_epoch, stop_batch):
                saved = (loader.state_dict(), torch.get_rng_state(), epoch)
    state, rng, epoch_saved = saved
    torch.manual_seed(999)  # the restarted script seeds differently before load_checkpoint restores its RNG
    resumed_loader = shard_loader(make(), workers, rank)
    resumed_loader.load_state_dict(state)
    torch.set_rng_state(rng)
    resumed = []
    for _ in range(epoch_saved, epochs):
        resumed += [(b[0] if isinstance(b, list) else b).tolist() for b in resumed_loader]
    return after, resumed


@pytest.mark.parametrize("workers,rank", [(1, 0), (2, 1)])
@pytest.mark.parametrize("stop_batch", [0, 2])
@pytest.mark.parametrize("own_generator", [False, True])
def test_resume_inside_an_epoch_continues_the_same_order(workers, rank, stop_batch, own_generator):
    def make():
        return _loader(shuffle=True, generator=torch.Generator().manual_seed(5) if own_generator else None)

    after, resumed = _resume_case(make, workers, rank, stop_epoch=1, stop_batch=stop_batch)
    # the resumed run trains the rest of the saved epoch and then the remaining epochs, exactly as uninterrupted
    assert resumed[: len(after)] == after


@pytest.mark.parametrize("workers,rank", [(1, 0), (2, 0)])
def test_a_checkpoint_after_the_last_batch_resumes_at_the_start_of_the_next_epoch(workers, rank):
    batches = len(shard_loader(_loader(shuffle=True), workers, rank))
    after, resumed = _resume_case(lambda: _loader(shuffle=True), workers, rank, stop_epoch=0, stop_batch=batches - 1)
    assert len(after) == 2 * batches  # epochs 1 and 2 in full
    assert resumed[: len(after)] == after


def test_a_finished_evaluation_loader_is_not_resumed_empty():
    evaluation = shard_loader(_loader(shuffle=False), 2, 0)
    full = _epochs(evaluation, 1)[0]
    state = evaluation.state_dict()
    assert state["finished"]
    restored = shard_loader(_loader(shuffle=False), 2, 0)
    restored.load_state_dict(state)
    assert _epochs(restored, 1)[0] == full


def test_an_iterable_dataset_resumes_mid_epoch_with_its_own_shuffle():
    after, resumed = _resume_case(lambda: DataLoader(Stream(), batch_size=3), 1, 0, stop_epoch=0, stop_batch=1)
    assert resumed[: len(after)] == after
