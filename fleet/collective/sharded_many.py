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
the same counts. Each owner applies each table's rows as :meth:`ShardedRows.step` would.

A step's ids need not travel: with one forward a step they are the unique ids the forward pulled, in
the same order, so the owner knows them (it served them: :class:`Served`) and the requester knows
their grouping (:class:`Pulled`). A table whose step names other ids (several forwards a step, a
lookup in between) sends them as two more float32 columns (their bits, never computed on), grouped
anew; a flag per table in the header says which.

Why so few tensor operations: a worker's step is 256 samples, and its fixed cost per step and
table dominated (W6: a sharded worker spent as much CPU on 256 samples as one process on 512).
The ids are grouped once a step (by owner, then table: they come in table order, so a stable grouping
by owner does it, natively in two passes), blocks are gathered straight into the shared memory (no
concatenation, no copy) and read back as views, and the lockstep's announcement of a pull or a step
is the first exchange's meeting (:meth:`ShardedRows.exchange_pieces`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fleet.errors import FleetError
from fleet.sparse.native import kernels


@dataclass
class Pulled:
    """A table's ids in this worker's last pull together with other tables (its requester's side): a step of the
    same ids (one forward a step, the usual case) reuses their grouping, and its ids need not travel."""

    ids: torch.Tensor  # CPU, a copy of the ids pulled (the caller's tensor may change)
    positions: list[torch.Tensor]  # owner j's: the positions of its ids among ``ids``, in the order sent
    counts: list[int]  # owner j's: how many


@dataclass
class Served:
    """A table's ids that every worker asked this owner for in the last pull together (the owner's side)."""

    ids: torch.Tensor  # every requester's, in rank order: what this owner pulled
    counts: list[int]  # requester i's: how many


