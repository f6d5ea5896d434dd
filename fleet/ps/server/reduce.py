"""The workers' collectives on a server: BARRIER, and ALL_REDUCE on server 0 (``fleet.metrics``).

A BARRIER is parked until every active worker (not stopped, not gone for good) reached it on
this server; a sync step waiting only for the workers at the barrier closes first.

ALL_REDUCE: the workers' float64 vectors reduced element-wise.

A parameter-server job has no process group over its workers, so a global metric's one
collective goes through server 0: every worker sends its vector (one 1-D float64 tensor, the
reduction's index in :data:`~fleet.ps.protocol.wire.REDUCE_OPS` in ``arg``), the server parks it like a
barrier until every active worker sent one (a stopped worker is not waited for), then answers
each with the reduction, summed in worker order (the same bits for everyone). The vectors must
agree in length and reduction; otherwise every parked worker, and the one that disagrees, gets
an error naming who sent what, and so do workers reducing while others wait in the barrier.

:class:`Reductions` is an object the server composes, given the waitlist, the reply helpers,
the workers a collective waits for (``active``), the server's index, and how to close the sync steps
that wait only for workers at the barrier (``close_steps``) through its constructor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fleet.ps.protocol.errors import ShardError
from fleet.ps.protocol.wire import REDUCE_OPS, Message
from fleet.ps.server.replies import Replies
from fleet.ps.server.waitlist import Parked, Waitlist


class Reductions:
    """The BARRIER and ALL_REDUCE handlers, their releases and deadlines, and failing the parked collectives."""

    def __init__(
        self,
        waiting: Waitlist,
        replies: Replies,
        active: Callable[[], set[int]],
        server_index: int,
        close_steps: Callable[[], None],
    ):
        self._waiting = waiting
        self._replies = replies
        self._active = active
        self.server_index = server_index
        self._close_steps = close_steps

    def barrier(self, ident: bytes, msg: Message) -> None:
        if msg.peer in self._waiting.barrier:
            raise ShardError(f"worker {msg.peer} entered the barrier twice")
        if self._waiting.reduce:  # the others all-reduce a metric: nobody may wait here for them
            waiting = [msg.peer, *self._waiting.barrier]
            raise ValueError(self.fail_collectives(against_barrier(list(self._waiting.reduce), waiting)))
        self._waiting.barrier[msg.peer] = self._replies.park(ident, msg)
        self._close_steps()
        self.release_barrier()
        return None

    def release_barrier(self) -> None:
        """Answer the parked BARRIERs once every active worker reached it (after arrivals, stops and losses)."""
        for parked in self._waiting.release_barrier(len(self._active())):
            self._replies.send(parked.ident, self._replies.ok(parked.msg))

    def expire_barrier(self, expired: list[Parked], now: float) -> None:
        for parked in expired:
            missing = sorted(self._active() - set(self._waiting.barrier) - {parked.msg.peer})
            text = f"barrier timed out after {now - parked.since:.2f} s waiting for workers {missing}"
            self._replies.reply_error(parked.ident, parked.msg, text)

    def all_reduce(self, ident: bytes, msg: Message) -> None:
        check(msg)
        if self.server_index != 0:
            raise ValueError(f"ALL_REDUCE goes to parameter server 0; this is server {self.server_index}")
        if msg.peer in self._waiting.reduce:
            raise ValueError(f"worker {msg.peer} sent a second ALL_REDUCE before its first was answered")
        if self._waiting.barrier:
            text = against_barrier([msg.peer, *self._waiting.reduce], list(self._waiting.barrier))
        else:
            text = disagreement(self._waiting.reduce, msg)
        if text is not None:
            raise ValueError(self.fail_collectives(text))
        self._waiting.reduce[msg.peer] = self._replies.park(ident, msg)
        self.release()
        return None

    def release(self) -> None:
        """Answer every parked ALL_REDUCE once every active worker sent one (after arrivals and stops)."""
        parked = self._waiting.release_reduce(self._active())
        if parked:
            reduced = combine(parked)
            for entry in parked:
                self._replies.send(entry.ident, self._replies.ok(entry.msg, tensors=[reduced]))

    def fail_collectives(self, text: str) -> str:
        """Every parked ALL_REDUCE and BARRIER gets ``text`` as its error; returns it for the newcomer's."""
        for parked in (self._waiting.reduce, self._waiting.barrier):
            for entry in parked.values():
                self._replies.reply_error(entry.ident, entry.msg, text)
            parked.clear()
        return text

    def expire(self, now: float) -> None:
        expired = self._waiting.expired_reduce(now)
        sent = set(self._waiting.reduce) | {parked.msg.peer for parked in expired}
        for parked in expired:
            text = (
                f"all-reduce of a global metric (fleet.metrics compute()) timed out after {now - parked.since:.2f} s "
                f"waiting for workers {sorted(self._active() - sent)}"
            )
            self._replies.reply_error(parked.ident, parked.msg, text)


def check(msg: Message) -> None:
    """Raise ValueError (an error reply) unless ``msg`` carries one 1-D float64 vector and a known reduction."""
    if len(msg.tensors) != 1:
        raise ValueError(f"ALL_REDUCE carries one 1-D float64 tensor; got {len(msg.tensors)} tensors")
    values = msg.tensors[0]
    if values.dtype != torch.float64 or values.dim() != 1:
        raise ValueError(f"ALL_REDUCE carries one 1-D float64 tensor; got {values.dtype} of shape {list(values.shape)}")
    if not 0 <= msg.arg < len(REDUCE_OPS):
        raise ValueError(f"ALL_REDUCE: unknown reduction {msg.arg}; expected 0-{len(REDUCE_OPS) - 1} ({REDUCE_OPS})")


def _what(msg: Message) -> str:
    n = msg.tensors[0].numel()
    return f"{n} value{'s' if n != 1 else ''} to {REDUCE_OPS[msg.arg]}"


def disagreement(parked: dict[int, Parked], newcomer: Message) -> str | None:
    """The error text when ``newcomer`` does not match the vectors already parked, else None."""
    msgs = [p.msg for p in parked.values()] + [newcomer]
    groups: dict[str, list[int]] = {}
    for msg in msgs:
        groups.setdefault(_what(msg), []).append(msg.peer)
    if len(groups) == 1:
        return None
    parts = [
        f"{_workers(sorted(peers))} sent {what}" for what, peers in sorted(groups.items(), key=lambda g: min(g[1]))
    ]
    return (
        "workers disagree about the global metric they all-reduce (fleet.metrics compute()): "
        + "; ".join(parts)
        + ". Every worker must call compute() of the same metrics (same kind, same num_thresholds), in the same order."
    )


def against_barrier(reducing: list[int], waiting: list[int]) -> str:
    """The error text when some workers all-reduce while others wait in the barrier."""
    return (
        f"{_workers(sorted(reducing))} all-reduce a global metric (fleet.metrics compute()) while "
        f"{_workers(sorted(waiting))} wait in fleet.barrier_worker(): every worker must call them in the same order."
    )


def combine(parked: list[Parked]) -> torch.Tensor:
    """The element-wise reduction of the parked vectors, in worker order."""
    ordered = sorted(parked, key=lambda p: p.msg.peer)
    stacked = torch.stack([p.msg.tensors[0] for p in ordered])
    op = REDUCE_OPS[ordered[0].msg.arg]
    if op == "sum":
        return stacked.sum(0)
    return stacked.amax(0) if op == "max" else stacked.amin(0)


def _workers(peers: list[int]) -> str:
    return ("worker " if len(peers) == 1 else "workers ") + ", ".join(str(p) for p in peers)
