"""The variable-sized all-to-all under sharded tables (fleet.collective.all_to_all), with gloo's all_to_all_single
and with the all-gather form a backend without it gets; the owner hash; what sharded tables refuse."""

from __future__ import annotations

import os

import pytest
import torch

from dist_harness import run_workers


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
