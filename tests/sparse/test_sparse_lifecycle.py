"""The sparse-table life cycle in one process: admission, statistics, eviction, delta saves."""

from __future__ import annotations

import pytest
import torch

from fleet.sparse.id_index import IdIndex
from fleet.sparse.lifecycle import CountFilterEntry, CountSketch, LifeCycle, ProbabilityEntry
from fleet.sparse.optim import OptimizerSpec
from fleet.sparse.table import SparseTable

SGD = OptimizerSpec(kind="sgd", lr=0.1)
OPTIMIZERS = [
    OptimizerSpec(kind="sgd", lr=0.1, momentum=0.9),
    OptimizerSpec(kind="adagrad", lr=0.1),
    OptimizerSpec(kind="adam", lr=0.01),
]


def table(lifecycle: LifeCycle, optimizer: OptimizerSpec = SGD, dim: int = 4) -> SparseTable:
    return SparseTable(dim, optimizer, seed=3, lifecycle=lifecycle)


def ones(n: int, dim: int = 4) -> torch.Tensor:
    return torch.ones(n, dim)


def test_count_filter_admits_after_min_count_updates_and_drops_earlier_gradients() -> None:
    t = table(LifeCycle(entry=CountFilterEntry(3)))
    ids = torch.tensor([5, 6, 6])
    for _ in range(2):
        assert torch.equal(t.pull(ids), torch.zeros(3, 4))  # not admitted: zeros
        t.apply_gradient(ids, ones(3), lr=0.1)
        assert len(t) == 0
    assert t.counts["dropped_gradients"] == 6
    t.apply_gradient(ids, ones(3), lr=0.1)  # third sighting admits; that update trains the new rows
    assert len(t) == 2
    plain = SparseTable(4, SGD, seed=3)
    expected = plain.pull(torch.tensor([5, 6])) - 0.1 * torch.tensor([[1.0], [2.0]])
    torch.testing.assert_close(t.pull(torch.tensor([5, 6])), expected)


def test_probability_entry_admits_about_p_and_every_replica_decides_alike() -> None:
    ids = torch.arange(40_000)
    tables = [table(LifeCycle(entry=ProbabilityEntry(0.25))) for _ in range(2)]
    for t in tables:
        t.apply_gradient(ids, ones(ids.numel()), lr=0.1)
    assert abs(len(tables[0]) / ids.numel() - 0.25) < 0.01
    assert torch.equal(tables[0].state_dict()["ids"], tables[1].state_dict()["ids"])
    tables[0].apply_gradient(ids, ones(ids.numel()), lr=0.1)  # a second step is a fresh draw per id
    assert abs(len(tables[0]) / ids.numel() - (1 - 0.75**2)) < 0.01


def test_count_sketch_never_undercounts_and_stays_small() -> None:
    sketch = CountSketch(width=1 << 12)
    gen = torch.Generator().manual_seed(0)
    truth: dict[int, int] = {}
    for _ in range(5):  # under one window (width / 2 sightings): nothing halved yet
        ids = torch.unique(torch.randint(0, 5000, (400,), generator=gen))
        counts = sketch.add(ids)
        for i, c in zip(ids.tolist(), counts.tolist(), strict=True):
            truth[i] = truth.get(i, 0) + 1
            assert c >= truth[i]
    assert sketch.counters.numel() == 4 * (1 << 12)  # memory fixed, whatever the number of ids


def test_count_sketch_admits_rarely_by_mistake_and_forgets_old_sightings() -> None:
    width = 1 << 16
    sketch = CountSketch(width=width)
    singles = torch.arange(10_000_000, 10_000_000 + 20 * width)  # each id seen once, many windows' worth
    wrongly = sum(int((sketch.add(chunk) >= 2).sum()) for chunk in singles.split(4096))
    assert wrongly < 0.02 * singles.numel()  # few false admissions at a count filter of 2
    seen_once = torch.arange(100)
    sketch.add(seen_once)
    for chunk in torch.arange(5 * width).split(4096):  # a few windows of other ids go by
        sketch.add(chunk + 50_000_000)
    assert int((sketch.add(seen_once) >= 2).sum()) < 10  # the old sighting faded


