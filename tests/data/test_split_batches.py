"""fleet.distributed_loader(loader, split_batches=True): every item is one step's global batch, split across the
workers as torch.tensor_split splits it (tensors, tuples, dicts, bags of ids, jagged features), checked in one
process as a job would split it, and trained by a 2-worker job as one process trains on the whole batches
(issue 36: DLRM's own distributed mode, accelerate's split_batches)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from dist_harness import run_workers
from fleet.data.loader import shard_loader
from fleet.data.whole_batches import WholeBatchError
from fleet.nn import JaggedFeatures

N, DIM, TABLES = 30, 3, 2


def _bags(gen: torch.Generator, samples: int, key: str) -> dict:
    lengths = torch.randint(0, 4, (samples,), generator=gen)
    ids = torch.randint(0, N, (int(lengths.sum()),), generator=gen)
    if key == "lengths":
        return {"ids": ids, "lengths": lengths}
    return {"ids": ids, "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])}


def _batch(i: int, samples: int = 7) -> dict:
    """A DLRM-style batch: dense features, one bag dict per table (offsets, as nn.EmbeddingBag), labels."""
    gen = torch.Generator().manual_seed(i)
    return {
        "dense": torch.randn(samples, 4, generator=gen),
        "sparse": [_bags(gen, samples, "offsets" if t % 2 == 0 else "lengths") for t in range(TABLES)],
        "label": torch.rand(samples, 1, generator=gen),
    }


def _lengths(bags: dict) -> torch.Tensor:
    if "lengths" in bags:
        return bags["lengths"]
    return torch.diff(torch.cat([bags["offsets"], torch.tensor([bags["ids"].numel()])]))


def _loader(batches: list, **kwargs) -> DataLoader:
    return DataLoader(batches, batch_size=None, **kwargs)


@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.filterwarnings("ignore:fleet.distributed_loader.split_batches=True.:UserWarning")
def test_each_batch_is_split_as_tensor_split_splits_it(workers) -> None:
    batches = [_batch(i) for i in range(3)]
    shards = [list(shard_loader(_loader(batches), workers, r, split_batches=True)) for r in range(workers)]
    assert all(len(s) == 3 for s in shards)
    for step, whole in enumerate(batches):
        parts = [shards[r][step] for r in range(workers)]
        want = [t.shape[0] for t in torch.tensor_split(whole["dense"], workers)]
        assert [p["dense"].shape[0] for p in parts] == [p["label"].shape[0] for p in parts] == want
        assert torch.equal(torch.cat([p["dense"] for p in parts]), whole["dense"])
        for t in range(TABLES):
            mine = [p["sparse"][t] for p in parts]
            assert set(mine[0]) == set(whole["sparse"][t])  # offsets stay offsets, lengths stay lengths
            assert torch.equal(torch.cat([m["ids"] for m in mine]), whole["sparse"][t]["ids"])
            assert torch.equal(torch.cat([_lengths(m) for m in mine]), _lengths(whole["sparse"][t]))
            assert all(int(m["offsets"][0]) == 0 for m in mine if "offsets" in m and m["offsets"].numel())


def test_tuples_tensors_and_jagged_features_are_split_by_sample() -> None:
    lengths = torch.tensor([1, 0, 2, 1, 3, 0, 2, 2, 1, 1])  # 2 keys x 5 samples
    jagged = JaggedFeatures(["a", "b"], torch.arange(13), lengths=lengths, weights=torch.arange(13.0))
    batch = (torch.arange(5), jagged)
    parts = [next(iter(shard_loader(_loader([batch]), 2, r, split_batches=True))) for r in range(2)]
    assert [p[0].tolist() for p in parts] == [[0, 1, 2], [3, 4]]
    assert parts[0][1].keys() == ["a", "b"] and isinstance(parts[0][1], JaggedFeatures)
    assert parts[0][1].lengths().tolist() == [1, 0, 2, 0, 2, 2] and parts[1][1].lengths().tolist() == [1, 3, 1, 1]
    assert parts[0][1].values().tolist() == [0, 1, 2, 7, 8, 9, 10] == parts[0][1].weights_or_none().tolist()
    assert parts[1][1].values().tolist() == [3, 4, 5, 6, 11, 12]
    # a loader that batches samples itself: its batch of 6 is the global batch
    data = TensorDataset(torch.arange(12).float().view(12, 1))
    shards = [[b[0].flatten().tolist() for b in shard_loader(DataLoader(data, batch_size=6), 2, r, split_batches=True)]
              for r in range(2)]  # fmt: skip
    assert shards == [[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9, 10, 11]]]


def _dlrm_batch(i: int):  # DLRM's own: offsets per table [tables, batch], ids [nnz], not split by sample
    return torch.randn(8, 3), torch.zeros(2, 8, dtype=torch.int64), torch.randn(8, 1)


def test_one_process_yields_whole_batches_and_refuses_what_a_job_would_refuse() -> None:
    batches = [_batch(i) for i in range(2)]
    got = list(shard_loader(_loader(batches), 1, 0, split_batches=True))
    for g, b in zip(got, batches, strict=True):  # unchanged: the whole batches
        assert torch.equal(g["dense"], b["dense"]) and torch.equal(g["sparse"][1]["ids"], b["sparse"][1]["ids"])
    for workers in (1, 2):
        loader = shard_loader(_loader([_dlrm_batch(0)]), workers, 0, split_batches=True)
        with pytest.raises(WholeBatchError, match=r"do not share a first \(sample\) dimension.*'offsets'") as err:
            next(iter(loader))
        assert "split_batches=True" in str(err.value)
    with pytest.raises(WholeBatchError, match="offsets are not 1-D, starting at 0"):
        bad = {"x": torch.zeros(2, 1), "bags": {"ids": torch.arange(3), "offsets": torch.tensor([1, 2])}}
        next(iter(shard_loader(_loader([bad]), 1, 0, split_batches=True)))
    # without split_batches, one process still passes them, but says a job would refuse them
    with pytest.warns(UserWarning, match=r"do not share a first \(sample\) dimension.*fleetrun refuses them"):
        assert len(list(shard_loader(_loader([_dlrm_batch(0)] * 2), 1, 0))) == 2


def test_uneven_batches_warn_unless_the_loss_is_weighted_and_short_batches_are_refused() -> None:
    batches = [_batch(0, samples=8), _batch(1, samples=7)]
    for read in (False, True):
        loader = shard_loader(_loader(batches), 2, 1, split_batches=True)
        weights = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in loader:
                if read:
                    weights.append(loader.share_weight)
        uneven = [w for w in caught if "split unevenly" in str(w.message)]
        assert len(uneven) == (0 if read else 1)
        if read:
            assert weights == [1.0, 2 * 3 / 7]
    assert shard_loader(_loader(batches), 1, 0, split_batches=True).share_weight == 1.0
    with pytest.raises(WholeBatchError, match="holds 1 samples, fewer than the 2 workers.*drop_last"):
        next(iter(shard_loader(_loader([_batch(0, samples=1)]), 2, 0, split_batches=True)))
    with pytest.raises(WholeBatchError, match="not a multiple of the 2 workers.*split_batches=True"):
        next(iter(shard_loader(_loader(batches[1:]), 2, 0)))  # the default: equal shares only


def test_split_batches_false_deals_whole_batches_out() -> None:
    batches = [_batch(i, samples=8) for i in range(4)]
    shards = [list(shard_loader(_loader(batches), 2, r, split_batches=False)) for r in range(2)]
    assert [[b["dense"].shape[0] for b in s] for s in shards] == [[8, 8], [8, 8]]
    assert torch.equal(shards[1][0]["dense"], batches[1]["dense"])
    with pytest.raises(TypeError, match="split_batches must be True, False or None"):
        shard_loader(_loader(batches), 2, 0, split_batches="yes")


class Dlrm(torch.nn.Module):
    """DLRM's shape: bags of ids pooled per table (nn.EmbeddingBag's signature), dense features, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        import fleet

        torch.manual_seed(0)
        self.bottom = torch.nn.Linear(4, DIM)
        self.top = torch.nn.Linear(DIM * (TABLES + 1), 1)
        self.emb_l = torch.nn.ModuleList(
            fleet.nn.SparseEmbeddingBag(N, DIM, mode="sum", sparse=True, _weight=torch.randn(N, DIM))
            for _ in range(TABLES)
        )

    def forward(self, batch: dict) -> torch.Tensor:
        pooled = []
        for table, bags in zip(self.emb_l, batch["sparse"], strict=True):
            if "lengths" in bags:
                bags = {"ids": bags["ids"], "offsets": torch.cat([bags["lengths"].new_zeros(1),
                                                                  bags["lengths"].cumsum(0)[:-1]])}  # fmt: skip
            pooled.append(table(bags["ids"], bags["offsets"]))
        return torch.sigmoid(self.top(torch.cat([self.bottom(batch["dense"]), *pooled], 1)))

    def snapshot(self) -> dict[str, torch.Tensor]:
        out = {k: v.detach().clone() for k, v in self.named_parameters() if v.numel()}
        out.update({f"emb_l.{k}": t.dense_weight() for k, t in enumerate(self.emb_l)})
        return out


