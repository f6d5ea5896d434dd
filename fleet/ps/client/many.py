"""Several sparse tables' pulls or pushes in as few requests as the limits allow (client side).

:meth:`PSClient.pull_sparse_many` and :meth:`PSClient.push_sparse_grads_many` take one entry per
table and send each server one composite request (``PULL_SPARSE_MANY`` / ``PUSH_SPARSE_GRAD_MANY``,
:mod:`fleet.ps.protocol.composite` writes and reads them) holding every table's part for it: a step of a model with 8 tables
makes one pull and one push per server instead of 8 of each. What the request limits
(:mod:`fleet.ps.protocol.limits`) do not let into one request goes in more: parts are packed in
order into requests under the limits, and a table's part over the limits on its own goes as the
one-table pieces :mod:`fleet.ps.client.split` cuts. A request of one part is the plain one-table
request. The result is the same whichever way the parts travel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fleet.ps.client.split import pull_pieces, push_pieces
from fleet.ps.protocol import composite
from fleet.ps.protocol.composite import MAX_MANY_TABLES
from fleet.ps.protocol.limits import ID_BYTES, RequestLimits
from fleet.ps.protocol.wire import MORE_FOLLOWS, Message, Op, SparsePush


@dataclass
class TablePart:
    """One table's part of a batch for one server: ``item`` (its entry in the call), positions in it, sizes."""

    item: int
    table: int
    dim: int
    positions: torch.Tensor | None  # None: the entry's ids whole (one server)
    count: int
    piece: list[torch.Tensor] | None = None  # a push piece's own tensors (ids, grads, clicks), cut already


@dataclass
class Request:
    """One request to ``server``: the table parts it carries (one part: a plain one-table request)."""

    server: int
    parts: list[TablePart] = field(default_factory=list)
    more: bool = False  # a piece of a one-table push with more pieces after it

    @property
    def composite(self) -> bool:
        return len(self.parts) > 1


def pack(
    per_server: list[tuple[int, list[TablePart]]],
    limits: RequestLimits,
    oversized: Callable[[int, TablePart], list[Request]],
    share: bool = True,
) -> list[Request]:
    """Requests for each server's parts, in order, under ``limits``; a part over them alone goes as
    ``oversized(server, part)``'s one-table pieces, the others share requests (unless not ``share``:
    an op with no composite form, such as a geo delta push)."""
    out: list[Request] = []
    for server, parts in per_server:
        open_request: Request | None = None
        held_bytes = held_ids = 0
        for part in parts:
            if part.count > limits.ids_per_request(part.dim):
                out.extend(oversized(server, part))
                continue
            size = part.count * (ID_BYTES + 4 * part.dim)
            if (
                open_request is None
                or not share
                or held_bytes + size > limits.max_bytes
                or held_ids + part.count > limits.max_ids
                or len(open_request.parts) >= MAX_MANY_TABLES
            ):
                open_request = Request(server)
                out.append(open_request)
                held_bytes = held_ids = 0
            open_request.parts.append(part)
            held_bytes += size
            held_ids += part.count
    return out


def pull_pieces_of(ids: list[torch.Tensor], limits: RequestLimits) -> Callable[[int, TablePart], list[Request]]:
    """The one-table pull requests of a part over the limits (in sorted id order, :mod:`fleet.ps.client.split`)."""

    def pieces(server: int, part: TablePart) -> list[Request]:
        mine = _pick(ids[part.item], part)
        cut = pull_pieces(mine, limits.ids_per_request(part.dim), limits.piece_ids(part.dim))
        out = []
        for pos in cut or [torch.arange(mine.numel())]:
            at = pos if part.positions is None else part.positions[pos]
            out.append(Request(server, [TablePart(part.item, part.table, part.dim, at, at.numel())]))
        return out

    return pieces


def push_pieces_of(pushes: list[SparsePush], limits: RequestLimits) -> Callable[[int, TablePart], list[Request]]:
    """The one-table push requests of a part over the limits (an id's occurrences kept in one piece)."""

    def pieces(server: int, part: TablePart) -> list[Request]:
        push = pushes[part.item]
        tensors = [_pick(t, part) for t in (push.ids, push.grads, push.clicks) if t is not None]
        cut = push_pieces(tensors, limits.ids_per_request(part.dim), limits.piece_ids(part.dim))
        return [
            Request(server, [TablePart(part.item, part.table, part.dim, None, p[0].numel(), p)], more=k < len(cut) - 1)
            for k, p in enumerate(cut)
        ]

    return pieces


def split_by_server(
    ids: list[torch.Tensor], tables: list[int], dims: list[int], num_servers: int, every_server: bool
) -> list[tuple[int, list[TablePart]]]:
    """Each server's parts of the entries ``ids`` (an id lives on server ``id mod num_servers``).

    ``every_server``: a part for every table on every server, empty ones included (a sync step
    must reach every shard of every table).
    """
    if num_servers == 1:
        return [
            (
                0,
                [
                    TablePart(i, t, d, None, x.numel())
                    for i, (x, t, d) in enumerate(zip(ids, tables, dims, strict=True))
                ],
            )
        ]
    per_server: list[list[TablePart]] = [[] for _ in range(num_servers)]
    for item, (x, table, dim) in enumerate(zip(ids, tables, dims, strict=True)):
        owner = torch.remainder(x, num_servers)
        for server in range(num_servers):
            pos = (owner == server).nonzero().squeeze(1)
            if pos.numel() or every_server:
                per_server[server].append(TablePart(item, table, dim, pos, pos.numel()))
    return [(s, parts) for s, parts in enumerate(per_server) if parts]


