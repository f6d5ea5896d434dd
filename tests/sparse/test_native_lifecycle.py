"""The life cycle's kernels (fleet/sparse/csrc/lifecycle.cpp: sketch_add, touch_stats) against the torch code they replace."""

from __future__ import annotations

import pytest
import torch
from reference_table.admission import CountSketch as TorchSketch

from fleet.sparse.lifecycle import CountSketch, LifeCycle
from fleet.sparse.native import kernels
from fleet.sparse.undo import UndoLog


@pytest.mark.parametrize("width", [8, 64, 1 << 12])
@pytest.mark.parametrize("seed", [0, 1, 7])
def test_sketch_counts_are_the_torch_sketch_with_colliding_ids(width: int, seed: int) -> None:
    """Small widths make ids share counters within a batch: each must see the counters as they were before it."""
    gen = torch.Generator().manual_seed(width + seed)
    native, reference = CountSketch(width, seed), TorchSketch(width, seed)
    for _ in range(40):  # enough sightings to halve the counters several times at the small widths
        ids = torch.unique(
            torch.randint(-(1 << 40), 1 << 40, (int(torch.randint(1, 60, (1,), generator=gen)),), generator=gen)
        )
        ids = ids[torch.randperm(ids.numel(), generator=gen)]
        assert torch.equal(native.add(ids), reference.add(ids))
        assert torch.equal(native.counters, reference.counters) and native.added == reference.added


def test_sketch_add_goes_back_with_its_undo_record() -> None:
    sketch = CountSketch(16, 3)
    sketch.add(torch.arange(5))
    before = sketch.state_dict()
    undo = UndoLog()
    sketch.add(torch.arange(3, 12), undo)  # passes the halving window (8): new counters as well
    assert not torch.equal(sketch.counters, before["counters"])
    undo.rollback()
    assert torch.equal(sketch.counters, before["counters"]) and sketch.added == before["added"]


def test_sketch_add_checks_its_buffers_before_writing() -> None:
    counters = torch.zeros(4 * 8, dtype=torch.uint8)
    ids = torch.arange(3)
    out = (torch.empty(3, dtype=torch.int64), torch.empty(12, dtype=torch.int64), torch.empty(12, dtype=torch.uint8))
    with pytest.raises(ValueError, match="counters has 32 entries"):
        kernels.sketch_add(counters.numpy(), ids.numpy(), 0, 4, 4, *(t.numpy() for t in out))
    with pytest.raises(ValueError, match="depth must be"):
        kernels.sketch_add(counters.numpy(), ids.numpy(), 0, 5, 3, *(t.numpy() for t in out))
    with pytest.raises(TypeError, match="counters must hold uint8"):
        kernels.sketch_add(counters.to(torch.int32).numpy(), ids.numpy(), 0, 4, 3, *(t.numpy() for t in out))
    with pytest.raises(ValueError, match="must hold 3, 12 and 12"):
        kernels.sketch_add(counters.numpy(), ids.numpy(), 0, 4, 3, out[0].numpy(), out[0].numpy(), out[2].numpy())
    assert not counters.any()


def _torch_touch(last_seen, show, click, slots, clock, decay, clicks):
    """SparseTable._touch's statistics update as it was in torch ops."""
    seen = last_seen.index_select(0, slots)
    age = clock - seen
    lc = LifeCycle(decay=decay)
    old_show, old_click = show.index_select(0, slots), click.index_select(0, slots)
    show.index_copy_(0, slots, lc.decayed(old_show, age) + 1.0)
    click.index_copy_(0, slots, lc.decayed(old_click, age))
    if clicks is not None:
        click.index_add_(0, slots, clicks)
    last_seen.index_fill_(0, slots, clock)


def _records(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """last_seen (int32), show and click (float32) as strided columns of one record array, as fleet.sparse.records has."""
    data = torch.zeros(n, 4, dtype=torch.int64)
    i32, f32 = data.view(torch.int32), data.view(torch.float32)
    last_seen, show, click = i32[:, 3], f32[:, 4], f32[:, 5]
    last_seen.copy_(torch.randint(0, 20, (n,), generator=gen, dtype=torch.int32))
    show.copy_(torch.rand(n, generator=gen) * 9)
    click.copy_(torch.rand(n, generator=gen) * 3)
    return data, last_seen, show, click


def _touch(last_seen, show, click, slots, clock, decay, clicks):
    """fleet's native update, called as SparseTable._touch calls it; returns the old values it reports."""
    n = slots.numel()
    factors = (
        None
        if decay == 1.0
        else LifeCycle(decay=decay).decayed(torch.ones(n), clock - last_seen.index_select(0, slots))
    )
    old = (torch.empty(n, dtype=torch.int32), torch.empty(n), torch.empty(n))
    kernels.touch_stats(
        last_seen.numpy(),
        show.numpy(),
        click.numpy(),
        slots.numpy(),
        None if factors is None else factors.numpy(),
        None if clicks is None else clicks.numpy(),
        clock,
        *(t.numpy() for t in old),
    )
    return old


@pytest.mark.parametrize("decay", [1.0, 0.999, 0.5])
@pytest.mark.parametrize("with_clicks", [False, True])
def test_touch_is_the_torch_update_with_repeated_slots(decay: float, with_clicks: bool) -> None:
    """Bit for bit on strided record fields: one show per call for a repeated slot, every click added in order."""
    gen = torch.Generator().manual_seed(int(decay * 100) + with_clicks)
    _, last_seen, show, click = _records(50, gen)
    ref = [last_seen.clone(), show.clone(), click.clone()]
    for clock in range(20, 40):
        slots = torch.randint(0, 50, (64,), generator=gen)  # many repeats
        clicks = (torch.rand(64, generator=gen) < 0.4).float() * torch.rand(64, generator=gen) if with_clicks else None
        expected_old = [t.index_select(0, slots) for t in ref]
        old = _touch(last_seen, show, click, slots, clock, decay, clicks)
        _torch_touch(*ref, slots, clock, decay, clicks)
        for name, got, want in zip(("last_seen", "show", "click"), (last_seen, show, click), ref, strict=True):
            assert torch.equal(got, want), (name, clock)
        for got, want in zip(old, expected_old, strict=True):
            assert torch.equal(got, want)


def test_touch_checks_every_slot_before_writing() -> None:
    data, last_seen, show, click = _records(8, torch.Generator().manual_seed(0))
    before = data.clone()
    with pytest.raises(IndexError, match="slot 8 out of range for 8 rows"):
        _touch(last_seen, show, click, torch.tensor([1, 2, 8]), 30, 1.0, None)
    with pytest.raises(ValueError, match="one value per slot"):
        _touch(last_seen, show, click, torch.tensor([1, 2]), 30, 1.0, torch.ones(3))
    with pytest.raises(ValueError, match="does not fit int32"):
        _touch(last_seen, show, click, torch.tensor([1]), 1 << 40, 1.0, None)
    with pytest.raises(TypeError, match="show must hold float32"):
        kernels.touch_stats(
            last_seen.numpy(),
            last_seen.numpy(),
            click.numpy(),
            torch.tensor([0]).numpy(),
            None,
            None,
            1,
            torch.empty(1, dtype=torch.int32).numpy(),
            torch.empty(1).numpy(),
            torch.empty(1).numpy(),
        )
    assert torch.equal(data, before)
