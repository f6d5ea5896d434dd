"""Several sharded tables' rows pulled in one exchange: one all-to-all of counts, of ids and of rows for all.

A ``fleet.nn.SparseFeatureCollection`` looks up every table of a CTR model in one forward
(DLRM: 8 to 26 of them). Pulled one table at a time
(:meth:`fleet.collective.sharded_rows.ShardedRows.pull`), each costs three all-to-alls, each a
round trip among all the workers; together (through :func:`fleet.sparse.backends.pull_many`,
which groups backends by ``batch_key``) they cost three whatever the number of tables,
TorchRec's one input and one output exchange per step for all features of a sharding.

Every worker sends each owner, in one block, the ids of table 0 it owns, then table 1's, ...;
the counts all-to-all says how many of each table (one column per table). The owner looks each
table's ids up in that table's share, and replies with one flat block per requester: table 0's
rows, then table 1's (tables may differ in width), which the requester cuts back by the same
counts.
"""

from __future__ import annotations

from typing import Any

import torch

from fleet.collective import all_to_all


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
    header = torch.cat([sends, torch.zeros(workers, 1, dtype=torch.int64)], 1).to(first.device)
    got = all_to_all.counts(header, first.group, first.timeout_s, what, first.diagnose)[:, :tables].cpu()
    asked = all_to_all.rows(
        torch.cat(ids_list).index_select(0, order).to(first.device),
        sends.sum(1).tolist(),
        got.sum(1).tolist(),
        first.group,
        first.timeout_s,
        what,
        first.diagnose,
    ).cpu()
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
    back = all_to_all.rows(
        reply.to(first.device),
        (got * widths).sum(1).tolist(),
        (sends * widths).sum(1).tolist(),
        first.group,
        first.timeout_s,
        what,
        first.diagnose,
    )
    # back: owner j's block holds table 0's rows, then table 1's ...; cut it by the counts sent
    pieces: list[list[torch.Tensor]] = [[] for _ in range(tables)]
    at = 0
    for j in range(workers):
        for t in range(tables):
            n = int(sends[j, t]) * dims[t]
            pieces[t].append(back[at : at + n].view(-1, dims[t]))
            at += n
    out = []
    for t, ids in enumerate(ids_list):
        rows = torch.cat(pieces[t]).to(ids.device) if pieces[t] else back.new_empty(0, dims[t])
        placed = torch.empty_like(rows)
        placed[torch.argsort(owners[t], stable=True).to(rows.device)] = rows
        out.append(placed)
    return out
