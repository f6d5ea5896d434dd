"""Replacing the class name is the whole conversion of a table (issue 36): ``SparseEmbeddingBag(n, m, mode="sum",
sparse=True)`` and ``SparseEmbedding(n, m)`` take torch's signatures and equal ``nn.EmbeddingBag`` / ``nn.Embedding``
on the same initial rows (forward, and the rows after optimizer steps); ``num_embeddings`` bounds the ids."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fleet

N, DIM = 20, 4


def _batches(steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        lengths = torch.randint(0, 4, (6,), generator=gen)
        ids = torch.randint(0, N, (int(lengths.sum()),), generator=gen)
        out.append((ids, torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])))
    return out


def _weight() -> torch.Tensor:
    return torch.randn(N, DIM, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("optimizer", [(torch.optim.SGD, {"lr": 0.1}), (torch.optim.Adagrad, {"lr": 0.1})])
def test_a_bag_equals_nn_embedding_bag_on_the_same_rows(mode, optimizer) -> None:
    make, kwargs = optimizer
    # torch has no sparse gradient for max bags; SGD and Adagrad step a dense one's untouched rows by nothing
    ref = nn.EmbeddingBag(N, DIM, mode=mode, sparse=mode != "max", _weight=_weight().clone())
    ours = fleet.nn.SparseEmbeddingBag(N, DIM, mode=mode, sparse=True, _weight=_weight())  # the class name only
    opts = [make(ref.parameters(), **kwargs), make(ours.parameters(), **kwargs)]
    for ids, offsets in _batches():
        outs = [ref(ids, offsets), ours(ids, offsets)]
        assert torch.allclose(outs[0], outs[1], atol=1e-6), mode
        for out, opt in zip(outs, opts, strict=True):
            opt.zero_grad()
            (out * torch.arange(out.numel()).view_as(out)).sum().backward()
            opt.step()
    assert torch.allclose(ours.dense_weight(), ref.weight.detach(), atol=1e-6)


def test_an_embedding_equals_nn_embedding_on_the_same_rows() -> None:
    ref = nn.Embedding(N, DIM, sparse=True, _weight=_weight().clone())
    ours = fleet.nn.SparseEmbedding(N, DIM, sparse=True, _weight=_weight())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours)]
    for ids, _ in _batches():
        ids = ids.view(1, -1)
        outs = [ref(ids), ours(ids)]
        assert outs[0].shape == outs[1].shape and torch.allclose(outs[0], outs[1], atol=1e-6)
        for out, opt in zip(outs, opts, strict=True):
            opt.zero_grad()
            out.pow(2).sum().backward()
            opt.step()
    assert torch.allclose(ours.dense_weight(), ref.weight.detach(), atol=1e-6)


def test_torch_padding_idx_is_an_index_counted_from_the_end() -> None:
    ref = nn.EmbeddingBag(N, DIM, mode="mean", sparse=True, padding_idx=-1, _weight=_weight().clone())
    ours = fleet.nn.SparseEmbeddingBag(N, DIM, mode="mean", sparse=True, padding_idx=-1, _weight=_weight())
    assert ours.padding_idx == N - 1
    ids, offsets = torch.tensor([N - 1, 3, 5, N - 1, N - 1]), torch.tensor([0, 3])
    assert torch.allclose(ours(ids, offsets), ref(ids, offsets), atol=1e-6)


@pytest.mark.parametrize(
    "make",
    [
        lambda: fleet.nn.SparseEmbeddingBag(N, DIM, mode="sum", sparse=True),
        lambda: fleet.nn.SparseEmbeddingBag(num_embeddings=N, embedding_dim=DIM, mode="sum", sparse=True),
        lambda: fleet.nn.SparseEmbeddingBag(N, embedding_dim=DIM, mode="sum", sparse=True),
        lambda: fleet.nn.SparseEmbeddingBag(DIM, num_embeddings=N, mode="sum", sparse=True),
    ],
)
def test_ids_outside_the_vocabulary_raise_index_error_naming_the_id_and_the_bound(make) -> None:
    bag = make()
    assert (bag.num_embeddings, bag.embedding_dim, bag.mode) == (N, DIM, "sum")
    bag(torch.tensor([0, N - 1]), torch.tensor([0]))
    for bad in (N, -1):
        with pytest.raises(IndexError, match=rf"SparseEmbeddingBag\(num_embeddings={N}\): id {bad} is out of range"):
            bag(torch.tensor([1, bad]), torch.tensor([0]))
        with pytest.raises(RuntimeError, match="not in the valid range"):  # torch's bag (nn.Embedding: IndexError)
            nn.EmbeddingBag(N, DIM, mode="sum")(torch.tensor([1, bad]), torch.tensor([0]))
    table = fleet.nn.SparseEmbedding(N, DIM, sparse=True)
    with pytest.raises(IndexError, match=rf"SparseEmbedding\(num_embeddings={N}\): id {N} is out of range \[0, {N}\)"):
        table(torch.tensor([[N]]))
    with pytest.raises(IndexError):  # as torch
        nn.Embedding(N, DIM)(torch.tensor([[N]]))
    with pytest.raises(IndexError, match="out of range"):
        table.load_rows(torch.tensor([N]), torch.zeros(1, DIM))


def test_fleets_own_signatures_keep_working() -> None:
    for bag in (
        fleet.nn.SparseEmbeddingBag(16),
        fleet.nn.SparseEmbeddingBag(16, "sum"),
        fleet.nn.SparseEmbeddingBag(16, mode="sum"),
        fleet.nn.SparseEmbeddingBag(embedding_dim=16, mode="sum", seed=3),
    ):
        assert bag.embedding_dim == 16 and bag.num_embeddings is None
        bag(torch.tensor([-5, 1 << 40]), torch.tensor([0]))  # any int64 id
    assert fleet.nn.SparseEmbeddingBag(16).mode == "mean"  # torch's default
    assert fleet.nn.SparseEmbedding(16, "zeros").initializer.kind == "zeros"
    assert fleet.nn.SparseEmbedding(embedding_dim=16, seed=2).seed == 2
    with pytest.raises(TypeError, match="'sparse'.*always sparse.*vocabulary size first"):
        fleet.nn.SparseEmbedding(16, sparse=True)


def test_weight_points_to_dense_weight_and_messages_name_the_class() -> None:
    bag = fleet.nn.SparseEmbeddingBag(N, DIM, mode="sum", sparse=True)
    with pytest.raises(AttributeError, match=r"SparseEmbeddingBag has no \.weight.*\.dense_weight\(\) copies the rows"):
        bag.weight  # noqa: B018
    assert not hasattr(fleet.nn.SparseEmbedding(DIM), "weight")
    with pytest.raises(AttributeError, match=r"SparseEmbedding has no \.weight.*\.dense_weight\(n\)"):
        fleet.nn.SparseEmbedding(DIM).weight  # noqa: B018
    with pytest.raises(ValueError, match="RMSprop is not supported as a SparseEmbeddingBag's optimizer"):
        fleet.nn.SparseEmbeddingBag(DIM, optimizer=(torch.optim.RMSprop, {"lr": 0.1}))
    opt = torch.optim.RMSprop(bag.parameters(), lr=0.1)
    bag(torch.tensor([1, 2]), torch.tensor([0])).sum().backward()
    with pytest.raises(ValueError, match="not supported for a fleet.nn.SparseEmbeddingBag in one process"):
        opt.step()
    with pytest.raises(TypeError, match="SparseEmbeddingBag takes integer ids"):
        bag(torch.tensor([1.0]), torch.tensor([0]))


def test_torch_arguments_a_table_cannot_honour_are_refused_and_dense_gradients_warn() -> None:
    with pytest.raises(TypeError, match=r"max_norm=1.0 is not supported"):
        fleet.nn.SparseEmbeddingBag(N, DIM, max_norm=1.0, sparse=True)
    with pytest.raises(TypeError, match="device='meta'"):
        fleet.nn.SparseEmbedding(N, DIM, device="meta", sparse=True)
    with pytest.raises(ValueError, match=r"_weight must be a tensor \[20, 4\]"):
        fleet.nn.SparseEmbedding(N, DIM, _weight=torch.zeros(3, DIM), sparse=True)
    with pytest.raises(TypeError, match="'padding_idx'"):
        fleet.nn.SparseEmbedding(N, DIM, padding_idx=0, sparse=True)
    fleet.nn.SparseEmbeddingBag(N, DIM, norm_type=2.0, scale_grad_by_freq=False, device="cpu", sparse=True)
    with pytest.warns(UserWarning, match="without sparse=True.*updates only the rows a step looks up"):
        fleet.nn.SparseEmbeddingBag(N, DIM, mode="sum")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fleet.nn.SparseEmbeddingBag(N, DIM, mode="sum", sparse=True)