def test_ttl_removes_rows_not_updated_for_ttl_steps() -> None:
    t = table(LifeCycle(ttl_steps=8))
    t.apply_gradient(torch.tensor([1, 2]), ones(2), lr=0.1)
    for _ in range(20):
        t.apply_gradient(torch.tensor([1]), ones(1), lr=0.1)
    assert t.state_dict()["ids"].tolist() == [1]
    assert t.counts["evicted"] == 1
    # a removed id comes back fresh: its initial value
    fresh = SparseTable(4, SGD, seed=3).pull(torch.tensor([2]))
    assert torch.equal(t.pull(torch.tensor([2])), fresh)


def test_max_rows_is_never_exceeded_and_keeps_the_most_shown_rows() -> None:
    cap = 2_000
    t = table(LifeCycle(max_rows=cap))
    gen = torch.Generator().manual_seed(1)
    popular = torch.arange(100)
    for _ in range(300):
        cold = torch.randint(1_000, 1 << 40, (200,), generator=gen)  # 60k distinct cold ids
        ids = torch.cat([popular, cold])
        t.apply_gradient(ids, ones(ids.numel()), lr=0.1)
        assert len(t) <= cap
    kept = set(t.state_dict()["ids"].tolist())
    assert set(popular.tolist()) <= kept
    assert t.counts["evicted"] >= 300 * 200 - cap


def test_shrink_by_score_and_clicks_raise_a_rows_score() -> None:
    t = table(LifeCycle(ttl_steps=1000))
    t.apply_gradient(torch.tensor([1, 2, 3]), ones(3), lr=0.1, clicks=torch.tensor([0.0, 1.0, 0.0]))
    t.apply_gradient(torch.tensor([3]), ones(1), lr=0.1)
    scores = dict(zip(t.state_dict()["ids"].tolist(), t.scores().tolist(), strict=True))
    assert scores[2] > scores[3] > scores[1]  # a click outweighs a second show
    assert t.shrink(threshold=scores[3] * 0.99) == 1
    assert sorted(t.state_dict()["ids"].tolist()) == [2, 3]


def test_shows_and_clicks_decay_per_step() -> None:
    t = table(LifeCycle(ttl_steps=1000, decay=0.5))
    t.apply_gradient(torch.tensor([1]), ones(1), lr=0.1)
    t.apply_gradient(torch.tensor([2]), ones(1), lr=0.1)
    t.apply_gradient(torch.tensor([2]), ones(1), lr=0.1)
    scores = dict(zip(t.state_dict()["ids"].tolist(), t.scores().tolist(), strict=True))
    assert scores[1] == pytest.approx(0.1 * 0.25)  # one show, two steps old
    assert scores[2] == pytest.approx(0.1 * 1.5)  # 1 * 0.5 + 1


def _same_tables(a: SparseTable, b: SparseTable) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    order_a, order_b = torch.argsort(sa["ids"]), torch.argsort(sb["ids"])
    assert torch.equal(sa["ids"][order_a], sb["ids"][order_b])
    for key, value in sa.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == sa["ids"].numel():
            assert torch.equal(value[order_a], sb[key][order_b]), key
    assert sa["clock"] == sb["clock"]
    assert torch.equal(sa["admission"].get("counters", torch.zeros(0)), sb["admission"].get("counters", torch.zeros(0)))


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.kind)
def test_base_plus_deltas_load_to_exactly_the_saved_table(optimizer: OptimizerSpec) -> None:
    life = LifeCycle(entry=CountFilterEntry(2), max_rows=300, ttl_steps=40)
    live = table(life, optimizer)
    gen = torch.Generator().manual_seed(2)
    saves = []
    for step in range(120):
        ids = torch.randint(0, 600, (64,), generator=gen)
        live.apply_gradient(ids, torch.randn(64, 4, generator=gen), lr=0.1, clicks=torch.rand(64, generator=gen))
        if step % 30 == 29:
            saves.append(live.state_dict(delta=bool(saves)))
            live.mark_saved()
    assert live.counts["evicted"] > 0 and saves[1]["deleted"].numel() > 0
    assert all(s["ids"].numel() < len(live) + s.get("deleted", torch.empty(0)).numel() for s in saves[1:])
    restored = table(life, optimizer)
    restored.load_state_dict(saves[0])
    for delta in saves[1:]:
        restored.apply_delta(delta)
    _same_tables(live, restored)
    # and both go on identically
    ids = torch.randint(0, 600, (64,), generator=gen)
    grads = torch.randn(64, 4, generator=gen)
    for t in (live, restored):
        t.apply_gradient(ids, grads, lr=0.1)
    _same_tables(live, restored)


