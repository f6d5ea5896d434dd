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
    owners = [b.owners(ids) for b, ids in zip(backends, ids_list, strict=True)]
    sends = torch.stack([torch.bincount(o, minlength=workers) for o in owners], 1)  # [workers, tables]
    # grouped by owner, then table; within a table each owner's ids keep their order (a stable sort)
    tag = torch.cat([o * tables + t for t, o in enumerate(owners)])
    order = torch.argsort(tag, stable=True)
    # one exchange carries each table's counts (the header) and the ids
    asked, got, _ = first.exchange(torch.cat(ids_list).index_select(0, order), sends.sum(1).tolist(), sends, None, what)
    assert got is not None
    # the asked ids, grouped by requester then table: each table's share looks its own up at once
    asked_tag = torch.arange(tables).repeat(workers).repeat_interleave(got.reshape(-1))
    found = [b.local.pull(asked[asked_tag == t]) for t, b in enumerate(backends)]
    starts = torch.cumsum(got, 0) - got  # where requester i's rows of table t begin in found[t]
    reply = torch.cat(
        [
            found[t][int(starts[i, t]) : int(starts[i, t] + got[i, t])].reshape(-1)
            for i in range(workers)
            for t in range(tables)
        ]
    )
    widths = torch.tensor(dims, dtype=torch.int64)
    back, _, _ = first.exchange(reply, (got * widths).sum(1).tolist(), None, (sends * widths).sum(1).tolist(), what)
    pieces = _cut(back, sends, dims)  # owner j's block holds table 0's rows, then table 1's ...
    out = []
    for t, ids in enumerate(ids_list):
        rows = torch.cat(pieces[t]).to(ids.device) if pieces[t] else back.new_empty(0, dims[t])
        placed = torch.empty_like(rows)
        placed[torch.argsort(owners[t], stable=True).to(rows.device)] = rows
        out.append(placed)
    return out


def step_together(items: list[tuple[Any, dict[str, Any]]], optimizer_class: type, what: str) -> None:
    """Step each ``(backend, param group)``: every table's gradients to their owners in one exchange."""
    first = items[0][0]
    workers, tables = first.workers, len(items)
    parts = [backend.gradients(group) for backend, group in items]  # (ids, block [n, width + 2], lr, finite)
    widths = [block.shape[1] for _, block, _, _ in parts]
    owners = [backend.owners(ids) for (backend, _), (ids, _, _, _) in zip(items, parts, strict=True)]
    sends = torch.stack([torch.bincount(o, minlength=workers) for o in owners], 1)  # [workers, tables]
    bad = torch.tensor([[0 if finite else 1 for *_, finite in parts]] * workers, dtype=torch.int64)
    blocks = []  # owner j's block: table 0's rows (flat), then table 1's ...
    orders = [torch.argsort(o, stable=True) for o in owners]
    sorted_blocks = [
        block.index_select(0, order.to(block.device)) for (_, block, _, _), order in zip(parts, orders, strict=True)
    ]
    starts = torch.cumsum(sends, 0) - sends
    for j in range(workers):
        for t in range(tables):
            blocks.append(sorted_blocks[t][int(starts[j, t]) : int(starts[j, t] + sends[j, t])].reshape(-1))
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
    for j in range(counts.shape[0]):
        for t, width in enumerate(widths):
            n = int(counts[j, t]) * width
            pieces[t].append(flat[at : at + n].view(-1, width))
            at += n
    return pieces
