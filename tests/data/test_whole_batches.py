"""Loaders whose items are whole batches: detected, split across the workers (the global batch stays the
item, as in one process), refused with a way out when they cannot be split, and counted in samples."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from dist_harness import run_workers
from fleet.data.loader import shard_loader
from fleet.data.whole_batches import WholeBatchError
from fleet.telemetry import timing

ITEMS, SAMPLES = 5, 8


def _item(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(SAMPLES, 3, generator=g), torch.randn(SAMPLES, 1, generator=g)


class Batches(Dataset):
    """Every item is a whole batch of SAMPLES samples (as DLRM's dataset with its collate)."""

    def __init__(self, make=_item):
        self.make = make

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, i: int):
        return self.make(i)


class StreamOfBatches(IterableDataset):
    def __len__(self) -> int:
        return ITEMS

    def __iter__(self):
        return (_item(i) for i in range(ITEMS))


def _first(items: list):
    return items[0]


def _loader(how: str, **kwargs) -> DataLoader:
    if how == "none":
        return DataLoader(Batches(), batch_size=None, **kwargs)
    if how == "collate":  # DLRM's: batch_size=1, a collate that returns the mini-batch
        return DataLoader(Batches(), batch_size=1, collate_fn=_first, **kwargs)
    return DataLoader(StreamOfBatches(), batch_size=None)


@pytest.fixture
def recorder(monkeypatch):
    fresh = timing.StepMetrics()
    monkeypatch.setattr(timing, "_recorder", fresh)
    return fresh


@pytest.mark.parametrize("how", ["none", "collate", "stream"])
@pytest.mark.parametrize("workers", [1, 2, 4])
def test_each_item_is_split_across_the_workers(how, workers, recorder):
    shards = [shard_loader(_loader(how), workers, rank) for rank in range(workers)]
    passes = [[tuple(batch) for batch in shard] for shard in shards]
    assert {len(p) for p in passes} == {ITEMS} and all(len(shard) == ITEMS for shard in shards)
    for step in range(ITEMS):  # the union of the workers' step is the item: one process's batch
        x = torch.cat([passes[rank][step][0] for rank in range(workers)])
        y = torch.cat([passes[rank][step][1] for rank in range(workers)])
        assert torch.equal(x, _item(step)[0]) and torch.equal(y, _item(step)[1])
    assert recorder.batch_size == SAMPLES // workers  # samples (the last shard's), not 1 per item


def _own_collate(items: list):  # a custom collate that still batches single samples
    return default_collate(items)


def test_items_of_one_sample_with_a_custom_collate_are_still_dealt_out(recorder):
    data = Batches(lambda i: (torch.full((2,), float(i)),))
    shares = {}
    for collate in (default_collate, _own_collate):
        loaders = [shard_loader(DataLoader(data, batch_size=1, collate_fn=collate), 2, r) for r in range(2)]
        shares[collate] = [[b[0][0, 0].item() for b in loader] for loader in loaders]
    assert shares[_own_collate] == shares[default_collate] == [[0.0, 2.0, 4.0], [1.0, 3.0, 0.0]]  # padded
    assert recorder.batch_size == 1


def test_samples_per_second_counts_samples_in_one_process(recorder):
    loader = shard_loader(_loader("collate"), 1, 0)
    assert recorder.batch_size is None  # batch_size=1 says nothing about the samples here
    for _ in loader:
        recorder.end_step()
    assert recorder.batch_size == SAMPLES and recorder.samples == (ITEMS - 1) * SAMPLES  # 1st step starts the clock


def test_batches_that_cannot_be_split_are_refused_with_a_way_out():
    def dlrm_like(i: int):  # dense features, bag offsets per table [tables, batch], labels
        return torch.randn(SAMPLES, 3), torch.zeros(2, SAMPLES, dtype=torch.int64), torch.randn(SAMPLES, 1)

    loader = shard_loader(DataLoader(Batches(dlrm_like), batch_size=1, collate_fn=_first), 2, 0)
    with pytest.raises(WholeBatchError, match=r"do not share a first \(sample\) dimension") as err:
        next(iter(loader))
    message = str(err.value)
    assert "batch_size=1 with a collate_fn that returns 8 samples" in message
    assert "[1]: (2, 8)" in message and "fleet.worker_index()" in message
    odd = shard_loader(DataLoader(Batches(lambda i: torch.zeros(7, 2)), batch_size=None), 2, 1)
    with pytest.raises(WholeBatchError, match="holds 7 samples, not a multiple of the 2 workers"):
        next(iter(odd))
    assert next(iter(shard_loader(DataLoader(Batches(lambda i: torch.zeros(7, 2)), batch_size=None), 1, 0))).shape[0]


def _train(rank: int) -> dict:
    import fleet

    fleet.init()
    out = {}
    for how in ("none", "collate"):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        loader = fleet.distributed_loader(_loader(how))
        sizes = []
        for x, y in loader:
            sizes.append(x.shape[0])
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        out[how] = {"weight": torch.cat([model.weight.flatten(), model.bias]).detach(), "sizes": sizes}
    out["samples"] = timing.recorder().samples
    fleet.stop_worker()
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_two_workers_equal_one_process_on_the_same_batches():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(ITEMS):
        x, y = _item(i)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    want = torch.cat([model.weight.flatten(), model.bias]).detach()
    results = run_workers(_train, 2)
    for result in results:
        for how in ("none", "collate"):
            assert result[how]["sizes"] == [SAMPLES // 2] * ITEMS, how
            assert torch.allclose(result[how]["weight"], want, atol=1e-6), (how, result[how]["weight"], want)
        assert result["samples"] == (2 * ITEMS - 1) * SAMPLES // 2  # per worker; the first step starts the clock


@pytest.mark.parametrize("how", ["none", "collate", "stream"])
def test_a_split_loader_resumes_mid_epoch(how):
    whole = [batch[0] for batch in shard_loader(_loader(how), 2, 1)]
    loader = shard_loader(_loader(how), 2, 1)
    taken = []
    for batch in loader:
        taken.append(batch[0])
        if len(taken) == 2:
            break
    resumed = shard_loader(_loader(how), 2, 1)
    resumed.load_state_dict(loader.state_dict())
    rest = [batch[0] for batch in resumed]
    assert len(rest) == ITEMS - 2 and all(torch.equal(a, b) for a, b in zip(taken + rest, whole, strict=True))


def test_a_batch_sampler_is_not_taken_for_whole_batches(recorder):
    from torch.utils.data import BatchSampler, SequentialSampler

    from fleet.data.whole_batches import may_hold_batches

    data = list(range(10))
    assert not may_hold_batches(DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), 3, False)))
    assert may_hold_batches(DataLoader(data, batch_size=None))
    assert not may_hold_batches(DataLoader(data, batch_size=1))
