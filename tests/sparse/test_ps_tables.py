"""Parameter-server storage: the id index, dense shards and sparse row tables."""

from __future__ import annotations

import pytest
import torch

from fleet.ps.server.dense_table import DenseTable
from fleet.sparse.id_index import IdIndex
from fleet.sparse.optim import InitializerSpec, OptimizerSpec, initial_rows
from fleet.sparse.table import SparseTable

SGD = OptimizerSpec(kind="sgd", lr=0.1)


# --------------------------------------------------------------------------- id index
def test_index_random_ids_with_negatives_extremes_duplicates_and_growth() -> None:
    gen = torch.Generator().manual_seed(0)
    index = IdIndex(capacity=16)  # grows many times below
    extremes = torch.tensor([0, -1, 1, 2**63 - 1, -(2**63), 0x7FF0000000000001, -0x0010000000000001])  # NaN-ish bits
    batches = [torch.randint(-(2**63), 2**63 - 1, (25_000,), generator=gen) for _ in range(4)]
    batches[1] = torch.cat([batches[1], batches[0][:5000], extremes, extremes])  # repeats across and within
    seen = torch.empty(0, dtype=torch.int64)
    for ids in batches:
        before = len(index)
        slots, new_ids = index.get_or_insert(ids)
        assert torch.equal(new_ids, torch.unique(ids[~torch.isin(ids, seen)]))  # sorted, de-duplicated
        assert torch.equal(index.lookup(new_ids), torch.arange(before, len(index)))  # slots in id order
        assert torch.equal(index.ids_by_slot()[slots], ids)  # every id maps to the slot holding it
        seen = torch.cat([seen, new_ids])
    all_ids = torch.unique(torch.cat(batches))
    assert len(index) == all_ids.numel() == seen.numel()
    assert len(index) <= 0.75 * index.capacity and index.capacity & (index.capacity - 1) == 0
    slots = index.lookup(all_ids)
    assert (slots >= 0).all() and torch.unique(slots).numel() == len(index)
    assert torch.equal(torch.sort(slots).values, torch.arange(len(index)))  # dense slots 0..n-1
    absent = torch.randint(-(2**63), 2**63 - 1, (20_000,), generator=gen)
    absent = absent[~torch.isin(absent, all_ids)]
    assert (index.lookup(absent) == -1).all()


def test_index_long_collision_chain_wrapping_around() -> None:
    # 900 ids with the same home entry, chosen at the very end of the table so the chain wraps to entry 0.
    index = IdIndex(capacity=4096)
    candidates = torch.arange(-3_000_000, 3_000_000)
    homes = index._home(candidates)
    same = candidates[homes == homes.max()][:900]
    assert same.numel() == 900 and index._home(same).unique().numel() == 1
    neighbours = candidates[homes < 40][:100]  # they live where the chain wraps to
    ids = torch.cat([neighbours[:50], same, neighbours[50:]])
    slots, _ = index.get_or_insert(ids)
    assert index.capacity == 4096  # no growth: the chain really is that long
    assert torch.equal(index.lookup(ids), slots)
    assert torch.equal(index.ids_by_slot()[slots], ids)
    assert (index.lookup(candidates[homes == homes.max()][900:1000]) == -1).all()


def test_index_rejects_bad_ids() -> None:
    index = IdIndex()
    with pytest.raises(ValueError, match="1-D"):
        index.lookup(torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="integer"):
        index.lookup(torch.zeros(3))
    assert index.lookup(torch.tensor([1, 2], dtype=torch.int32)).tolist() == [-1, -1]


# --------------------------------------------------------------------------- dense table
def test_dense_table_pull_is_live_and_shapes_are_checked() -> None:
    table = DenseTable(6, SGD, init=torch.arange(6.0))
    live = table.pull()
    assert live.dtype == torch.float32 and live.is_contiguous() and live.shape == (6,)
    table.apply_gradient(torch.ones(6), lr=0.5)
    assert table.pull() is live and torch.equal(live, torch.arange(6.0) - 0.5)
    table.add_delta(torch.full((6,), 2.0))
    assert torch.equal(live, torch.arange(6.0) + 1.5)
    with pytest.raises(ValueError, match=r"\(5,\).*\(6,\)"):
        table.set(torch.zeros(5))
    with pytest.raises(ValueError, match=r"\(2, 3\)"):
        table.apply_gradient(torch.zeros(2, 3), lr=0.1)
    with pytest.raises(ValueError, match="delta"):
        table.add_delta(torch.zeros(7))


