"""The variable-sized all-to-all under sharded tables (fleet.collective.all_to_all), with gloo's all_to_all_single
and with the all-gather form a backend without it gets; the owner hash; what sharded tables refuse."""

from __future__ import annotations

import os

import pytest
import torch

from dist_harness import run_workers
from fleet.collective import shm

needs_shm = pytest.mark.skipif(not shm.supported(), reason="the shared-memory path needs x86-64 and /dev/shm")


def _blocks(rank: int, workers: int) -> tuple[torch.Tensor, list[int]]:
    """Rank ``rank``'s rows for each worker ``j``: ``rank + j + 1`` rows of ``10 * rank + j``, 3 wide."""
    sizes = [rank + j + 1 for j in range(workers)]
    rows = torch.cat([torch.full((n, 3), float(10 * rank + j)) for j, n in enumerate(sizes)])
    return rows, sizes


def exchange_worker(rank: int, fallback: bool) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    from fleet.collective import all_to_all

    workers = int(os.environ["FLEET_WORKER_NUM"])
    dist.init_process_group("gloo", init_method="tcp://" + os.environ["FLEET_MASTER"], rank=rank, world_size=workers)
    group = dist.group.WORLD
    if fallback:  # as if gloo had no all_to_all_single
        all_to_all._NO_ALL_TO_ALL.add(id(group))
    rows, sizes = _blocks(rank, workers)
    counts = all_to_all.counts(torch.tensor([[n, rank] for n in sizes]), group, 30.0, "test")
    got = all_to_all.rows(rows, sizes, counts[:, 0].tolist(), group, 30.0, "test")
    dist.destroy_process_group()
    return {"counts": counts, "rows": got}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("fallback", [False, True], ids=["all_to_all_single", "all_gather"])
def test_variable_blocks_reach_their_workers(workers: int, fallback: bool) -> None:
    for rank, result in enumerate(run_workers(exchange_worker, workers, fallback, timeout=90)):
        want_counts = torch.tensor([[i + rank + 1, i] for i in range(workers)])
        assert torch.equal(result["counts"], want_counts)
        want = torch.cat([torch.full((i + rank + 1, 3), float(10 * i + rank)) for i in range(workers)])
        assert torch.equal(result["rows"], want)


def test_owners_spread_ids_evenly_whatever_their_stride() -> None:
    from fleet.collective.sharded_rows import owner

    for ids in (torch.arange(30_000), torch.arange(30_000) * 6, torch.arange(30_000) << 40, -torch.arange(30_000)):
        for workers in (2, 3, 8):
            owners = owner(ids, workers)
            assert int(owners.min()) >= 0 and int(owners.max()) < workers
            share = torch.bincount(owners, minlength=workers).double() / ids.numel()
            assert float((share - 1 / workers).abs().max()) < 0.02, (workers, share)
    ids = torch.tensor([5, -7, 2**62, -(2**63)])
    assert torch.equal(owner(ids, 3), owner(ids.clone(), 3))  # a function of the id alone


def _grouped_by_torch(ids: torch.Tensor, lengths: list[int], workers: int) -> tuple:
    """What sharded_many._group computes, in torch: a stable sort by owner, counts per (owner, table)."""
    from fleet.collective.sharded_rows import owner

    tables, lens = len(lengths), torch.tensor(lengths, dtype=torch.int64)
    table_of = torch.repeat_interleave(torch.arange(tables), lens)
    owners = owner(ids, workers)
    order = torch.argsort(owners, stable=True)
    flat = torch.bincount(owners * tables + table_of, minlength=workers * tables).tolist()
    local = order - (torch.cumsum(lens, 0) - lens)[table_of[order]]
    return order, local, [flat[j * tables : (j + 1) * tables] for j in range(workers)], flat


@pytest.mark.parametrize("workers", [1, 2, 3, 4, 7, 8, 64])
@pytest.mark.parametrize("lengths", [[0], [1], [5, 0, 7], [2000, 0, 1500, 1200, 800, 3]])
def test_grouping_by_owner_is_a_stable_sort_by_the_owner_of_each_id(workers: int, lengths: list[int]) -> None:
    from types import SimpleNamespace

    from fleet.collective import sharded_many

    g = torch.Generator().manual_seed(workers * 100 + len(lengths))
    ids = torch.randint(-(2**62), 2**62, (sum(lengths),), generator=g)
    ids[::3] = torch.randint(-50, 50, ids[::3].shape, generator=g)  # small ids and repeats too
    got = sharded_many._group([SimpleNamespace(workers=workers, same_owners=True)], ids, lengths)
    want = _grouped_by_torch(ids, lengths, workers)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[2:] == want[2:]


