"""SparseFeatureCollection takes nn.EmbeddingBag's offsets as well as lengths (the same bags, the same output), and
stands where a program iterates its tables (an nn.ModuleList of nn.EmbeddingBag, as DLRM's emb_l) (issue 36)."""

from __future__ import annotations

import pytest
import torch

from fleet.nn import FeatureTable, JaggedFeatures, SparseEmbeddingBag, SparseFeatureCollection
from fleet.nn.feature_collection import _bag_offsets

IDS = torch.tensor([5, 9, 9, 1, 40, 7, 3])
OFFSETS = torch.tensor([0, 2, 2, 5])  # 4 bags: [5, 9], [], [9, 1, 40], [7, 3]
LENGTHS = torch.tensor([2, 0, 3, 2])
WEIGHTS = torch.arange(7, dtype=torch.float32)


def _collection() -> SparseFeatureCollection:
    return SparseFeatureCollection(
        [FeatureTable("t0", 4, ["a", "b"], mode="sum", seed=1), FeatureTable("t1", 3, mode="mean", seed=2)]
    )


def test_offsets_and_lengths_are_the_same_bags() -> None:
    model = _collection()
    model.eval()
    two_d = torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8]])
    by_offsets = model(
        {"a": {"ids": IDS, "offsets": OFFSETS, "weights": WEIGHTS}, "b": two_d, "t1": {"ids": IDS, "offsets": OFFSETS}}
    )
    by_lengths = model(
        {"a": {"ids": IDS, "lengths": LENGTHS, "weights": WEIGHTS}, "b": two_d, "t1": {"ids": IDS, "lengths": LENGTHS}}
    )
    by_tuples = model({"a": (IDS, LENGTHS, WEIGHTS), "b": two_d, "t1": (IDS, LENGTHS)})
    jagged = JaggedFeatures(
        ["a", "b", "t1"],
        torch.cat([IDS, two_d.reshape(-1), IDS]),
        lengths=torch.cat([LENGTHS, torch.full((4,), 2), LENGTHS]),
    )
    by_jagged = model(jagged)
    for feature in ("a", "b", "t1"):
        assert torch.equal(by_offsets[feature], by_lengths[feature]), feature
        assert torch.equal(by_offsets[feature], by_tuples[feature]), feature
        if feature != "a":  # (unweighted jagged)
            assert torch.equal(by_offsets[feature], by_jagged[feature]), feature
    # the table on its own, called as nn.EmbeddingBag with the same offsets
    assert torch.allclose(model["t1"](IDS, OFFSETS), by_offsets["t1"])
    assert torch.allclose(model[0](IDS, OFFSETS, per_sample_weights=WEIGHTS), by_offsets["a"])


@pytest.mark.parametrize(
    ("bags", "match"),
    [
        ({"ids": IDS, "offsets": OFFSETS, "lengths": LENGTHS}, "one of 'offsets'"),
        ({"ids": IDS}, "one of 'offsets'"),
        ({"ids": IDS, "offsets": OFFSETS, "starts": OFFSETS}, r"got \['ids', 'offsets', 'starts'\]"),
        ({"ids": IDS, "offsets": torch.tensor([1, 2])}, "offsets must be 1-D, start at 0"),
        ({"ids": IDS, "offsets": torch.tensor([0, 3, 2])}, "not decrease"),
        ({"ids": IDS, "offsets": torch.tensor([0, 8])}, "within the 7 ids"),
        ({"ids": IDS, "lengths": torch.tensor([2, 2])}, "adding up to the 7 ids"),
        ({"ids": IDS, "lengths": torch.tensor([9, -2])}, ">= 0"),
        ({"ids": IDS, "lengths": torch.tensor([[3, 4]])}, "lengths must be 1-D"),
        ({"ids": IDS, "lengths": torch.tensor([], dtype=torch.int64)}, "adding up to the 7 ids"),
        ({"ids": IDS, "offsets": torch.tensor([[0, 3]])}, "offsets must be 1-D"),
        ({"ids": IDS, "offsets": torch.tensor([0, -1, 3])}, "not decrease"),
    ],
)
def test_a_bag_dict_that_is_not_one_layout_is_refused(bags, match) -> None:
    model = SparseFeatureCollection([FeatureTable("t", 4)])
    with pytest.raises(ValueError, match=match):
        model({"t": bags})


@pytest.mark.parametrize(
    ("given", "lengths", "n", "offsets"),
    [
        ([0, 2, 2, 5], False, 7, [0, 2, 2, 5, 7]),
        ([], False, 0, [0]),
        ([], False, 3, [3]),  # no bags: the ids belong to none (as nn.EmbeddingBag)
        ([0, 7], False, 7, [0, 7, 7]),
        ([2, 0, 3, 2], True, 7, [0, 2, 2, 5, 7]),
        ([], True, 0, [0]),
        ([0, 0], True, 0, [0, 0, 0]),
    ],
)
def test_bag_offsets_are_torchs_arithmetic(given, lengths, n, offsets) -> None:
    """The native pass gives the offsets torch.cat / torch.cumsum gave, as int64."""
    out = _bag_offsets(torch.tensor(given, dtype=torch.int32), n, lengths)
    assert out is not None and out.dtype == torch.int64 and out.tolist() == offsets
    # an int64 tensor is taken as it is (strided too), a list converted: the same offsets, the input untouched
    every_other = torch.tensor([x for v in given for x in (v, -1)], dtype=torch.int64)[::2]
    for same in (torch.tensor(given, dtype=torch.int64), every_other, list(given)):
        before = torch.as_tensor(same).clone()
        assert _bag_offsets(same, n, lengths).tolist() == offsets
        assert torch.equal(torch.as_tensor(same), before)


def test_the_collection_is_a_sequence_of_its_tables() -> None:
    model = _collection()
    assert len(model) == 2
    tables = list(model)
    assert all(isinstance(t, SparseEmbeddingBag) for t in tables)
    assert tables == [model.tables["t0"], model.tables["t1"]] == [model[0], model[1]] == [model["t0"], model[-1]]
    assert [t.embedding_dim for t in model] == [4, 3]
    assert not any(t.include_last_offset for t in model)  # each takes nn.EmbeddingBag's offsets