def test_dense_table_state_dict_round_trip_continues_identically() -> None:
    spec = OptimizerSpec(kind="adam", lr=0.01, weight_decay=0.01)
    gen = torch.Generator().manual_seed(0)
    a = DenseTable(50, spec, init=torch.randn(50, generator=gen))
    for _ in range(5):
        a.apply_gradient(torch.randn(50, generator=gen), 0.01)
    state = a.state_dict()
    b = DenseTable.from_config({"size": 50, "optimizer": spec.to_config()})
    b.load_state_dict(state)
    a.apply_gradient(torch.ones(50), 0.02)  # the saved copy must not move with the live table
    assert not torch.equal(state["values"], a.pull())
    b.apply_gradient(torch.ones(50), 0.02)
    for _ in range(5):
        g = torch.randn(50, generator=gen)
        a.apply_gradient(g, 0.005)
        b.apply_gradient(g, 0.005)
    assert torch.equal(a.pull(), b.pull()) and a.step == b.step == 11
    with pytest.raises(ValueError, match="size 50.*size 40"):
        DenseTable(40, spec).load_state_dict(state)
    with pytest.raises(ValueError, match="'adam'.*'sgd'"):
        DenseTable(50, SGD).load_state_dict(state)


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"optimizer": {"kind": "sgd", "lr": 0.1}}, "size"),
        ({"size": 4}, "optimizer"),
        ({"size": -1, "optimizer": {"kind": "sgd", "lr": 0.1}}, "size"),
        ({"size": 4, "optimizer": {"kind": "sgd", "lr": 0.1}, "dim": 3}, "dim"),
        ({"size": 4, "optimizer": {"kind": "sgd"}}, "lr"),
    ],
)
def test_dense_table_config_errors_name_the_key(config: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        DenseTable.from_config(config)


# --------------------------------------------------------------------------- sparse table
def test_sparse_pull_creates_rows_from_initial_rows_with_duplicates() -> None:
    init = InitializerSpec(kind="normal", std=0.1)
    table = SparseTable(8, SGD, init, seed=5)
    ids = torch.tensor([42, -7, 42, 2**62, -7, 0])
    rows = table.pull(ids)
    assert rows.shape == (6, 8) and len(table) == 4
    assert torch.equal(rows, initial_rows(ids, 8, init, seed=5))
    assert torch.equal(table.pull(torch.tensor([0, 42])), rows[[5, 0]])
    rows[0] += 1  # a pull is a copy
    assert torch.equal(table.pull(torch.tensor([42])), initial_rows(torch.tensor([42]), 8, init, seed=5))
    assert table.pull(torch.tensor([], dtype=torch.int64)).shape == (0, 8)


def test_sparse_rows_independent_of_creation_order_and_sharding() -> None:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(-(10**12), 10**12, (5000,), generator=gen)
    one = SparseTable(4, SGD, seed=9)
    expected = one.pull(ids)
    shards = [SparseTable(4, SGD, seed=9) for _ in range(3)]
    for chunk in ids.flip(0).split(777):  # other order, other batches, sharded by id
        for s, table in enumerate(shards):
            table.pull(chunk[chunk % 3 == s])
    for s, table in enumerate(shards):
        assert torch.equal(table.pull(ids[ids % 3 == s]), expected[ids % 3 == s])


def test_sparse_growth_keeps_rows_and_state() -> None:
    table = SparseTable(3, OptimizerSpec(kind="adagrad", lr=0.1), InitializerSpec(kind="zeros"))
    first = torch.arange(100)
    table.apply_gradient(first, torch.ones(100, 3), lr=0.1)
    before = table.pull(first)
    table.pull(torch.arange(1000, 6000))  # forces several doublings of rows, state and index
    assert len(table) == 5100
    assert torch.equal(table.pull(first), before)
    table.apply_gradient(first, torch.ones(100, 3), lr=0.1)
    # Second Adagrad step with sum = 2: row = -0.1 - 0.1 / sqrt(2) (within float rounding).
    torch.testing.assert_close(table.pull(first), torch.full((100, 3), -0.1 - 0.1 / 2**0.5), atol=1e-7, rtol=0)


ROW_CASES = [
    (torch.optim.SGD, {"lr": 0.1}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.2, "weight_decay": 0.01}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    (torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.05}),
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.05}),
    (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.02, "initial_accumulator_value": 0.1}),
]


