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
"""

from __future__ import annotations

from typing import Any

import torch


def pull_together(backends: list[Any], ids_list: list[torch.Tensor], what: str) -> list[torch.Tensor]:
    """Rows for each ``(backend, unique ids)``: :class:`~fleet.collective.sharded_rows.ShardedRows` of one group."""
    first = backends[0]
    workers, tables = first.workers, len(backends)
    dims = [b.shard.embedding_dim for b in backends]
    lengths = [ids.numel() for ids in ids_list]
    ids = torch.cat(ids_list)
    table_of = torch.repeat_interleave(torch.arange(tables), torch.tensor(lengths)).to(ids.device)
    # grouped by owner, then table; within a table each owner's ids keep their order (a stable sort). Every table
    # of the group has the same owners (one hash for all: fewer operations than one per table)
    tag = first.owners(ids) * tables + table_of
    order = torch.argsort(tag, stable=True)
    sends = torch.bincount(tag, minlength=workers * tables).view(workers, tables).cpu()  # [workers, tables]
    # one exchange carries each table's counts (the header) and the ids
    asked, got, _ = first.exchange(ids.index_select(0, order), sends.sum(1).tolist(), sends, None, what)
    assert got is not None
    # the asked ids, grouped by requester then table: regrouped by table, each table's share looks its own up at once
    asked_tag = torch.arange(tables).repeat(workers).repeat_interleave(got.reshape(-1))
    by_table = asked.index_select(0, torch.argsort(asked_tag, stable=True)).split(got.sum(0).tolist())
    found = [b.local.pull(part) for b, part in zip(backends, by_table, strict=True)]
    # requester i's rows of table t: found[t][starts[i, t] : starts[i, t] + got[i, t]] (requesters in order)
    starts = (torch.cumsum(got, 0) - got).tolist()
    counts = got.tolist()
    reply = torch.cat(
        [
            found[t][starts[i][t] : starts[i][t] + counts[i][t]].reshape(-1)
            for i in range(workers)
            for t in range(tables)
        ]
    )
    widths = torch.tensor(dims, dtype=torch.int64)
    back, _, _ = first.exchange(reply, (got * widths).sum(1).tolist(), None, (sends * widths).sum(1).tolist(), what)
    pieces = _cut(back, sends, dims)  # owner j's block holds table 0's rows, then table 1's ...
    # where each table's rows (in the order sent: by owner, ids' order kept) go: its ids' positions, by table
    placed_at = order.index_select(0, torch.argsort(table_of.index_select(0, order), stable=True)).split(lengths)
    out = []
    begin = 0
    for t, ids_t in enumerate(ids_list):
        rows = torch.cat(pieces[t]).to(ids_t.device) if pieces[t] else back.new_empty(0, dims[t])
        placed = torch.empty_like(rows)
        placed[(placed_at[t] - begin).to(rows.device)] = rows
        out.append(placed)
        begin += lengths[t]
    return out


def step_together(items: list[tuple[Any, dict[str, Any]]], optimizer_class: type, what: str) -> None:
    """Step each ``(backend, param group)``: every table's gradients to their owners in one exchange."""
    first = items[0][0]
    workers, tables = first.workers, len(items)
    parts = [backend.gradients(group) for backend, group in items]  # (ids, block [n, width + 2], lr, finite)
    widths = [block.shape[1] for _, block, _, _ in parts]
    lengths = [ids.numel() for ids, _, _, _ in parts]
    owners = first.owners(torch.cat([ids for ids, _, _, _ in parts])).split(lengths)  # one hash for all tables
    sends = torch.stack([torch.bincount(o, minlength=workers) for o in owners], 1).cpu()  # [workers, tables]
    bad = torch.tensor([[0 if finite else 1 for *_, finite in parts]] * workers, dtype=torch.int64)
    blocks = []  # owner j's block: table 0's rows (flat), then table 1's ...
    orders = [torch.argsort(o, stable=True) for o in owners]
    sorted_blocks = [
        block.index_select(0, order.to(block.device)) for (_, block, _, _), order in zip(parts, orders, strict=True)
    ]
    starts, counts = (torch.cumsum(sends, 0) - sends).tolist(), sends.tolist()
    for j in range(workers):
        for t in range(tables):
            blocks.append(sorted_blocks[t][starts[j][t] : starts[j][t] + counts[j][t]].reshape(-1))
    w = torch.tensor(widths, dtype=torch.int64)
    # one exchange carries each table's counts and non-finite flag (the header) and the gradients
    back, header, _ = first.exchange(
        torch.cat(blocks), (sends * w).sum(1).tolist(), torch.cat([sends, bad], 1), None, what
    )
    assert header is not None
    got, any_bad = header[:, :tables], header[:, tables:].any(0).tolist()
    received = _cut(back, got, widths)
    for t, (backend, group) in enumerate(items):
        backend.apply_received(optimizer_class, group, torch.cat(received[t]), parts[t][2], bool(any_bad[t]))


def _cut(flat: torch.Tensor, counts: torch.Tensor, widths: list[int]) -> list[list[torch.Tensor]]:
    """Per table, the rows of each worker's block of ``flat``: worker j's block holds ``counts[j, 0]`` rows of
    table 0 (``widths[0]`` values each), then table 1's ..., in worker order."""
    pieces: list[list[torch.Tensor]] = [[] for _ in widths]
    at = 0
    for row in counts.tolist():
        for t, width in enumerate(widths):
            n = row[t] * width
            pieces[t].append(flat[at : at + n].view(-1, width))
            at += n
    return pieces