def with_id_bits(grads: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[grads | the ids' bits as two float32 columns]``: the ids travel in the gradients' exchange (their bits,
    never computed on; :func:`id_bits` reads them back)."""
    bits = ids.to(grads.device).to(torch.int64).contiguous().view(torch.float32).view(-1, 2)
    return torch.cat([grads, bits], 1)


def id_bits(block: torch.Tensor) -> torch.Tensor:
    """The ids of a :func:`with_id_bits` block (its last two columns)."""
    # a copy of its own (contiguous() may keep a one-row view at an odd offset: no int64 view of it)
    bits = torch.empty(block.shape[0], 2, dtype=torch.float32, device=block.device).copy_(block[:, -2:])
    return bits.view(torch.int64).view(-1)


def _group(
    backends: list[Any], ids: torch.Tensor, lengths: list[int]
) -> tuple[torch.Tensor, torch.Tensor, list[list[int]], list[int]]:
    """Group the concatenated ``ids`` of the tables (``lengths[t]`` each) by owner, then table, each table's
    ids in their order (a stable sort by owner). Returns (the order that groups them; for each ``(owner j, table
    t)`` in that order, the positions of its ids within their table's, concatenated; ``[workers][tables]`` counts;
    the counts in that order, flat).

    Row-wise (every table of the group has the same owners, ``same_owners``) one native pass hashes and counts,
    one places (``group_by_owner``): in torch this was a dozen passes, each with a fixed cost that dominated at a
    step's sizes. Table-wise (each table's owner its holder) the owners are each table's, in torch."""
    first = backends[0]
    workers, tables = first.workers, len(lengths)
    ids = ids.to(torch.int64).contiguous()
    lens = torch.tensor(lengths, dtype=torch.int64)
    if not first.same_owners:
        table_of = torch.repeat_interleave(torch.arange(tables), lens, output_size=ids.numel())
        owners = torch.cat([b.owners(part) for b, part in zip(backends, ids.split(lengths), strict=True)]).cpu()
        order = torch.argsort(owners, stable=True)
        sends = torch.bincount(owners * tables + table_of, minlength=workers * tables)
        flat = sends.tolist()
        # a position in the ids of all tables, less where its table begins: its position in its table's ids
        begins = (torch.cumsum(lens, 0) - lens).repeat(workers)
        local = order - torch.repeat_interleave(begins, sends, output_size=ids.numel())
        return order, local, [flat[j * tables : (j + 1) * tables] for j in range(workers)], flat
    order, local = torch.empty_like(ids), torch.empty_like(ids)
    counts = torch.empty(workers * tables, dtype=torch.int64)
    kernels.group_by_owner(ids.numpy(), lens.numpy(), workers, order.numpy(), local.numpy(), counts.numpy())
    flat = counts.tolist()
    return order, local, [flat[j * tables : (j + 1) * tables] for j in range(workers)], flat


def pull_together(
    backends: list[Any], ids_list: list[torch.Tensor], what: str, announce: Callable[[int], list[int]] | None = None
) -> list[torch.Tensor]:
    """Rows for each ``(backend, unique ids)``: :class:`~fleet.collective.sharded_rows.ShardedRows` of one group.
    ``announce``: the lockstep's announcement, made with the first exchange (its meeting, through shared memory).
    Each backend remembers the pull (:class:`Pulled`, :class:`Served`) for a step of the same ids."""
    first = backends[0]
    workers, tables = first.workers, len(backends)
    for backend in backends:  # remembered again only once this pull is done on every side
        backend.remember_pull(None, None)
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
    served = []
    for t, backend in enumerate(backends):
        parts = []
        for i in range(workers):
            parts.append(asked[i][at[i] : at[i] + got[i][t]])
            at[i] += got[i][t]
        wanted = torch.cat(parts)
        served.append(wanted)
        found.append(backend.local.pull(wanted))
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
    positions = local.split(flat)  # (owner j, table t): positions in table t's ids, as sent
    placed = positions if back[0].device.type == "cpu" else local.to(back[0].device).split(flat)
    out = [back[0].new_empty(n, d) for n, d in zip(lengths, dims, strict=True)]
    for j in range(workers):
        at_j = 0
        for t in range(tables):
            n = sends[j][t]
            if n:
                rows = back[j][at_j : at_j + n * dims[t]].view(n, dims[t])
                out[t].index_copy_(0, placed[j * tables + t], rows)
            at_j += n * dims[t]
    for t, (backend, pulled) in enumerate(zip(backends, ids.split(lengths), strict=True)):
        positions_t = [positions[j * tables + t] for j in range(workers)]
        backend.remember_pull(
            Pulled(pulled, positions_t, [s[t] for s in sends]), Served(served[t], [r[t] for r in got])
        )
    return [rows.to(ids_t.device) for rows, ids_t in zip(out, ids_list, strict=True)]


def _same_ids(pulled: Pulled | None, ids: torch.Tensor) -> bool:
    """Whether a step's ``ids`` are those of the table's last pull (in the same order)."""
    if pulled is None or ids.device.type != "cpu" or ids.dtype != pulled.ids.dtype:
        return False
    return ids.numel() == pulled.ids.numel() and torch.equal(ids, pulled.ids)


def step_together(
    items: list[tuple[Any, dict[str, Any]]],
    optimizer_class: type,
    what: str,
    announce: Callable[[int], list[int]] | None = None,
) -> None:
    """Step each ``(backend, param group)``: every table's gradients to their owners in one exchange (which
    ``announce``, the lockstep's announcement, comes with, as in :func:`pull_together`).

    A table whose step names the ids of its last pull together (:class:`Pulled`) sends its gradients grouped as
    the pull grouped its ids, and without them: each owner takes the ids it served (:class:`Served`). Any other
    (several forwards a step, a forward alone) groups its ids here and sends them as two more columns
    (:func:`with_id_bits`). A flag per table in the header says which it is."""
    first = items[0][0]
    workers, tables = first.workers, len(items)
    parts = [backend.gradients(group) for backend, group in items]  # (ids, grads [n, width], lr, finite)
    widths = [grads.shape[1] for _, grads, _, _ in parts]
    known = [_same_ids(backend.pulled, ids) for (backend, _), (ids, *_) in zip(items, parts, strict=True)]
    # owner j's counts, and its pieces: each table's gradients, gathered straight into the send
    sends = [[0] * tables for _ in range(workers)]
    pieces: list[list[Any]] = [[None] * tables for _ in range(workers)]
    sent = [w if k else w + 2 for w, k in zip(widths, known, strict=True)]
    unknown = [t for t in range(tables) if not known[t]]
    if unknown:
        ids = torch.cat([parts[t][0] for t in unknown]).cpu()
        _, local, counts, flat = _group([items[t][0] for t in unknown], ids, [parts[t][0].numel() for t in unknown])
        positions = local.split(flat)
        for u, t in enumerate(unknown):
            block = with_id_bits(parts[t][1], parts[t][0]).cpu()
            for j in range(workers):
                sends[j][t] = counts[j][u]
                pieces[j][t] = (block, positions[j * len(unknown) + u])
    for t in range(tables):
        if known[t]:
            pulled = items[t][0].pulled
            grads = parts[t][1].cpu()
            for j in range(workers):
                sends[j][t] = pulled.counts[j]
                pieces[j][t] = (grads, pulled.positions[j])
    sizes = [sum(n * w for n, w in zip(row, sent, strict=True)) for row in sends]
    bad = [0 if finite else 1 for *_, finite in parts]
    flags = [1 if k else 0 for k in known]
    # one exchange carries each table's counts, non-finite and known-ids flags (the header) and the gradients
    back, header, _ = first.exchange_pieces(
        [piece for row in pieces for piece in row],
        sizes,
        torch.tensor([row + bad + flags for row in sends], dtype=torch.int64),
        None,
        torch.float32,
        what,
        announce,
    )
    assert header is not None
    any_bad = [any(row[tables + t] for row in header) for t in range(tables)]
    # every table's rows copied out of the exchange before any is applied (the views last until the next one),
    # the gradients divided by the number of workers on the way (the mean's terms; the clicks are summed)
    at = [0] * workers
    received = []
    for t, width in enumerate(widths):
        backend = items[t][0]
        dim = backend.shard.embedding_dim
        grads = torch.empty(sum(header[i][t] for i in range(workers)), width, dtype=torch.float32)
        ids, row = [], 0
        for i in range(workers):
            n, ids_known = header[i][t], header[i][2 * tables + t]
            step = width if ids_known else width + 2
            rows = back[i][at[i] : at[i] + n * step].view(n, step)
            at[i] += n * step
            if n:
                torch.div(rows[:, :dim], workers, out=grads[row : row + n, :dim])
                if width > dim:
                    grads[row : row + n, dim:].copy_(rows[:, dim:width])
            row += n
            ids.append(_served(backend, i, n, what) if ids_known else id_bits(rows))
        every = all(header[i][2 * tables + t] for i in range(workers))
        received.append((backend.served.ids if every else torch.cat(ids), grads))
    for t, (backend, group) in enumerate(items):
        ids, grads = received[t]
        backend.apply_received(optimizer_class, group, ids, grads, parts[t][2], any_bad[t], divided=True)


def _served(backend: Any, requester: int, n: int, what: str) -> torch.Tensor:
    """The ``n`` ids ``requester`` asked this owner for in the table's last pull (it says its step names them)."""
    served = backend.served
    if served is None or served.counts[requester] != n:
        # both sides remember every pull together and forget at every other pull of the table: never expected
        raise FleetError(
            f"{what}: worker {requester} sends {n} gradients of the ids of its last pull, but this worker "
            f"served it {'no pull' if served is None else served.counts[requester]} ids of that table"
        )
    start = sum(served.counts[:requester])
    return served.ids[start : start + n]