@pytest.mark.parametrize("case", ROW_CASES, ids=[c[0].__name__ + str(i) for i, c in enumerate(ROW_CASES)])
def test_sparse_rowwise_update_matches_torch_per_row(case: tuple) -> None:
    """Each row follows its own torch optimizer that steps only when the row gets a gradient."""
    cls, kw = case
    gen = torch.Generator().manual_seed(2)
    n_rows, dim = 7, 5
    row_ids = torch.tensor([-5, 0, 3, 99, 2**40, -(2**50), 17])
    probe = cls([torch.zeros(1, requires_grad=True)], **kw)
    table = SparseTable(dim, OptimizerSpec.from_torch(cls, probe.param_groups[0]), InitializerSpec(kind="normal"))
    start = table.pull(row_ids)
    params = [start[r].clone().requires_grad_() for r in range(n_rows)]
    opts = [cls([p], **kw) for p in params]
    for step in range(40):
        lr = kw["lr"] * (0.95**step)
        # A random subset of rows, some ids repeated, in random order.
        picks = torch.randint(0, n_rows, (9,), generator=gen)
        grads = torch.randn(9, dim, generator=gen)
        table.apply_gradient(row_ids[picks], grads, lr)
        for r in torch.unique(picks).tolist():
            opts[r].param_groups[0]["lr"] = lr
            params[r].grad = grads[picks == r].sum(0)
            opts[r].step()
        expected = torch.stack([p.detach() for p in params])
        torch.testing.assert_close(table.pull(row_ids), expected, atol=1e-6, rtol=0)


def test_sparse_update_is_lazy() -> None:
    # Dense Adam would keep moving rows with momentum; row-wise Adam leaves untouched rows (and state) alone.
    table = SparseTable(4, OptimizerSpec(kind="adam", lr=0.01))
    table.apply_gradient(torch.tensor([1, 2, 3]), torch.ones(3, 4), 0.01)
    before = table.state_dict()
    table.apply_gradient(torch.tensor([2]), torch.ones(1, 4), 0.01)
    after = table.state_dict()
    changed = (after["rows"] != before["rows"]).any(1)
    assert changed.tolist() == [False, True, False]
    assert after["steps"].tolist() == [1, 2, 1]
    assert (after["state.exp_avg"][[0, 2]] == before["state.exp_avg"][[0, 2]]).all()


def test_sparse_duplicates_are_summed_before_the_update() -> None:
    spec = OptimizerSpec(kind="adagrad", lr=0.1)
    a, b = SparseTable(2, spec, seed=1), SparseTable(2, spec, seed=1)
    ids = torch.tensor([4, 9, 4, 4, 7])
    grads = torch.tensor([[1.0, 2.0], [3.0, 4.0], [0.5, 0.5], [0.25, -1.0], [1.0, 1.0]])
    a.apply_gradient(ids, grads, 0.1)
    b.apply_gradient(torch.tensor([4, 9, 7]), torch.stack([grads[[0, 2, 3]].sum(0), grads[1], grads[4]]), 0.1)
    assert torch.equal(a.pull(torch.tensor([4, 9, 7])), b.pull(torch.tensor([4, 9, 7])))
    a.add_delta(torch.tensor([9, 9]), torch.ones(2, 2))
    torch.testing.assert_close(a.pull(torch.tensor([9])), b.pull(torch.tensor([9])) + 2)


def test_sparse_state_dict_round_trip_continues_identically() -> None:
    spec = OptimizerSpec(kind="adam", lr=0.01)
    gen = torch.Generator().manual_seed(3)
    a = SparseTable(6, spec, seed=11)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(-2000, 2000, (300,), generator=gen), torch.randn(300, 6, generator=gen)

    for _ in range(10):
        a.apply_gradient(*batch(), lr=0.01)
    state = a.state_dict()
    b = SparseTable.from_config({"dim": 6, "optimizer": spec.to_config(), "seed": 11})
    b.load_state_dict(state)
    assert len(b) == len(a)
    for _ in range(10):
        ids, grads = batch()
        a.apply_gradient(ids, grads, 0.003)
        b.apply_gradient(ids, grads, 0.003)
    probe = torch.arange(-2500, 2500)  # includes rows neither table has yet
    assert torch.equal(a.pull(probe), b.pull(probe))
    with pytest.raises(ValueError, match="dim 6.*dim 4"):
        SparseTable(4, spec).load_state_dict(state)
    with pytest.raises(ValueError, match="exp_avg"):
        SparseTable(6, spec).load_state_dict({k: v for k, v in state.items() if k != "state.exp_avg"})


def _same_table(a: SparseTable, b: SparseTable) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    order_a, order_b = sa["ids"].argsort(), sb["ids"].argsort()
    for key, value in sa.items():
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == len(a):
            assert torch.equal(value[order_a], sb[key][order_b]), key


