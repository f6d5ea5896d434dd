"""Several sharded tables in one exchange: their pulls (counts, ids, rows) and their steps (counts, gradients).

A ``fleet.nn.SparseFeatureCollection`` looks up every table of a CTR model in one forward
(DLRM: 8 to 26 of them), and one optimizer steps them all. One table at a time
(:class:`fleet.collective.sharded_rows.ShardedRows`), each pull costs three all-to-alls and each
step two, each a round trip among all the workers; together they cost three and two whatever
the number of tables (TorchRec's one input and one output exchange per step for all the features
of a sharding). :func:`fleet.sparse.backends.pull_many` and ``step_tables`` group the backends of
one process group (``batch_key``) and call :func:`pull_together` and :func:`step_together`.

Every worker sends each owner one block: table 0's part, then table 1's, ...; the counts
all-to-all says how many rows of each table (one column per table, and for a step one
non-finite flag per table). Tables may differ in width, so blocks travel flat and are cut back by
the same counts. A step's rows carry their id as two more float32 columns (its bits, never
computed on), and each owner applies each table's rows as :meth:`ShardedRows.step` would.

Why so few tensor operations: a worker's step is 256 samples, and its fixed cost per step and
table dominated (W6: a sharded worker spent as much CPU on 256 samples as one process on 512).
The ids are grouped once (by owner, then table: they come in table order, so one stable pass per
owner does it), blocks are gathered straight into the shared memory (no concatenation, no copy)
and read back as views, and the lockstep's announcement of a pull or a step is the first
exchange's meeting (:meth:`ShardedRows.exchange_pieces`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _group(
    backends: list[Any], ids: torch.Tensor, lengths: list[int]
) -> tuple[torch.Tensor, torch.Tensor, list[list[int]], list[int]]:
    """Group the concatenated ``ids`` of the tables (``lengths[t]`` each) by owner, then table, each table's
    ids in their order (one stable sort, over all the tables: one hash for all where every table of the group
    has the same owners, row-wise; else each table's owners, table-wise). Returns (the order that groups them; for each ``(owner j, table t)`` in that order,
    the positions of its ids within their table's, concatenated; ``[workers][tables]`` counts; the counts in that order, flat)."""
    first = backends[0]
    workers, tables = first.workers, len(lengths)
    lens = torch.tensor(lengths, dtype=torch.int64)
    table_of = torch.repeat_interleave(torch.arange(tables), lens, output_size=ids.numel())
    if first.same_owners:
        owners = first.owners(ids).cpu()
    else:
        owners = torch.cat([b.owners(part) for b, part in zip(backends, ids.split(lengths), strict=True)]).cpu()
    # the ids are in table order: sorting by owner alone, stably, groups them by owner, then table; with few
    # workers, one pass per worker finds its positions (a stable sort's result, without a sort)
    if workers <= 8:
        order = torch.cat([torch.nonzero(owners == j).view(-1) for j in range(workers)])
    else:
        order = torch.argsort(owners, stable=True)
    sends = torch.bincount(owners * tables + table_of, minlength=workers * tables)
    flat = sends.tolist()
    # a position in the ids of all tables, less where its table begins: its position in its table's ids
    begins = (torch.cumsum(lens, 0) - lens).repeat(workers)
    local = order - torch.repeat_interleave(begins, sends, output_size=ids.numel())
    return order, local, [flat[j * tables : (j + 1) * tables] for j in range(workers)], flat


def pull_together(
    backends: list[Any], ids_list: list[torch.Tensor], what: str, announce: Callable[[int], list[int]] | None = None
) -> list[torch.Tensor]:
    """Rows for each ``(backend, unique ids)``: :class:`~fleet.collective.sharded_rows.ShardedRows` of one group.
    ``announce``: the lockstep's announcement, made with the first exchange (its meeting, through shared memory)."""
    first = backends[0]
    workers, tables = first.workers, len(backends)
    dims = [b.shard.embedding_dim for b in backends]
    lengths = [ids.numel() for ids in ids_list]
    ids = torch.cat(ids_list).cpu()
    order, local, sends, flat = _group(backends, ids, lengths)
    # one exchange carries each table's counts (the header) and the ids: owner 0's (table 0's, table 1's, ...),
    # then owner 1's, gathered straight into the send
    asked, got, _ = first.exchange_pieces(
        [(ids, order)],
        [sum(row) for row in sends],
        torch.tensor(sends, dtype=torch.int64),
        None,
        ids.dtype,
        what,
        announce,
    )
    assert got is not None
    # requester i's block: table 0's ids, then table 1's ...; each table's share, requesters in order, at once
    at = [0] * workers
    found = []
    for t, backend in enumerate(backends):
        parts = []
        for i in range(workers):
            parts.append(asked[i][at[i] : at[i] + got[i][t]])
            at[i] += got[i][t]
        found.append(backend.local.pull(torch.cat(parts)))
    # the reply: for each requester, its rows of table 0, then table 1's ...: written straight into the send
    starts = [0] * tables
    reply = []
    for i in range(workers):
        for t in range(tables):
            reply.append(found[t][starts[t] : starts[t] + got[i][t]])
            starts[t] += got[i][t]
    sizes = [sum(n * d for n, d in zip(row, dims, strict=True)) for row in got]
    recv = [sum(n * d for n, d in zip(row, dims, strict=True)) for row in sends]
    back, _, _ = first.exchange_pieces(reply, sizes, None, recv, found[0].dtype, what)
    # owner j's block holds table 0's rows, then table 1's ...: each into its ids' positions (on the rows' device:
    # across hosts with CUDA tensors the exchange's result is there)
    positions = local.to(back[0].device).split(flat)  # (owner j, table t): positions in table t's ids, as sent
    out = [back[0].new_empty(n, d) for n, d in zip(lengths, dims, strict=True)]
    for j in range(workers):
        at_j = 0
        for t in range(tables):
            n = sends[j][t]
            if n:
                rows = back[j][at_j : at_j + n * dims[t]].view(n, dims[t])
                out[t].index_copy_(0, positions[j * tables + t], rows)
            at_j += n * dims[t]
    return [rows.to(ids_t.device) for rows, ids_t in zip(out, ids_list, strict=True)]


def step_together(
    items: list[tuple[Any, dict[str, Any]]],
    optimizer_class: type,
    what: str,
    announce: Callable[[int], list[int]] | None = None,
) -> None:
    """Step each ``(backend, param group)``: every table's gradients to their owners in one exchange (which
    ``announce``, the lockstep's announcement, comes with, as in :func:`pull_together`)."""
    first = items[0][0]
    workers, tables = first.workers, len(items)
    parts = [backend.gradients(group) for backend, group in items]  # (ids, block [n, width + 2], lr, finite)
    widths = [block.shape[1] for _, block, _, _ in parts]
    lengths = [ids.numel() for ids, _, _, _ in parts]
    _, local, sends, flat = _group(
        [backend for backend, _ in items], torch.cat([ids for ids, _, _, _ in parts]).cpu(), lengths
    )
    positions = local.split(flat)
    blocks = [block.cpu() for _, block, _, _ in parts]
    bad = [0 if finite else 1 for *_, finite in parts]
    # owner j's block: table 0's rows (flat), then table 1's ...: each gathered straight into the send
    pieces = [(blocks[t], positions[j * tables + t]) for j in range(workers) for t in range(tables)]
    sizes = [sum(n * w for n, w in zip(row, widths, strict=True)) for row in sends]
    # one exchange carries each table's counts and non-finite flag (the header) and the gradients
    back, header, _ = first.exchange_pieces(
        pieces,
        sizes,
        torch.tensor([row + bad for row in sends], dtype=torch.int64),
        None,
        torch.float32,
        what,
        announce,
    )
    assert header is not None
    any_bad = [any(row[tables + t] for row in header) for t in range(tables)]
    # every table's rows copied out of the exchange before any is applied (the views last until the next one)
    at = [0] * workers
    received = []
    for t, width in enumerate(widths):
        rows = []
        for i in range(workers):
            n = header[i][t] * width
            rows.append(back[i][at[i] : at[i] + n].view(-1, width))
            at[i] += n
        received.append(torch.cat(rows))
    for t, (backend, group) in enumerate(items):
        backend.apply_received(optimizer_class, group, received[t], parts[t][2], any_bad[t])