def test_the_grouping_kernel_refuses_what_does_not_add_up() -> None:
    from fleet.sparse.native import kernels

    def call(ids, lengths, workers=2, n=None, counts=None):
        n = len(ids) if n is None else n
        out = [torch.empty(n, dtype=torch.int64).numpy() for _ in range(2)]
        counts = torch.empty(workers * len(lengths) if counts is None else counts, dtype=torch.int64).numpy()
        kernels.group_by_owner(ids.numpy(), torch.tensor(lengths, dtype=torch.int64).numpy(), workers, *out, counts)

    ids = torch.arange(10)
    call(ids, [4, 6])
    with pytest.raises(ValueError, match="add up to 9, not the 10 ids"):
        call(ids, [4, 5])
    with pytest.raises(ValueError, match="do not add up"):
        call(ids, [11, -1])
    with pytest.raises(ValueError, match="0 workers"):
        call(ids, [10], workers=0)
    with pytest.raises(ValueError, match="order_out and local_out need 10"):
        call(ids, [10], n=9)
    with pytest.raises(ValueError, match="counts_out needs 4"):
        call(ids, [4, 6], counts=3)
    with pytest.raises(TypeError, match="ids must hold int64"):
        call(ids.int(), [10])


def test_ids_read_back_from_their_columns_even_one_row_at_an_odd_offset() -> None:
    """A gradient of odd width (dim 4 and a clicks column) and one row: its id columns start at an odd float
    offset, where no int64 view of them exists (an owner that received one row of a table once failed so)."""
    from fleet.collective.sharded_many import id_bits, with_id_bits

    ids = torch.tensor([123456789012345, -5, 2**63 - 1])
    block = with_id_bits(torch.randn(3, 5), ids)
    assert torch.equal(id_bits(block), ids)
    for i in range(3):
        assert torch.equal(id_bits(block[i : i + 1]), ids[i : i + 1])
    shifted = torch.cat([torch.zeros(1), block.reshape(-1)])[1:].view(3, 7)  # as a view of an exchange's buffer
    assert torch.equal(id_bits(shifted[1:2]), ids[1:2])


def test_a_cap_is_split_over_the_workers_and_refused_below_one_row_each() -> None:
    import fleet
    from fleet.collective.sharded_rows import TableShard

    shard = TableShard(fleet.nn.SparseEmbedding(4, max_rows=1000, ttl_steps=5), 3)
    assert shard.lifecycle.max_rows == 333 and shard.lifecycle.ttl_steps == 5
    with pytest.raises(ValueError, match=r"max_rows=2\) is sharded across 3 workers"):
        TableShard(fleet.nn.SparseEmbedding(4, max_rows=2), 3)


def test_table_placement_is_validated_by_the_strategy() -> None:
    import fleet

    assert fleet.DistributedStrategy().table_placement == "auto"
    assert fleet.DistributedStrategy(mode="collective", table_placement="sharded").table_placement == "sharded"
    with pytest.raises(fleet.StrategyError, match="servers hold them"):
        fleet.DistributedStrategy(mode="ps", table_placement="sharded")
    with pytest.raises(fleet.StrategyError, match="table_placement"):
        fleet.DistributedStrategy(table_placement="rowwise")


def test_auto_shards_in_sharding_mode_but_keeps_a_capped_table_replicated() -> None:
    import fleet
    from fleet.collective.sharded_rows import shards

    plain, capped = fleet.nn.SparseEmbedding(4), fleet.nn.SparseEmbedding(4, max_rows=100)
    assert shards("auto", True, plain) and not shards("auto", True, capped)  # mode="sharding"
    assert not shards("auto", False, plain)  # mode="collective"
    assert shards("sharded", False, capped) and not shards("replicated", True, plain)


# --------------------------------------------------------------------------- through shared memory (one host)


