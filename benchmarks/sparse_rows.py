"""Sparse-table rows: memory per row, and max_rows held on a stream of 20 M distinct ids.

    python benchmarks/sparse_rows.py [--rows 2000000] [--stream 20000000] [--max-rows 1000000]

Memory: for SGD, Adagrad, row-wise Adagrad (one accumulator per row) and Adam rows of dim 16, without and with a life cycle, one
process per table creates ``--rows`` rows through updates (as training does) and reports
(RSS after - RSS before) / rows, next to the bytes the table's own tensors hold per row
(rows, optimizer state, per-row step, statistics, id index) at that fill. Capacity grows
by doubling, so the measured figure depends on where the fill sits between two doublings.

Cap: a table with ``max_rows`` takes batches of 13,312 ids (512 x 26), each with 3,000
ids never seen before, until ``--stream`` distinct ids went by; after every batch it
checks that the table holds at most ``max_rows`` rows, and reports the time per batch
(median and worst: an eviction pass compacts the table) and the rows evicted.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from _common import record_result

from fleet.sparse.lifecycle import CountFilterEntry, LifeCycle
from fleet.sparse.optim import OptimizerSpec
from fleet.sparse.table import SparseTable

DIM, BATCH, NEW_PER_BATCH = 16, 512 * 26, 3_000
KINDS = ("sgd", "adagrad", "rowwise_adagrad", "adam")


def _rss() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _malloc_trim() -> None:
    """Hand the C allocator's free memory back to the system (glibc), so that RSS counts what is in use.

    Why both figures: glibc keeps up to 64 MiB of freed memory (its dynamic trim threshold, raised by
    the large temporaries of big requests) for the next requests of the same size -- a per-process
    constant, not a per-row cost (32 B/row at 2 M rows, 3 at 20 M).
    """
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: the RSS figures are then the same


def _tensor_bytes(table: SparseTable) -> int:
    """Bytes of every per-row tensor the table holds, at its capacity (reserved but unwritten rows included)."""
    tensors = [table._records]  # records: ids, rows, state, steps, statistics (and flags)
    if table._dirty.untyped_storage().data_ptr() != table._records.untyped_storage().data_ptr():
        tensors.append(table._dirty)  # the changed-since-save flags, where the records had no room
    index = table._index
    for arrays in (index, index._old, index._next):  # the id index, and its other arrays while it grows
        if arrays is not None:
            tensors.append(arrays._table)
    return sum(t.numel() * t.element_size() for t in tensors)


def memory_child(kind: str, life: bool, rows: int) -> dict:
    torch.set_num_threads(1)
    lifecycle = LifeCycle(entry=CountFilterEntry(1), ttl_steps=10**9) if life else None
    table = SparseTable(DIM, OptimizerSpec(kind=kind, lr=0.01), lifecycle=lifecycle)
    ids = torch.randperm(rows * 4)[:rows] * 7 + 1
    grads = torch.randn(BATCH * 8, DIM)
    before = _rss()
    for chunk in ids.split(BATCH * 8):
        table.apply_gradient(chunk, grads[: chunk.numel()], 0.01)
    measured = (_rss() - before) / rows
    _malloc_trim()
    in_use = (_rss() - before) / rows
    return {
        "optimizer": kind,
        "life_cycle": life,
        "rows": len(table),
        "rss_bytes_per_row": round(measured, 1),
        "rss_in_use_bytes_per_row": round(in_use, 1),
        "tensor_bytes_per_row": round(_tensor_bytes(table) / rows, 1),
        "state_tensors": sorted(table._state),
    }


def cap_stream(distinct: int, max_rows: int) -> dict:
    torch.set_num_threads(1)
    table = SparseTable(DIM, OptimizerSpec(kind="adagrad", lr=0.01), lifecycle=LifeCycle(max_rows=max_rows))
    gen = torch.Generator().manual_seed(0)
    grads = torch.randn(BATCH, DIM, generator=gen)
    hot = torch.arange(1, 200_001)  # seen again and again: the rows a cap should keep
    seen, most, times = 0, 0, []
    next_new = 10**9
    while seen < distinct:
        fresh = torch.arange(next_new, next_new + NEW_PER_BATCH)
        next_new += NEW_PER_BATCH
        ids = torch.cat([hot[torch.randint(0, hot.numel(), (BATCH - NEW_PER_BATCH,), generator=gen)], fresh])
        t0 = time.perf_counter()
        table.apply_gradient(ids, grads, 0.01)
        times.append(time.perf_counter() - t0)
        most = max(most, len(table))
        assert len(table) <= max_rows, f"{len(table)} rows > max_rows {max_rows}"
        seen = next_new - 10**9 + hot.numel()
    kept_hot = int((table._index.lookup(hot) >= 0).sum())
    return {
        "distinct_ids": seen,
        "max_rows": max_rows,
        "most_rows_held": most,
        "batches": len(times),
        "median_ms": round(statistics.median(times) * 1e3, 2),
        "worst_ms": round(max(times) * 1e3, 1),
        "evicted": table.counts["evicted"],
        "hot_rows_kept": f"{kept_hot} of {hot.numel()}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--stream", type=int, default=20_000_000)
    parser.add_argument("--max-rows", type=int, default=1_000_000)
    parser.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(memory_child(args.child[0], args.child[1] == "life", args.rows)))
        return
    print(f"Row memory, dim {DIM}, {args.rows:,} rows created by updates (one process each):")
    print("| optimizer | life cycle | RSS bytes/row | table tensors bytes/row | optimizer state |")
    print("|---|---|---|---|---|")
    rows: dict[str, dict] = {}
    for kind in KINDS:
        for life in ("plain", "life"):
            cmd = [sys.executable, __file__, "--rows", str(args.rows), "--child", kind, life]
            r = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
            rows[f"{kind} {life}"] = r
            print(
                f"| {kind} | {'yes' if r['life_cycle'] else 'no'} | {r['rss_bytes_per_row']} | "
                f"{r['tensor_bytes_per_row']} | {', '.join(r['state_tensors']) or '-'} |",
                flush=True,
            )
    in_use = ", ".join(
        f"{k} {rows[f'{k} plain']['rss_in_use_bytes_per_row']:.0f} (life cycle {rows[f'{k} life']['rss_in_use_bytes_per_row']:.0f})"
        for k in KINDS
    )
    print(f"RSS bytes/row in use (after malloc_trim: without the allocator's free memory): {in_use}")
    r = cap_stream(args.stream, args.max_rows)
    print(f"\nmax_rows={args.max_rows:,} on a stream of {r['distinct_ids']:,} distinct ids ({r['batches']:,} batches):")
    print(f"  most rows held: {r['most_rows_held']:,} (never above max_rows); evicted {r['evicted']:,}")
    print(
        f"  per batch: median {r['median_ms']} ms, worst {r['worst_ms']} ms (an eviction pass); hot {r['hot_rows_kept']}"
    )
    rss = {k: rows[f"{k} plain"]["rss_bytes_per_row"] for k in KINDS}
    tensors = {k: rows[f"{k} plain"]["tensor_bytes_per_row"] for k in KINDS}
    life_extra = rows["sgd life"]["tensor_bytes_per_row"] - tensors["sgd"]
    record_result(
        "sparse_rows",
        variant=f"dim {DIM}, {args.rows:,} rows",
        figure=f"bytes per sparse row, dim {DIM}, {args.rows:,} rows (RSS, index and capacity slack included): "
        "SGD / Adagrad / row-wise Adagrad / Adam",
        units="B/row",
        fleet=rss["sgd"],
        peer="the table's own tensors",
        peer_value=tensors["sgd"],
        target="documented; never above max_rows",
        summary=f"{rss['sgd']:.0f} / {rss['adagrad']:.0f} / {rss['rowwise_adagrad']:.0f} / {rss['adam']:.0f} B per row "
        f"(SGD / Adagrad / row-wise Adagrad / Adam; the table's tensors {tensors['sgd']:.0f} / {tensors['adagrad']:.0f} "
        f"/ {tensors['rowwise_adagrad']:.0f} / {tensors['adam']:.0f} B; a life cycle adds "
        f"{life_extra:.0f} B); "
        f"max_rows={args.max_rows:,} held at most {r['most_rows_held']:,} rows",
        details={"rows": rows, "max_rows_stream": r},
    )


if __name__ == "__main__":
    main()