BATCHES = [(i, 8 if i % 2 == 0 else 7) for i in range(5)]  # even and uneven global batches


def _train(loader, model: Dlrm, opt, weight=lambda: 1.0) -> None:
    for batch in loader:
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy(model(batch), batch["label"]) * weight()
        loss.backward()
        opt.step()


def _worker(rank: int) -> dict:
    import fleet

    fleet.init()
    model = Dlrm()
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    loader = fleet.distributed_loader(_loader([_batch(i, s) for i, s in BATCHES]), split_batches=True)
    sizes = [b["dense"].shape[0] for b in loader]
    _train(loader, model, opt, lambda: loader.share_weight)
    fleet.stop_worker()
    return {"snapshot": model.snapshot(), "sizes": sizes}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_two_workers_with_split_batches_equal_one_process_on_the_whole_batches() -> None:
    model = Dlrm()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    _train(_loader([_batch(i, s) for i, s in BATCHES]), model, opt)
    want = model.snapshot()
    results = run_workers(_worker, 2)
    assert [r["sizes"] for r in results] == [[4, 4, 4, 4, 4], [4, 3, 4, 3, 4]]
    for worker, result in enumerate(results):
        for name, value in want.items():
            got = result["snapshot"][name]
            assert torch.allclose(got, value, atol=1e-5, rtol=0), f"worker {worker} {name}: {(got - value).abs().max()}"


def test_a_resumed_epoch_warns_only_for_the_batches_it_yields() -> None:
    batches = [_batch(0, samples=7), _batch(1, samples=8), _batch(2, samples=8)]
    loader = shard_loader(_loader(batches), 2, 0, split_batches=True)
    loader.load_state_dict({"epoch": 0, "position": 1})  # the uneven batch was trained before the save
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [b["dense"].shape[0] for b in loader] == [4, 4]
