"""The native id index against the torch one it replaced (tests/sparse/reference_id_index.py), and the
native kernels' argument checks: a bad call raises a Python error naming the argument, never crashes."""

from __future__ import annotations

import numpy as np
import pytest
import reference_id_index
import torch
from reference_id_index import IdIndex as ReferenceIndex

from fleet.sparse import id_index
from fleet.sparse.id_index import IdIndex
from fleet.sparse.native import kernels
from fleet.sparse.undo import UndoLog

EXTREMES = torch.tensor([0, -1, 1, 2**63 - 1, -(2**63), 0x7FF0000000000001, -0x0010000000000001])


def _same(native: IdIndex, ref: ReferenceIndex, known: torch.Tensor, probe: torch.Tensor) -> None:
    """Both hold the same ids at the same slots, with the same size; the native index at its own load limit
    (3/4: the torch index's was 1/4, so their capacities differ)."""
    assert len(native) == len(ref) and len(native) + native._tombstones <= 0.75 * native.capacity
    assert torch.equal(native.ids_by_slot(), ref.ids_by_slot())
    assert torch.equal(native.lookup(known), ref.lookup(known))
    assert torch.equal(native.lookup(probe), ref.lookup(probe))


def _batch(gen: torch.Generator, known: torch.Tensor, size: int) -> torch.Tensor:
    """Ids with repeats, negatives, extremes, some known already, in random order."""
    space = int(torch.randint(1, 4, (1,), generator=gen))
    if space == 1:
        fresh = torch.randint(-(2**63), 2**63 - 1, (size,), generator=gen)  # the whole range
    elif space == 2:
        fresh = torch.randint(-5000, 5000, (size,), generator=gen)  # small: many repeats
    else:
        fresh = torch.randint(0, 1 << 20, (size,), generator=gen) << 12  # strided, as packed feature ids are
    parts = [fresh, EXTREMES[torch.randint(0, EXTREMES.numel(), (3,), generator=gen)]]
    if known.numel():
        parts.append(known[torch.randint(0, known.numel(), (size // 2,), generator=gen)])
    ids = torch.cat(parts)
    return ids[torch.randperm(ids.numel(), generator=gen)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_give_the_reference_slots(seed: int) -> None:
    """Inserts (repeats, negatives), lookups of missing ids, renumbering, undo: through growth and back."""
    gen = torch.Generator().manual_seed(seed)
    native, ref = IdIndex(16), ReferenceIndex(16)
    known = torch.empty(0, dtype=torch.int64)
    for step in range(60):
        op = int(torch.randint(0, 10, (1,), generator=gen))
        size = int(torch.randint(0, 3000, (1,), generator=gen)) if step % 7 else 40_000  # some cross growth at once
        probe = torch.randint(-(2**63), 2**63 - 1, (500,), generator=gen)
        if op <= 4:  # get_or_insert, with or without an undo log kept
            ids = _batch(gen, known, size)
            got, want = native.get_or_insert(ids), ref.get_or_insert(ids)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            known = ref.ids_by_slot()
        elif op == 5:  # insert_new of unique absent ids (in the order given, not sorted)
            ids = torch.unique(_batch(gen, known, size))
            ids = ids[ref.lookup(ids) < 0]
            ids = ids[torch.randperm(ids.numel(), generator=gen)]
            assert torch.equal(native.insert_new(ids), ref.insert_new(ids))
            known = ref.ids_by_slot()
        elif op == 6 and len(ref):  # renumber: remove a random part, keep the rest in slot order
            keep = torch.rand(len(ref), generator=gen) < 0.7
            new_slot = torch.full((len(ref),), -1, dtype=torch.int64)
            new_slot[keep] = torch.arange(int(keep.sum()))
            got, want = native.renumber(new_slot), ref.renumber(new_slot)
            assert torch.equal(torch.sort(got).values, torch.sort(want).values)  # entry order: unspecified
            known = ref.ids_by_slot()
        elif op == 7:  # an operation that a later step fails: rolled back on both
            n_log, r_log = UndoLog(), UndoLog()
            ids = _batch(gen, known, size)
            native.get_or_insert(ids, n_log)
            ref.get_or_insert(ids, r_log)
            if len(ref) and bool(torch.randint(0, 2, (1,), generator=gen)):
                new_slot = torch.arange(len(ref)).roll(1)  # a permutation: every id moves
                native.renumber(new_slot, n_log)
                ref.renumber(new_slot, r_log)
            n_log.rollback()
            r_log.rollback()
        else:  # lookups only, of known and missing ids
            ids = _batch(gen, known, size)
            assert torch.equal(native.lookup(ids), ref.lookup(ids))
        _same(native, ref, known, probe)


def test_a_failed_growth_changes_neither(monkeypatch: pytest.MonkeyPatch) -> None:
    """Allocation fails in the middle of growing: both raise, and both are as before."""
    gen = torch.Generator().manual_seed(7)
    native, ref = IdIndex(64), ReferenceIndex(64)
    first = torch.randint(-(2**40), 2**40, (3000,), generator=gen)
    native.get_or_insert(first)
    ref.get_or_insert(first)
    known = ref.ids_by_slot()

    def refuse(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        raise MemoryError("injected")

    monkeypatch.setattr(id_index, "large_empty", refuse)
    monkeypatch.setattr(reference_id_index, "large_empty", refuse)
    more = torch.randint(-(2**40), 2**40, (50_000,), generator=gen)
    for index in (native, ref):
        log = UndoLog()
        with pytest.raises(MemoryError, match="injected"):
            index.get_or_insert(more, log)
        log.rollback()
    _same(native, ref, known, more)
    monkeypatch.undo()
    assert torch.equal(native.get_or_insert(more)[0], ref.get_or_insert(more)[0])


def test_native_home_is_the_python_hash() -> None:
    ids = torch.cat(
        [EXTREMES, torch.randint(-(2**63), 2**63 - 1, (10_000,), generator=torch.Generator().manual_seed(3))]
    )
    for bits in (1, 6, 20, 40):
        index = IdIndex.__new__(IdIndex)
        index._alloc(1 << min(bits, 12), fill=False)
        index._capacity, index._bits = 1 << bits, bits  # only the hash parameters are read
        out = np.empty(ids.numel(), dtype=np.int64)
        kernels.home(ids.numpy(), out, bits)
        assert torch.equal(torch.from_numpy(out), index._home(ids))


def test_index_memory_per_id() -> None:
    """4-byte entries at a load of 3/8 to 3/4 once grown by requests: 5.3 to 10.7 bytes of index per id (the
    16-byte (id, slot) entries at 1/8 to 1/4 took 64 to 128), and no per-entry scratch. An index on its own
    keeps its ids in a column of its own (8 bytes per slot); a table's index reads them in the table's records."""
    index = IdIndex(64)
    settled = []
    for chunk in torch.arange(300_000).split(13_312):
        index.insert_new(chunk)
        tensors = [v for v in vars(index).values() if isinstance(v, torch.Tensor)]
        storages = {index._table.untyped_storage().data_ptr(), index._own_keys.untyped_storage().data_ptr()}
        assert {t.untyped_storage().data_ptr() for t in tensors} == storages
        if index._old is None and index._next is None:  # not growing: only the one array
            settled.append(index._table.numel() * index._table.element_size() / len(index))
    assert len(settled) > 5 and all(16 / 3 <= per_id <= 32 / 3 for per_id in settled[2:]), settled
    keys = torch.arange(10, 20)
    table_index = IdIndex(64, keys=lambda: keys)  # a table's: the ids are where the table keeps them
    table_index.insert_new(keys.clone())
    assert table_index._own_keys is None and table_index.lookup(keys).tolist() == list(range(10))


# --------------------------------------------------------------------------- argument checks
def _entries(cap: int = 64) -> np.ndarray:
    return np.full(cap, -1, dtype=np.int32)


def test_kernels_check_their_buffers() -> None:
    ids = np.arange(4, dtype=np.int64)
    keys = np.arange(4, dtype=np.int64)
    out = np.empty(4, dtype=np.int64)
    with pytest.raises(TypeError, match="ids must hold int64"):
        kernels.lookup(_entries(), keys, ids.astype(np.int32), out, None)
    with pytest.raises(TypeError, match="ids must hold int64"):
        kernels.lookup(_entries(), keys, ids.astype(np.float64), out, None)
    with pytest.raises(ValueError, match="ids must be 1-D"):
        kernels.lookup(_entries(), keys, ids.reshape(2, 2), out, None)
    with pytest.raises(TypeError, match="C-contiguous"):
        kernels.lookup(_entries(), keys, np.arange(8, dtype=np.int64)[::2], out, None)
    with pytest.raises(TypeError, match="writable"):
        ro = out.copy()
        ro.flags.writeable = False
        kernels.lookup(_entries(), keys, ids, ro, None)
    with pytest.raises(ValueError, match="out has 3 entries for 4 ids"):
        kernels.lookup(_entries(), keys, ids, out[:3], None)
    with pytest.raises(ValueError, match="power-of-two"):
        kernels.lookup(_entries(48), keys, ids, out, None)
    with pytest.raises(TypeError, match="entries must hold int32"):
        kernels.lookup(np.full(64, -1, dtype=np.int64), keys, ids, out, None)
    with pytest.raises(ValueError, match="entries must be 1-D"):
        kernels.lookup(np.full((64, 2), -1, dtype=np.int32), keys, ids, out, None)
    with pytest.raises(TypeError, match="keys must hold int64"):
        kernels.lookup(_entries(), keys.astype(np.float64), ids, out, None)
    with pytest.raises(ValueError, match="keys must have rows of adjacent elements"):
        kernels.lookup(_entries(), np.arange(8, dtype=np.int64)[::-2], ids, out, None)
    with pytest.raises(TypeError, match="old entries"):
        kernels.lookup(_entries(), keys, ids, out, "not a buffer")
    with pytest.raises(TypeError):
        kernels.lookup(_entries(), keys, ids, out)  # an argument missing


def test_lookup_reads_strided_keys_and_passes_over_bad_slots() -> None:
    """The key column may be a strided field of a record array; an entry naming a slot past the keys is skipped."""
    records = np.zeros((8, 3), dtype=np.int64)
    records[:, 0] = np.arange(100, 108)
    table = _entries(16)
    pos, old = np.empty(8, dtype=np.int64), np.empty(8, dtype=np.int32)
    kernels.place(table, records[:, 0].copy(), np.arange(8, dtype=np.int64), pos, old)
    found = np.empty(9, dtype=np.int64)
    kernels.lookup(table, records[:, 0], np.arange(100, 109, dtype=np.int64), found, None)
    assert found.tolist() == [*range(8), -1]
    kernels.lookup(table, records[:4, 0], np.arange(100, 109, dtype=np.int64), found, None)  # slots 4..7 unreadable
    assert found.tolist() == [0, 1, 2, 3, -1, -1, -1, -1, -1]
    floats = records.view(np.float32)  # [8, 6]: words 2..5 are a row of 4 next to each id
    floats[:, 2:] = np.arange(32, dtype=np.float32).reshape(8, 4)
    rows_out = np.full((9, 4), -7, dtype=np.float32)
    ids = np.array([107, 100, 999, 103, 107, 101, 102, 104, 105], dtype=np.int64)
    kernels.lookup(table, records[:, 0], ids, found, None, floats[:, 2:], rows_out)
    assert found.tolist() == [7, 0, -1, 3, 7, 1, 2, 4, 5]
    assert np.array_equal(rows_out[found >= 0], floats[found[found >= 0], 2:]) and (rows_out[2] == -7).all()
    with pytest.raises(ValueError, match="rows_out has 3 rows for 9 ids"):
        kernels.lookup(table, records[:, 0], ids, found, None, floats[:, 2:], rows_out[:3])
    with pytest.raises(ValueError, match="rows_out without rows"):
        kernels.lookup(table, records[:, 0], ids, found, None, None, rows_out)
    with pytest.raises(ValueError, match="rows_out must be 2-D with the expected width"):
        kernels.lookup(table, records[:, 0], ids, found, None, floats[:, 2:], rows_out[:, :3].copy())
    kernels.lookup(table, records[:, 0], ids, found, None, floats[:3, 2:], rows_out)  # rows past 3: not copied
    assert found.tolist() == [7, 0, -1, 3, 7, 1, 2, 4, 5]


def test_place_is_all_or_nothing_and_checks_slots() -> None:
    table = _entries(8)
    before = table.copy()
    keys = np.arange(9, dtype=np.int64)  # one more than the entries
    pos, old = np.empty(9, dtype=np.int64), np.empty(9, dtype=np.int32)
    with pytest.raises(RuntimeError, match="full"):
        kernels.place(table, keys, keys.copy() % 8, pos, old)
    assert np.array_equal(table, before)
    with pytest.raises(ValueError, match="slot -1 .* outside 0 .. 7"):
        kernels.place(table, keys[:3], np.array([0, -1, 2], dtype=np.int64), pos[:3], old[:3])
    with pytest.raises(ValueError, match="slot 8 .* outside 0 .. 7"):  # would not fit next to the tag
        kernels.place(table, keys[:3], np.array([0, 8, 2], dtype=np.int64), pos[:3], old[:3])
    assert np.array_equal(table, before)
    with pytest.raises(ValueError, match="differ in length"):
        kernels.place(table, keys[:3], keys[:2], pos[:3], old[:3])
    kernels.place(table, keys[:8], keys[:8].copy(), pos[:8], old[:8])  # exactly full is fine
    found = np.empty(9, dtype=np.int64)
    kernels.lookup(table, keys, keys, found, None)  # a full table still answers, -1 for the absent
    assert found.tolist() == [*range(8), -1]


def test_gather_rows_checks_bounds_before_copying() -> None:
    rows = np.arange(40, dtype=np.float32).reshape(10, 4)
    out = np.zeros((3, 4), dtype=np.float32)
    kernels.gather_rows(rows, np.array([9, 0, 9], dtype=np.int64), 10, out)
    assert np.array_equal(out, rows[[9, 0, 9]])
    out[:] = 0
    for bad in (10, -1, 2**62):
        with pytest.raises(IndexError, match="outside the 10 live rows"):
            kernels.gather_rows(rows, np.array([1, bad, 2], dtype=np.int64), 10, out)
        assert not out.any()
    with pytest.raises(IndexError, match="outside the 5 live rows"):
        kernels.gather_rows(rows, np.array([5], dtype=np.int64), 5, out[:1])
    with pytest.raises(ValueError, match="live rows"):
        kernels.gather_rows(rows, np.array([1], dtype=np.int64), 11, out[:1])
    with pytest.raises(ValueError, match="out must be 2-D"):
        kernels.gather_rows(rows, np.array([1], dtype=np.int64), 10, np.zeros((1, 5), dtype=np.float32))
    with pytest.raises(TypeError, match="float32"):
        kernels.gather_rows(rows.astype(np.float64), np.array([1], dtype=np.int64), 10, out[:1])


def test_lookup_hands_back_the_misses_in_order() -> None:
    """With misses_out, the absent ids' positions (ascending) and whether those ids ascend strictly."""
    keys = np.arange(100, 108, dtype=np.int64)
    table = _entries(16)
    pos, old = np.empty(8, dtype=np.int64), np.empty(8, dtype=np.int32)
    kernels.place(table, keys.copy(), np.arange(8, dtype=np.int64), pos, old)
    found, misses = np.empty(7, dtype=np.int64), np.full(7, -9, dtype=np.int64)
    ids = np.array([5, 100, 7, 107, 9, 101, 11], dtype=np.int64)
    assert kernels.lookup(table, keys, ids, found, None, None, None, misses) == (4, True)
    assert misses[:4].tolist() == [0, 2, 4, 6] and found.tolist() == [-1, 0, -1, 7, -1, 1, -1]
    for absent in ([9, 100, 9], [9, 100, 5]):  # a repeat, a descent: not strictly ascending
        assert kernels.lookup(
            table, keys, np.array(absent, dtype=np.int64), found[:3], None, None, None, misses[:3]
        ) == (
            2,
            False,
        )
        assert misses[:2].tolist() == [0, 2]
    assert kernels.lookup(table, keys, keys, np.empty(8, dtype=np.int64), None) == (0, True)  # none absent
    with pytest.raises(ValueError, match="misses_out has 3 entries for 7 ids"):
        kernels.lookup(table, keys, ids, found, None, None, None, misses[:3])
    with pytest.raises(TypeError, match="misses_out must hold int64"):
        kernels.lookup(table, keys, ids, found, None, None, None, misses.astype(np.int32))


def test_scatter_rows_checks_positions_before_copying() -> None:
    src = np.arange(24, dtype=np.float32).reshape(6, 4)[::2]  # strided rows: 3 rows of 4, 8 apart
    out = np.zeros((5, 4), dtype=np.float32)
    kernels.scatter_rows(src, np.array([4, 0, 2], dtype=np.int64), out)
    assert np.array_equal(out[[4, 0, 2]], src) and not out[[1, 3]].any()
    out[:] = 0
    for bad in (5, -1, 2**62):
        with pytest.raises(IndexError, match="outside the 5 rows of out"):
            kernels.scatter_rows(src, np.array([1, 2, bad], dtype=np.int64), out)
        assert not out.any()
    with pytest.raises(ValueError, match="2 positions for 3 rows"):
        kernels.scatter_rows(src, np.array([1, 2], dtype=np.int64), out)
    with pytest.raises(ValueError, match="out must be 2-D"):
        kernels.scatter_rows(src, np.array([1, 2, 3], dtype=np.int64), np.zeros((5, 3), dtype=np.float32))
    with pytest.raises(TypeError, match="float32"):
        kernels.scatter_rows(src.astype(np.float64), np.array([1, 2, 3], dtype=np.int64), out)


def test_the_python_side_names_the_tensor_at_fault() -> None:
    index = IdIndex()
    with pytest.raises(ValueError, match="on the CPU"):
        index.lookup(torch.zeros(3, dtype=torch.int64, device="meta"))
    with pytest.raises(TypeError, match="torch.Tensor"):
        index.lookup([1, 2])  # type: ignore[arg-type]
    strided = torch.arange(20)[::2]  # not contiguous: as_ids makes it so
    assert index.lookup(strided).tolist() == [-1] * 10
