"""Requests for several sparse tables at once: PULL_SPARSE_MANY and PUSH_SPARSE_GRAD_MANY.

A model with many sparse features (a ``fleet.nn.SparseFeatureCollection``, or several
``SparseEmbedding`` modules) would otherwise send one pull and one push per table per server
per step; DLRM's 8 tables made 16 round trips where 2 do. A composite request carries every
table's part (the layout, and its reading and writing, is :mod:`fleet.ps.protocol.composite`), and the
server serves it as the
one-table requests it stands for: the same handlers, the same checks and limits per table, in
the request's order. Nothing new happens inside a table, so a composite push is exactly the
pushes it replaces.

The parts are checked together before any is served (every table exists and is sparse, the
counts add up to the ids, the gradients to the rows), so a malformed composite changes no
table. A part may be answered later (a sync pull waiting for its table's step): each part
carries a :class:`Part` as its reply address, and the composite is answered when its last
part is, or at the first part that fails, with that part's error. Without table threads, a composite
whose parts all answer at once skips the one-table requests (:class:`Inline`): the same table work in the
same order, the same reply.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fleet.ps.protocol import composite
from fleet.ps.protocol.errors import ShardError
from fleet.ps.protocol.wire import Message, Op, SparsePush, Status, op_name
from fleet.sparse.nonfinite import finite

if TYPE_CHECKING:
    from fleet.ps.server.table_ops import TableRequests

Dispatch = Callable[[Any, Message], "Message | None"]


class Gather:
    """One composite request in flight: its parts' replies, and where the combined reply goes."""

    def __init__(self, ident: bytes, msg: Message, parts: int, combine: Callable[[list[Message]], Message]):
        self.ident = ident
        self.msg = msg
        self._replies: list[Message | None] = [None] * parts
        self._left = parts
        self._combine = combine
        self.answer: Message | None = None  # set once, when the composite is answered (or failed)

    def deliver(self, index: int, reply: Message) -> Message | None:
        """Record part ``index``'s reply; return the composite's reply once it is due (then never again)."""
        if self.answer is not None or self._replies[index] is not None:
            return None  # answered already (an earlier part failed): later parts are dropped
        if reply.status == Status.ERROR:
            self.answer = reply
            return reply
        self._replies[index] = reply
        self._left -= 1
        if self._left:
            return None
        self.answer = self._combine(self._replies)  # type: ignore[arg-type]
        return self.answer


class Part:
    """The reply address of part ``index`` of a composite request (a routing identity, like a peer's)."""

    __slots__ = ("gather", "index")

    def __init__(self, gather: Gather, index: int):
        self.gather = gather
        self.index = index


@dataclass(frozen=True)
class Inline:
    """How a composite is served at once, on the loop thread, when every part answers at once (see
    :class:`ManyRequests`): ``ready()``: the server serves table operations on this thread now (no table
    threads); ``tables``: its table handlers; ``count(table, op_name)``: its count of one table's operation;
    ``failed(msg, exc)``: its error reply to one-table request ``msg`` that raised ``exc``."""

    ready: Callable[[], bool]
    tables: TableRequests
    count: Callable[[int, str], None]
    failed: Callable[[Message, Exception], Message]


