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
part is, or at the first part that fails, with that part's error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from fleet.ps.protocol import composite
from fleet.ps.protocol.errors import ShardError
from fleet.ps.protocol.wire import Message, Op, Status, op_name

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


class ManyRequests:
    """Serves composite requests through the server's one-table handlers (``dispatch``)."""

    def __init__(self, shards: Mapping[int, Any], dispatch: Dispatch, ok: Callable[..., Message]):
        self._shards = shards
        self._dispatch = dispatch
        self._ok = ok

    def pull(self, ident: bytes, msg: Message) -> Message | None:
        parts = composite.read_pull(msg, lambda tables: self._dims(msg, tables))
        subs = [self._sub(msg, Op.PULL_SPARSE, table, version, 0.0, 0, [ids]) for table, version, ids in parts]

        def combine(replies: list[Message]) -> Message:
            versions = [r.arg for r in replies]
            tensors = composite.pull_reply([r.tensors[0] for r in replies], versions)
            return self._ok(msg, tensors=tensors, version=min(versions))

        return self._serve(ident, msg, subs, combine)

    def push(self, ident: bytes, msg: Message) -> Message | None:
        pushes = composite.read_push(msg, lambda tables: self._dims(msg, tables))
        subs = [
            self._sub(msg, Op.PUSH_SPARSE_GRAD, p.table, 0, p.lr, p.step,
                      [p.ids, p.grads] if p.clicks is None else [p.ids, p.grads, p.clicks])
            for p in pushes
        ]  # fmt: skip

        def combine(replies: list[Message]) -> Message:
            tensors = composite.push_reply([int(r.status) for r in replies])
            return self._ok(msg, tensors=tensors, version=min(r.arg for r in replies))

        return self._serve(ident, msg, subs, combine)

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