def _shared(world: int, timeout_s: float = 20.0) -> tuple[list, str]:
    """``world`` workers' all-to-alls over one channel table, as threads of this process (a fresh token)."""
    import secrets
    import types

    from fleet.collective.all_to_all import SharedMemoryAllToAll

    table = torch.zeros(shm.Channel.numel(world, shm.LocalHost.TABLES_WIDTH), dtype=torch.int64)
    token = f"fleet-test-a2a-{secrets.token_hex(6)}"
    hosts = [
        types.SimpleNamespace(
            rank=r, world=world, token=token, tables=shm.Channel(table, r, world, shm.LocalHost.TABLES_WIDTH, timeout_s)
        )
        for r in range(world)
    ]
    return [SharedMemoryAllToAll(h) for h in hosts], token


def _on_threads(world: int, fn) -> list:
    import threading

    out: list = [None] * world

    def run(rank: int) -> None:
        try:
            out[rank] = fn(rank)
        except BaseException as error:  # noqa: BLE001 - handed to the test's thread
            out[rank] = error

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "an exchange hung"
    return out


def _round_sizes(step: int, src: int, dst: int) -> int:
    """Uneven, often empty, growing past the first segments (the last rounds move ~100 k elements a block)."""
    if (src + dst + step) % 3 == 0:
        return 0
    return (src + 1) * (dst + 2) * (1 + step) ** 4 * 7


@needs_shm
@pytest.mark.parametrize("world", [2, 3])
def test_shared_memory_all_to_all_moves_uneven_and_empty_blocks_with_their_headers(world: int) -> None:
    import glob

    exchangers, token = _shared(world)
    steps = 7

    def worker(rank: int) -> list:
        got = []
        for step in range(steps):
            sizes = [_round_sizes(step, rank, j) for j in range(world)]
            dtype = torch.int64 if step % 2 else torch.float32
            send = torch.cat([torch.arange(n, dtype=dtype) + 1000 * (10 * rank + j) for j, n in enumerate(sizes)])
            header = torch.tensor([[rank, j, step] for j in range(world)])
            got.append(exchangers[rank].exchange(send, header, sizes, "test"))
        exchangers[rank].exchange(torch.empty(0), torch.empty(world, 0, dtype=torch.int64), [0] * world, "test")
        return got

    results = _on_threads(world, worker)
    for rank, got in enumerate(results):
        assert not isinstance(got, BaseException), got
        for step, (rows, header, sizes) in enumerate(got):
            dtype = torch.int64 if step % 2 else torch.float32
            want_sizes = [_round_sizes(step, i, rank) for i in range(world)]
            want = torch.cat([torch.arange(n, dtype=dtype) + 1000 * (10 * i + rank) for i, n in enumerate(want_sizes)])
            assert sizes == want_sizes
            assert rows.dtype == dtype and torch.equal(rows, want), (rank, step)
            assert torch.equal(header, torch.tensor([[i, rank, step] for i in range(world)]))
    assert exchangers[0]._generation > 1  # the segments grew on the way
    for exchanger in exchangers:
        exchanger.close()
    assert not glob.glob(f"{shm.SHM_DIR}/{token}-*")  # every name removed once mapped


@needs_shm
def test_shared_memory_refused_on_one_worker_sends_every_worker_to_the_process_group() -> None:
    exchangers, _ = _shared(3)
    exchangers[1]._refused = OSError("No space left on device")  # /dev/shm full there

    def worker(rank: int) -> object:
        return exchangers[rank].exchange(torch.ones(3), torch.zeros(3, 1, dtype=torch.int64), [1, 1, 1], "test")

    assert _on_threads(3, worker) == [None, None, None]
    assert not any(e.usable for e in exchangers)
    for exchanger in exchangers:
        exchanger.close()


@needs_shm
def test_shared_memory_all_to_all_names_a_dead_peer_not_a_hang() -> None:
    import subprocess
    import sys
    import time

    from fleet.errors import PeerError

    exchangers, _ = _shared(2, timeout_s=60.0)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    exchangers[0].channel.table[1, 1] = dead.pid  # worker 1 joined, then its process ended
    started = time.monotonic()
    with pytest.raises(PeerError, match="pulling rows failed: worker 1 died"):
        exchangers[0].exchange(torch.ones(2), torch.zeros(2, 0, dtype=torch.int64), [1, 1], "pulling rows")
    assert time.monotonic() - started < 30  # named within about a second, long before the 60 s wait
    exchangers[0].close()