class ManyRequests:
    """Serves composite requests through the server's one-table handlers (``dispatch``).

    With ``inline``, a composite whose parts all answer at once (no sync pull waits, no part over the limits)
    is served on this thread without a request per part: the same table work, counts and checks, in the same
    order, and the same reply (or error reply, of the first part that fails) as its parts would make.
    Why: a DLRM step's pull and push name 8 tables each, and building, dispatching and gathering a one-table
    request (and reply) per table was a large part of the server's time per step.
    """

    def __init__(
        self, shards: Mapping[int, Any], dispatch: Dispatch, ok: Callable[..., Message], inline: Inline | None = None
    ):
        self._shards = shards
        self._dispatch = dispatch
        self._ok = ok
        self._inline = inline

    def pull(self, ident: bytes, msg: Message) -> Message | None:
        parts = composite.read_pull(msg, lambda tables: self._dims(msg, tables))
        if self._inline is not None and self._inline.ready():
            reply = self._pull_now(msg, parts)
            if reply is not None:
                return reply
        subs = [self._sub(msg, Op.PULL_SPARSE, table, version, 0.0, 0, [ids]) for table, version, ids in parts]

        def combine(replies: list[Message]) -> Message:
            versions = [r.arg for r in replies]
            tensors = composite.pull_reply([r.tensors[0] for r in replies], versions)
            return self._ok(msg, tensors=tensors, version=min(versions))

        return self._serve(ident, msg, subs, combine)

    def push(self, ident: bytes, msg: Message) -> Message | None:
        pushes = composite.read_push(msg, lambda tables: self._dims(msg, tables))
        if self._inline is not None and self._inline.ready():
            reply = self._push_now(msg, pushes)
            if reply is not None:
                return reply
        subs = [
            self._sub(msg, Op.PUSH_SPARSE_GRAD, p.table, 0, p.lr, p.step,
                      [p.ids, p.grads] if p.clicks is None else [p.ids, p.grads, p.clicks])
            for p in pushes
        ]  # fmt: skip

        def combine(replies: list[Message]) -> Message:
            tensors = composite.push_reply([int(r.status) for r in replies])
            return self._ok(msg, tensors=tensors, version=min(r.arg for r in replies))

        return self._serve(ident, msg, subs, combine)

    # ------------------------------------------------------------------ served at once
    def _pull_now(self, msg: Message, parts: list[tuple[int, int, torch.Tensor]]) -> Message | None:
        """The reply of a pull whose parts all answer at once, each table's rows written straight into the reply's
        flat tensor; None (nothing done): some part waits for its table's step, or is over the limits."""
        inline = self._inline
        assert inline is not None
        tables = inline.tables
        shards = [self._shards[table] for table, _, _ in parts]
        sizes = []
        for (_, version, ids), shard in zip(parts, shards, strict=True):
            count = ids.numel()
            if (
                version > shard.version
                or getattr(shard, "broken", None) is not None
                or not tables.fits(count, shard.dim)
            ):
                return None  # served part by part, as it always was: it waits, or fails where its part says
            sizes.append(count * shard.dim)
        flat = torch.empty(sum(sizes), dtype=torch.float32)
        versions = []
        for (table, version, ids), shard, out in zip(parts, shards, flat.split(sizes), strict=True):
            inline.count(table, "PULL_SPARSE")
            try:
                versions.append(tables.pull_now(shard, ids, out.view(ids.numel(), shard.dim)))
            except Exception as exc:  # as the part's own request would have failed (loop: _dispatch)
                failed = inline.failed(self._sub(msg, Op.PULL_SPARSE, table, version, 0.0, 0, [ids]), exc)
                return _as_reply_to(failed, msg)
        return self._ok(msg, tensors=[flat, torch.tensor(versions, dtype=torch.int64)], version=min(versions))

    def _push_now(self, msg: Message, pushes: list[SparsePush]) -> Message | None:
        """The reply of a push served at once; None (nothing done): some part is over the limits.

        The values of every table are checked for NaN and Inf in one pass over the request's flat gradients
        and clicks; only when that finds some does each table check its own (and skip or refuse its part).
        """
        inline = self._inline
        assert inline is not None
        tables = inline.tables
        shards = [self._shards[p.table] for p in pushes]
        if not all(tables.fits(p.ids.numel(), shard.dim) for p, shard in zip(pushes, shards, strict=True)):
            return None
        grads, clicks = msg.tensors[3], msg.tensors[4]  # flat, every table's (clicks: zeros where none)
        checked = finite(grads, clicks, *(p.lr for p in pushes))
        statuses, versions = [], []
        for p, shard in zip(pushes, shards, strict=True):
            inline.count(p.table, "PUSH_SPARSE_GRAD")
            try:
                status = tables.push_sparse_grad(
                    shard, msg.peer, p.step, p.ids, p.grads, p.lr, p.clicks, more=False, finite=checked
                )
            except Exception as exc:  # as the part's own request would have failed (loop: _dispatch)
                tensors = [p.ids, p.grads] if p.clicks is None else [p.ids, p.grads, p.clicks]
                failed = inline.failed(self._sub(msg, Op.PUSH_SPARSE_GRAD, p.table, 0, p.lr, p.step, tensors), exc)
                return _as_reply_to(failed, msg)
            statuses.append(int(status))
            versions.append(shard.version)
        return self._ok(msg, tensors=composite.push_reply(statuses), version=min(versions))

    # ------------------------------------------------------------------ parts
    def _dims(self, msg: Message, tables: list[int]) -> list[int]:
        """Each table's row width; every table must be a sparse table here."""
        dims = []
        for table in tables:
            shard = self._shards.get(table)
            if shard is None or shard.kind != "sparse":
                known = sorted(t for t, s in self._shards.items() if s.kind == "sparse")
                raise ShardError(
                    f"{op_name(msg.op)}: table {table} is not a sparse table here (sparse tables: {known})"
                )
            dims.append(int(shard.dim))
        return dims

    @staticmethod
    def _sub(msg: Message, op: Op, table: int, arg: int, lr: float, step: int, tensors: list[torch.Tensor]) -> Message:
        return Message(
            op=op, table=table, peer=msg.peer, request_id=msg.request_id, step=step, arg=arg, lr=lr,
            timeout_ms=msg.timeout_ms, tensors=tensors,
        )  # fmt: skip

    def _serve(
        self, ident: bytes, msg: Message, subs: list[Message], combine: Callable[[list[Message]], Message]
    ) -> Message | None:
        gather = Gather(ident, msg, len(subs), combine)
        for index, sub in enumerate(subs):
            reply = self._dispatch(Part(gather, index), sub)
            if reply is not None:
                gather.deliver(index, reply)
            if gather.answer is not None:
                break  # answered (all parts done) or failed: the parts after a failure are not served
        if gather.answer is None:
            return None  # some parts wait (sync pulls): the last one to be answered answers the composite
        answer = gather.answer
        return answer if answer.status != Status.ERROR else _as_reply_to(answer, msg)


def _as_reply_to(reply: Message, msg: Message) -> Message:
    """A part's error reply, readdressed to the composite request it belongs to."""
    return Message(
        op=msg.op, table=reply.table, peer=reply.peer, request_id=msg.request_id, step=msg.step, arg=reply.arg,
        status=reply.status, blob=reply.blob,
    )  # fmt: skip


def deliver(part: Part, reply: Message) -> tuple[bytes, Message] | None:
    """A part's reply reached the server's send: (the composite's peer, its reply) once that is due, else None."""
    answer = part.gather.deliver(part.index, reply)
    if answer is None:
        return None
    if answer.status == Status.ERROR:
        answer = _as_reply_to(answer, part.gather.msg)
    return part.gather.ident, answer
