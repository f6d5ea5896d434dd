"""The sparse table against its reference (tests/sparse/reference_table/: the table before the row records).

Seeded random sequences of operations -- pulls, pushes with every optimizer, add_delta, admission with an
entry threshold, eviction by max_rows and TTL, shrink, state_dict / load_state_dict, delta saves replayed
with apply_delta, and failures injected half-way through an operation (which must change nothing) -- go
through both tables. After every operation both hold the same ids in the same slots, the same per-row
fields (rows and optimizer state within float32 rounding: the reference steps rows with torch's row-wise
optimizer, the table with the native kernel; steps, statistics, dirty marks exactly) and the same
clock and counts; pulls return the same rows.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from reference_table.table import SparseTable as ReferenceTable
from test_table_atomicity import Ops

from fleet.sparse.lifecycle import CountFilterEntry, LifeCycle
from fleet.sparse.optim import OptimizerSpec
from fleet.sparse.table import SparseTable

DIM = 6
KINDS = {
    "sgd": {},
    "sgd_momentum": {"momentum": 0.9},
    "adagrad": {},
    "adagrad_decay": {"lr_decay": 0.01},
    "rowwise_adagrad": {},
    "adam": {},
    "adamw": {"weight_decay": 0.01},
}
LIFECYCLES = {
    "none": None,
    "admission": lambda: LifeCycle(entry=CountFilterEntry(2), max_rows=90, ttl_steps=6),
    "cap": lambda: LifeCycle(max_rows=60),
}


def _spec(kind: str) -> OptimizerSpec:
    extra = dict(KINDS[kind])
    return OptimizerSpec(kind=kind.split("_")[0] if kind.startswith(("sgd", "adagrad_")) else kind, lr=0.05, **extra)


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    if a.dtype.is_floating_point:
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(a, b), f"{what} differs"


def _same_state(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: keys {sorted(a)} vs {sorted(b)}"
    for key in a:
        if key == "deleted":  # a set of ids (see _check)
            _close(a[key].sort()[0], b[key].sort()[0], f"{what}[{key}]")
        elif isinstance(a[key], torch.Tensor):
            _close(a[key], b[key], f"{what}[{key}]")
        elif isinstance(a[key], dict):
            _same_state(a[key], b[key], f"{what}[{key}]")
        else:
            assert a[key] == b[key], f"{what}[{key}]: {a[key]!r} vs {b[key]!r}"


def _check(new: SparseTable, ref: ReferenceTable, what: str) -> None:
    n = len(ref)
    assert len(new) == n, f"{what}: {len(new)} rows vs {n}"
    assert torch.equal(new.slot_ids(), ref.slot_ids()), f"{what}: ids or their slots differ"
    new_rows, ref_rows = new.copy_rows(slice(None)), ref.copy_rows(slice(None))
    _same_state(new_rows, ref_rows, f"{what}: rows")
    assert torch.equal(new.changed_slots(), ref.changed_slots()), f"{what}: changed rows differ"
    assert (new.clock, new.counts, new.saved) == (ref.clock, ref.counts, ref.saved), what
    a, b = new.evicted_since_save(), ref.evicted_since_save()
    # a set: the order follows the id index's entries, which is the index's own business
    assert (a is None) == (b is None) and (a is None or torch.equal(a.sort()[0], b.sort()[0])), f"{what}: evicted ids"
    assert torch.equal(new._index.lookup(ref.slot_ids()), torch.arange(n)), f"{what}: an id does not find its slot"


class Driver:
    """One random sequence of operations through a new table and a reference table."""

    def __init__(self, kind: str, life: str, seed: int) -> None:
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        make_life = LIFECYCLES[life]
        self.args = (DIM, _spec(kind))
        self.life = make_life
        self.new = SparseTable(*self.args, seed=seed, lifecycle=make_life() if make_life else None)
        self.ref = ReferenceTable(*self.args, seed=seed, lifecycle=make_life() if make_life else None)
        self.pool = torch.randint(-(2**62), 2**62, (400,), generator=self.gen)
        self.base: tuple[SparseTable, ReferenceTable] | None = None  # tables loaded from the last base save
        self.step = 0
        self.result: Any = None

    def make_life(self) -> LifeCycle | None:
        return self.life() if self.life else None

    def ids(self) -> torch.Tensor:
        n = self.rng.choice([1, 7, 40, 150])
        hot = self.rng.random() < 0.5
        hi = 60 if hot else self.pool.numel()
        return self.pool[torch.randint(0, hi, (n,), generator=self.gen)]

    def op(self) -> tuple[str, Callable[[Any], Any]]:
        ids = self.ids()
        n = ids.numel()
        grads = torch.randn(n, DIM, generator=self.gen)
        clicks = (torch.rand(n, generator=self.gen) < 0.3).float() if self.rng.random() < 0.5 else None
        self.step += self.rng.choice([0, 1, 1, 2])
        step = self.step if self.rng.random() < 0.7 else None
        lr = self.rng.choice([0.05, 0.01])
        choice = self.rng.choices(["pull", "push", "delta", "tick", "shrink", "write"], [4, 6, 2, 1, 1, 1])[0]
        if choice == "pull":
            return "pull", lambda t: t.pull(ids)
        if choice == "push":
            return "push", lambda t: t.apply_gradient(ids, grads, lr, clicks=clicks, step=step)
        if choice == "delta":
            return "add_delta", lambda t: t.add_delta(ids, grads * 0.1, step=step, clicks=clicks)
        if choice == "tick":
            return "tick", lambda t: t.tick(step)
        if choice == "shrink":
            threshold = self.rng.choice([None, 0.5])
            return "shrink", lambda t: t.shrink(threshold)
        uniq = torch.unique(ids)
        rows = torch.randn(uniq.numel(), DIM, generator=self.gen)
        replace = self.rng.random() < 0.1
        return "write_rows", lambda t: t.write_rows(uniq, {"rows": rows}, replace=replace)

    def run(self, count: int) -> None:
        for i in range(count):
            name, fn = self.op()
            what = f"op {i} ({name})"
            done = self.rng.random() < 0.25 and self.fail_half_way(fn, what)
            a = self.result if done else fn(self.new)
            b = fn(self.ref)
            if isinstance(b, torch.Tensor):
                _close(a, b, f"{what}: result")
            _check(self.new, self.ref, what)
            if self.rng.random() < 0.08:
                self.save(what)

    def fail_half_way(self, fn: Callable[[Any], Any], what: str) -> bool:
        """Run ``fn`` on the new table with an allocation failure at a random torch op: it must change nothing.

        Returns whether ``fn`` ran to its end instead (it has fewer ops than the one picked to fail).
        """
        try:
            with Ops(fail_at=self.rng.randint(1, self.rng.choice([8, 30, 150]))):
                self.result = fn(self.new)
        except RuntimeError as err:
            assert "injected" in str(err), err
            _check(self.new, self.ref, f"{what}, undone after a failure")
            return False
        return True

    def save(self, what: str) -> None:
        """A base or delta save of both; the delta replayed onto tables loaded from the base must give the same."""
        if self.base is None or self.rng.random() < 0.3:
            state_new, state_ref = self.new.state_dict(), self.ref.state_dict()
            _same_state(state_new, state_ref, f"{what}: base save")
            self.new.mark_saved()
            self.ref.mark_saved()
            loaded_new = SparseTable(*self.args, seed=self.new.seed, lifecycle=self.make_life())
            loaded_ref = ReferenceTable(*self.args, seed=self.ref.seed, lifecycle=self.make_life())
            loaded_new.load_state_dict(state_new)
            loaded_ref.load_state_dict(state_ref)
            _check(loaded_new, loaded_ref, f"{what}: loaded from a base")
            self.base = (loaded_new, loaded_ref)
            if self.rng.random() < 0.5:  # go on from the loaded tables
                self.new = SparseTable(*self.args, seed=self.new.seed, lifecycle=self.make_life())
                self.new.load_state_dict(state_new)
                self.new.mark_saved()
                _check(self.new, self.ref, f"{what}: reloaded")
            return
        if self.new.evicted_since_save() is None:
            return
        delta_new, delta_ref = self.new.state_dict(delta=True), self.ref.state_dict(delta=True)
        _same_state(delta_new, delta_ref, f"{what}: delta save")
        self.new.mark_saved()
        self.ref.mark_saved()
        base_new, base_ref = self.base
        base_new.apply_delta(delta_new)
        base_ref.apply_delta(delta_ref)
        _check(base_new, base_ref, f"{what}: delta applied")
        _same_state(base_new.state_dict(), self.new.state_dict(), f"{what}: base + delta vs the table")


@pytest.mark.parametrize("life", list(LIFECYCLES))
@pytest.mark.parametrize("kind", list(KINDS))
def test_same_as_reference(kind: str, life: str) -> None:
    Driver(kind, life, seed=len(kind) + 7 * len(life)).run(60)


def test_growth_and_compaction_same_as_reference() -> None:
    """Enough rows to grow the storage and the id index several times (incrementally), with removals between."""
    driver = Driver("adam", "none", seed=5)
    life = LifeCycle(ttl_steps=3)
    driver.new = SparseTable(DIM, _spec("adam"), seed=5, lifecycle=life)
    driver.ref = ReferenceTable(DIM, _spec("adam"), seed=5, lifecycle=LifeCycle(ttl_steps=3))
    gen = torch.Generator().manual_seed(5)
    for step in range(1, 40):
        ids = torch.randint(0, 1 << 40, (3000,), generator=gen)
        ids[:500] = torch.arange(500)  # kept alive
        grads = torch.randn(ids.numel(), DIM, generator=gen)
        for t in (driver.new, driver.ref):
            t.apply_gradient(ids, grads, 0.01, step=step)
        _check(driver.new, driver.ref, f"step {step}")
        pulled = torch.randint(0, 1 << 40, (2000,), generator=gen)
        _close(driver.new.pull(pulled), driver.ref.pull(pulled), f"step {step}: pull")