def _pick(t: torch.Tensor, part: TablePart) -> torch.Tensor:
    return t if part.positions is None else t[part.positions]


def pull_message(request: Request, ids: list[torch.Tensor], min_versions: list[int], make) -> Message:
    """The message of a pull ``request`` (``make(op, table, **fields)`` stamps the worker's header)."""
    if not request.composite:
        part = request.parts[0]
        return make(Op.PULL_SPARSE, part.table, arg=min_versions[part.item], tensors=[_pick(ids[part.item], part)])
    entries = [(p.table, min_versions[p.item], _pick(ids[p.item], p)) for p in request.parts]
    return make(Op.PULL_SPARSE_MANY, 0, tensors=composite.pull_request(entries))


def pull_rows(request: Request, reply: Message) -> list[tuple[TablePart, torch.Tensor, int]]:
    """(part, its rows ``[count, dim]``, its shard's version) of a pull reply."""
    if not request.composite:
        return [(request.parts[0], reply.tensors[0], reply.arg)]
    rows = composite.read_pull_reply(reply, [(p.count, p.dim) for p in request.parts])
    return [(part, got, version) for part, (got, version) in zip(request.parts, rows, strict=True)]


def push_message(request: Request, pushes: list[SparsePush], make, op: Op = Op.PUSH_SPARSE_GRAD) -> Message:
    """The message of a push ``request`` (``make(op, table, **fields)`` stamps the worker's header); ``op``:
    what a one-table request is (a gradient or a geo delta push)."""
    if not request.composite:
        part = request.parts[0]
        push = pushes[part.item]
        tensors = part.piece or [_pick(t, part) for t in (push.ids, push.grads, push.clicks) if t is not None]
        arg = MORE_FOLLOWS if request.more else 0
        return make(op, part.table, step=push.step, lr=push.lr, arg=arg, tensors=tensors)
    entries = []
    for p in request.parts:
        push = pushes[p.item]
        clicks = _pick(push.clicks, p) if push.clicks is not None else None
        entries.append(SparsePush(p.table, _pick(push.ids, p), _pick(push.grads, p), push.step, push.lr, clicks))
    return make(Op.PUSH_SPARSE_GRAD_MANY, 0, tensors=composite.push_request(entries))


def gather_pulls(
    plan: list[Request], replies: list[Message], ids: list[torch.Tensor], dims: list[int]
) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    """Each entry's rows ``[len(ids), dim]`` in the order of its ids, and the version of each server's shard
    that answered for it (the oldest, where several requests went to one server), in server order."""
    # an entry answered whole by one request takes its rows as they came; only one spread over several is assembled
    out: list[torch.Tensor | None] = [None] * len(ids)
    seen: list[dict[int, int]] = [{} for _ in ids]  # per entry: server -> its oldest shard version
    for request, reply in zip(plan, replies, strict=True):
        for part, rows, version in pull_rows(request, reply):
            if part.positions is None:
                out[part.item] = rows
            else:
                into = out[part.item]
                if into is None:
                    into = out[part.item] = torch.empty(ids[part.item].numel(), dims[part.item], dtype=torch.float32)
                if part.count:
                    into.index_copy_(0, part.positions, rows)
            oldest = seen[part.item].get(request.server, version)
            seen[part.item][request.server] = min(oldest, version)
    done = [t if t is not None else torch.empty(x.numel(), d) for t, x, d in zip(out, ids, dims, strict=True)]
    return [(t, tuple(by_server[s] for s in sorted(by_server))) for t, by_server in zip(done, seen, strict=True)]


def checked_push(push: SparsePush, dim: int) -> SparsePush:
    """``push`` with flat int64 ids, float32 rows and clicks, checked against the table's ``dim``."""
    ids, grads = push.ids, push.grads
    # the usual push (flat int64 ids and float32 rows, contiguous, outside autograd) is taken as it is
    if not (ids.dtype is torch.int64 and ids.dim() == 1 and ids.is_contiguous() and not ids.requires_grad):
        ids = ids.detach().reshape(-1).to(torch.int64).contiguous()
    if not (grads.dtype is torch.float32 and grads.is_contiguous() and not grads.requires_grad):
        grads = grads.detach().to(torch.float32).contiguous()
    if list(grads.shape) != [ids.numel(), dim]:
        raise ValueError(
            f"sparse table {push.table}: rows of shape {list(grads.shape)} for {ids.numel()} ids, dim {dim}"
        )
    clicks = push.clicks
    if clicks is not None:
        clicks = clicks.detach().reshape(-1).to(torch.float32).contiguous()
        if clicks.numel() != ids.numel():
            raise ValueError(f"sparse table {push.table}: {clicks.numel()} clicks for {ids.numel()} ids")
    return SparsePush(push.table, ids, grads, int(push.step), float(push.lr), clicks)


def write_pieces(
    ids: torch.Tensor, fields: list[torch.Tensor], num_servers: int, most: int, every_server: bool
) -> list[tuple[int, bool, list[torch.Tensor]]]:
    """(server, whether it is the server's first piece, [ids, *fields] of at most ``most`` rows) for a write of
    rows; every server gets a piece, empty or not, when ``every_server``."""
    out = []
    for server, parts in split_by_server([ids], [0], [0], num_servers, every_server):
        pos = parts[0].positions
        mine = [ids, *fields] if pos is None else [t[pos] for t in (ids, *fields)]
        n = mine[0].numel()
        for k, lo in enumerate(range(0, max(n, 1), most)):
            out.append((server, k == 0, [t[lo : lo + most] for t in mine]))
    return out