def test_a_push_of_recently_pulled_ids_reuses_their_slots_and_equals_a_plain_push() -> None:
    # Async workers push exactly the list they pulled a step before: the table reuses the pull's slots.
    gen = torch.Generator().manual_seed(5)
    spec = OptimizerSpec(kind="adam", lr=0.01)
    cached, plain = SparseTable(4, spec, seed=2), SparseTable(4, spec, seed=2)
    lists = [torch.randint(-3000, 3000, (700,), generator=gen).unique() for _ in range(6)]
    for step, ids in enumerate(lists):
        cached.pull(ids)
        if step:  # the previous step's push, after the next batch's pull (prefetch order)
            grads = torch.randn(lists[step - 1].numel(), 4, generator=gen)
            cached.apply_gradient(lists[step - 1], grads, 0.01)
            plain.apply_gradient(lists[step - 1], grads, 0.01)
    assert len(cached._recent) >= 1
    plain.pull(torch.cat(lists))
    _same_table(cached, plain)
    # a push of a different list with the same length and ends is not mistaken for a pulled one
    ids = lists[-1].clone()
    ids[1:-1] = ids[1:-1].flip(0)
    grads = torch.randn(ids.numel(), 4, generator=gen)
    cached.apply_gradient(ids, grads, 0.01)
    plain.apply_gradient(ids, grads, 0.01)
    _same_table(cached, plain)


def test_remembered_slots_are_forgotten_when_slots_move() -> None:
    spec = OptimizerSpec(kind="sgd", lr=0.1)
    ids = torch.arange(0, 4000, 3)
    other = SparseTable(4, spec, seed=9)
    other.pull(torch.arange(10_000, 12_000).flip(0))  # the same ids at other slots after a load
    other.pull(ids.flip(0))
    saved = other.state_dict()
    grads = torch.randn(ids.numel(), 4)
    a, b = SparseTable(4, spec, seed=9), SparseTable(4, spec, seed=9)
    a.pull(ids)
    a.load_state_dict(saved)
    b.load_state_dict(saved)
    for t in (a, b):
        t.apply_gradient(ids, grads, 0.1)
    _same_table(a, b)
    # a delta that deletes rows compacts the slots of the rest
    base = SparseTable(4, spec, seed=9)
    base.pull(ids)
    base.mark_saved()
    a, b = SparseTable(4, spec, seed=9), SparseTable(4, spec, seed=9)
    for t in (a, b):
        t.load_state_dict(base.state_dict())
    delta = base.state_dict(delta=True)
    delta["deleted"] = ids[:50]
    a.pull(ids[50:])
    a.apply_delta(delta)
    b.apply_delta(delta)
    for t in (a, b):
        t.apply_gradient(ids[50:], grads[50:], 0.1)
    _same_table(a, b)


def test_sparse_shape_errors() -> None:
    table = SparseTable(4, SGD)
    with pytest.raises(ValueError, match=r"\(3, 5\).*\(3, 4\)"):
        table.apply_gradient(torch.tensor([1, 2, 3]), torch.zeros(3, 5), 0.1)
    with pytest.raises(ValueError, match="1-D"):
        table.pull(torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="deltas"):
        table.add_delta(torch.tensor([1]), torch.zeros(2, 4))


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"optimizer": {"kind": "sgd", "lr": 0.1}}, "dim"),
        ({"dim": 4}, "optimizer"),
        ({"dim": 0, "optimizer": {"kind": "sgd", "lr": 0.1}}, "dim"),
        ({"dim": 4, "optimizer": {"kind": "sgd", "lr": 0.1}, "size": 3}, "size"),
        ({"dim": 4, "optimizer": {"kind": "adam", "lr": 0.1, "betas": [2, 0]}}, "betas"),
        ({"dim": 4, "optimizer": {"kind": "sgd", "lr": 0.1}, "initializer": {"kind": "xavier"}}, "initializer.*kind"),
        ({"dim": 4, "optimizer": {"kind": "sgd", "lr": 0.1}, "seed": "x"}, "seed"),
    ],
)
def test_sparse_table_config_errors_name_the_key(config: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        SparseTable.from_config(config)


def test_a_state_saved_for_another_optimizer_is_refused_naming_both() -> None:
    adam = OptimizerSpec(kind="adam", lr=0.1)
    sparse = SparseTable(4, adam, seed=1)
    sparse.apply_gradient(torch.tensor([3, 9]), torch.ones(2, 4), 0.1)
    with pytest.raises(ValueError, match="sparse table state_dict is for optimizer 'adam', this table uses 'sgd'"):
        SparseTable(4, SGD, seed=1).load_state_dict(sparse.state_dict())
    dense = DenseTable(5, adam, init=torch.zeros(5))
    with pytest.raises(ValueError, match="dense table state_dict is for optimizer 'adam', this table uses 'sgd'"):
        DenseTable(5, SGD, init=torch.zeros(5)).load_state_dict(dense.state_dict())