def test_a_delta_without_changes_is_empty_and_a_base_cannot_be_applied_as_delta() -> None:
    t = table(LifeCycle(max_rows=10))
    t.apply_gradient(torch.arange(5), ones(5), lr=0.1)
    base = t.state_dict()
    t.mark_saved()
    assert t.state_dict(delta=True)["ids"].numel() == 0
    with pytest.raises(ValueError, match="needs a delta"):
        t.apply_delta(base)
    with pytest.raises(ValueError, match="is a delta"):
        t.load_state_dict(t.state_dict(delta=True))


def test_plain_tables_save_deltas_too() -> None:
    t = SparseTable(4, SGD)
    t.pull(torch.arange(10))
    base = t.state_dict()
    t.mark_saved()
    t.apply_gradient(torch.tensor([3, 42]), ones(2), lr=0.1)
    delta = t.state_dict(delta=True)
    assert sorted(delta["ids"].tolist()) == [3, 42]
    restored = SparseTable(4, SGD)
    restored.load_state_dict(base)
    restored.apply_delta(delta)
    _same_tables(t, restored)


def test_index_renumber_removes_ids_and_reuses_their_entries() -> None:
    index = IdIndex(64)
    ids = torch.randint(-(2**62), 2**62, (5_000,), generator=torch.Generator().manual_seed(4))
    ids = torch.unique(ids)
    index.insert_new(ids)
    keep = torch.rand(ids.numel(), generator=torch.Generator().manual_seed(5)) < 0.5
    new_slot = torch.full((ids.numel(),), -1, dtype=torch.int64)
    new_slot[keep] = torch.arange(int(keep.sum()))
    removed = index.renumber(new_slot)
    assert torch.equal(torch.sort(removed).values, ids[~keep])
    assert torch.equal(index.lookup(ids[keep]), torch.arange(int(keep.sum())))
    assert bool((index.lookup(ids[~keep]) == -1).all())
    again = index.insert_new(ids[~keep])  # absent again, so they may be re-inserted
    assert torch.equal(index.lookup(ids[~keep]), again)
    assert torch.equal(index.ids_by_slot()[index.lookup(ids)], ids)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_rows": 0}, "max_rows"),
        ({"ttl_steps": -1}, "ttl_steps"),
        ({"decay": 0.0}, "decay"),
    ],
)
def test_bad_life_cycle_settings_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LifeCycle(**kwargs)


def test_bad_entries_are_named() -> None:
    with pytest.raises(ValueError, match="min_count"):
        CountFilterEntry(0)
    with pytest.raises(ValueError, match="sketch_width"):
        CountFilterEntry(2, sketch_width=1000)
    with pytest.raises(ValueError, match="probability"):
        ProbabilityEntry(1.5)
    with pytest.raises(ValueError, match="max_rows=1 is less than the number of servers"):
        SparseTable.from_config({"dim": 4, "optimizer": SGD.to_config(), "max_rows": 1, "servers": 2})


def test_prefetch_outside_async_parameter_servers_changes_nothing() -> None:
    import fleet

    emb = fleet.nn.SparseEmbedding(4, seed=1)
    ids = torch.tensor([[3, 9], [9, 12]])
    emb.prefetch(ids)  # a local table: nothing to fetch early
    assert emb._prefetched is None
    assert torch.equal(emb(ids), fleet.nn.SparseEmbedding(4, seed=1)(ids))
