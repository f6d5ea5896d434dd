"""Every table operation is all-or-nothing: a failure at any step leaves the table as it was, and usable.

The failure is injected with a torch dispatch mode that raises out of memory at the k-th torch op
of an operation. Between two writes to a table every failure leaves the same partial state, so
failing at each op that writes (and after the last op) covers every stage of an operation: the
growth of rows and of the id index, admission counts, TTL and max_rows evictions, row creation,
the statistics, the optimizer update, deltas, loads, and a sync step's application.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fleet.ps.server import aggregator as agg
from fleet.ps.server.dense_table import DenseTable
from fleet.sparse import id_index
from fleet.sparse import table as sparse_table
from fleet.sparse.lifecycle import CountFilterEntry, LifeCycle
from fleet.sparse.optim import OptimizerSpec
from fleet.sparse.table import SparseTable

OOM = "DefaultCPUAllocator: can't allocate memory: injected by the test"


class Ops(TorchDispatchMode):
    """Counts torch ops; with ``fail_at`` raises out of memory at that one (1-based)."""

    def __init__(self, fail_at: int = 0) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.calls = 0
        self.writes: list[int] = []  # the ops that change a tensor in place

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError(OOM)
        if func._schema.is_mutable:
            self.writes.append(self.calls)
        return func(*args, **(kwargs or {}))


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def sparse_state(t: SparseTable) -> dict[str, Any]:
    """Everything a sparse table is: its state_dict plus what a delta save and the id index keep."""
    n = len(t)
    index = t._index
    return {
        **t.state_dict(),
        "dirty": t._dirty[:n].clone(),
        "deleted": None if t._deleted is None else [d.clone() for d in t._deleted],
        "misc": (t._deleted_count, t.saved, t._next_expiry),
        "index": (index._table.clone(), len(index), index._tombstones, index.capacity, index._moved),
        "old index": None if index._old is None else index._old._table.clone(),  # while it grows
        "found": index.lookup(index.ids_by_slot()),  # every id finds its slot
    }


def dense_state(t: DenseTable) -> dict[str, Any]:
    return {**t.state_dict(), "pieces": list(t._piece_steps)}


def shard_state(s: agg.DenseShard) -> dict[str, Any]:
    acc = None if s._acc is None else s._acc.clone()
    present = None if s._present is None else s._present.clone()
    return {"table": dense_state(s.table), "acc": acc, "present": present, "pushed": set(s._pushed), "v": s.version}


def check_all_or_nothing(
    make: Callable[[], Any], op: Callable[[Any], Any], state: Callable[[Any], Any], min_writes: int = 3
) -> int:
    """Fail ``op`` at every stage; each time the object must be as before, then ``op`` must work as usual."""
    reference = make()
    expected = op(reference)
    after = state(reference)
    obj = make()
    with Ops() as count:
        op(obj)
    assert len(count.writes) >= min_writes, count.writes  # the scenario really changes the object in stages
    for k in [*count.writes, count.calls]:
        obj = make()
        before = state(obj)
        with pytest.raises(RuntimeError, match="can't allocate memory"), Ops(fail_at=k):
            op(obj)
        assert same(state(obj), before), f"a failure at torch op {k} of {count.calls} changed the table"
        assert same(op(obj), expected) and same(state(obj), after), f"after a failure at op {k}"
    return len(count.writes)


ADAM = OptimizerSpec(kind="adam", lr=0.01)


def _ids(lo: int, hi: int) -> torch.Tensor:
    return torch.arange(lo, hi) * 7919 - 50  # sparse, negative ids too


@pytest.mark.timeout(120)
def test_sparse_pull_push_and_delta_are_all_or_nothing() -> None:
    base = SparseTable(4, ADAM, seed=1)
    base.pull(_ids(0, 1000))  # 1000 of 1024 slots used: the next new rows grow the rows and the index
    base.apply_gradient(_ids(0, 300), torch.randn(300, 4), 0.1)

    def make() -> SparseTable:
        return copy.deepcopy(base)

    fresh = torch.cat([_ids(900, 1600), _ids(5, 9)])
    check_all_or_nothing(make, lambda t: t.pull(fresh), sparse_state)
    ids = torch.cat([_ids(950, 1400), _ids(0, 20), _ids(0, 20)])  # new rows and repeated ids
    grads = torch.randn(ids.numel(), 4)
    check_all_or_nothing(make, lambda t: t.apply_gradient(ids, grads, 0.05, step=7), sparse_state)
    check_all_or_nothing(make, lambda t: t.add_delta(ids, grads, step=3), sparse_state)


def _life_table() -> SparseTable:
    """Count admission (a small sketch, so that it halves), TTL and max_rows, with statistics."""
    life = LifeCycle(entry=CountFilterEntry(2, sketch_width=1024), ttl_steps=4, max_rows=260)
    t = SparseTable(3, OptimizerSpec(kind="adagrad", lr=0.1), seed=2, lifecycle=life)
    for step in range(1, 7):
        ids = _ids(40 * step, 40 * step + 120)
        t.apply_gradient(ids, torch.randn(120, 3), 0.1, torch.rand(120), step=step)
    return t


@pytest.mark.timeout(120)
def test_life_cycle_operations_are_all_or_nothing() -> None:
    base = _life_table()
    sketch = base._admission.sketch
    ids = torch.cat([_ids(0, 330), _ids(200, 260)])  # seen before (admitted now), new, and repeated
    grads, clicks = torch.randn(ids.numel(), 3), torch.rand(ids.numel())

    def update(t: SparseTable) -> None:
        t.apply_gradient(ids, grads, 0.1, clicks, step=9)  # TTL expiry, admission, max_rows eviction

    probe = copy.deepcopy(base)
    added, evicted = probe._admission.sketch.added, probe.counts["evicted"]
    update(probe)
    assert probe.counts["evicted"] > evicted and probe._admission.sketch.added < added + 300  # it evicted, halved
    assert probe.counts["dropped_gradients"] > 0 and len(probe) > len(base) - 120
    check_all_or_nothing(lambda: copy.deepcopy(base), update, sparse_state)
    check_all_or_nothing(lambda: copy.deepcopy(base), lambda t: t.shrink(threshold=1.5), sparse_state)
    assert sketch is base._admission.sketch  # the base itself was never touched


@pytest.mark.timeout(120)
def test_loads_and_deltas_are_all_or_nothing() -> None:
    source = _life_table()
    base_state = source.state_dict()
    source.mark_saved()
    source.apply_gradient(_ids(100, 400), torch.randn(300, 3), 0.1, step=12)  # evicts by TTL and max_rows
    delta1 = source.state_dict(delta=True)
    source.mark_saved()
    source.apply_gradient(_ids(300, 420), torch.randn(120, 3), 0.1, step=13)
    delta2 = source.state_dict(delta=True)
    assert delta1["deleted"].numel() > 0

    config = {"dim": 3, "optimizer": {"kind": "adagrad", "lr": 0.1}, "seed": 2, "update": "async"}
    config.update({"entry": {"kind": "count", "min_count": 2, "sketch_width": 1024}, "ttl_steps": 4, "max_rows": 260})
    shard = agg.SparseShard(0, config, 1)
    shard.table = copy.deepcopy(_life_table())
    shard.table.pull(_ids(0, 50))

    def load(s: agg.SparseShard) -> None:
        s.load([{"version": 1, "table": base_state}, {"version": 2, "table": delta1}, {"version": 3, "table": delta2}])

    check_all_or_nothing(lambda: copy.deepcopy(shard), load, lambda s: (sparse_state(s.table), s.version))
    loaded = copy.deepcopy(source)
    loaded.load_state_dict(base_state)
    check_all_or_nothing(lambda: copy.deepcopy(loaded), lambda t: t.apply_delta(delta1), sparse_state)


@pytest.mark.timeout(120)
def test_dense_operations_and_a_sync_step_are_all_or_nothing() -> None:
    base = DenseTable(10, ADAM, torch.randn(10), pieces=[(0, 4), (4, 7), (7, 10)])
    base.apply_gradient(torch.randn(10), 0.1, present=[True, False, True])  # pieces on different steps now
    grad = torch.randn(10)
    check_all_or_nothing(lambda: copy.deepcopy(base), lambda t: t.apply_gradient(grad, 0.1), dense_state)
    state = copy.deepcopy(base)
    state.apply_gradient(grad, 0.2)
    saved = state.state_dict()
    check_all_or_nothing(lambda: copy.deepcopy(base), lambda t: t.load_state_dict(saved), dense_state, min_writes=0)

    config = {"size": 6, "optimizer": {"kind": "sgd", "lr": 0.1, "momentum": 0.9}, "update": "sync"}
    shard = agg.DenseShard(0, config, 2)
    shard.set(torch.randn(6))
    shard.push_grad(0, 0, torch.randn(6), 0.1, present=torch.tensor([2], dtype=torch.uint8))
    push = torch.ones(6)
    check_all_or_nothing(lambda: copy.deepcopy(shard), lambda s: s.push_grad(1, 0, push, 0.1), shard_state, 1)
    shard.push_grad(1, 0, push, 0.1)
    check_all_or_nothing(lambda: copy.deepcopy(shard), lambda s: s.maybe_step({0, 1}, set()), shard_state, 2)


@pytest.mark.timeout(60)
def test_a_failed_growth_no_longer_breaks_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reported failure: out of memory while growing inside a pull, then every pull failed."""
    t = SparseTable(4, ADAM)
    old = t.pull(_ids(0, 1000))
    real_empty, real_grow = id_index.large_empty, sparse_table.grow

    def refuse_big(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if shape[0] > 1024:
            raise MemoryError("injected: no memory for the grown index")
        return real_empty(shape, dtype)

    def refuse_rows(t: torch.Tensor, rows: int, used: int) -> torch.Tensor:
        if rows > 1024 and t.dtype == torch.int64:  # the steps: after the rows grew
            raise MemoryError("injected: no memory for the grown table")
        return real_grow(t, rows, used)

    monkeypatch.setattr(sparse_table, "grow", refuse_rows)
    with pytest.raises(MemoryError, match="grown table"):
        t.pull(_ids(900, 2000))
    assert len(t) == 1000 and torch.equal(t.pull(_ids(0, 1000)), old)  # existing rows still pull
    monkeypatch.setattr(sparse_table, "grow", real_grow)
    monkeypatch.setattr(id_index, "large_empty", refuse_big)
    with pytest.raises(MemoryError, match="grown index"):
        t.pull(_ids(900, 5000))
    assert len(t) == 1000 and torch.equal(t.pull(_ids(0, 1000)), old)
    monkeypatch.undo()
    assert t.pull(_ids(900, 2000)).shape == (1100, 4) and len(t) == 2000
