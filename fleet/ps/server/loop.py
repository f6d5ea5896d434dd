"""The parameter-server process: one ROUTER socket, one thread, one event loop.

Why single-threaded: every op is either a memcpy-sized table operation or a
bookkeeping step, the tables are not thread-safe, and ZeroMQ already moves
bytes on its own IO thread. Requests that cannot be answered yet (a sync pull
for a version not reached, a create waiting for worker 0's initial values, a
barrier) are parked with a deadline and answered from the loop, so nothing in
the loop ever blocks. Requests are served in turns by worker (:mod:`fleet.ps.server.inbox`),
each worker's in the order sent, so one worker's huge batch cannot crowd out the others.

Where it listens, and how peers authenticate, is :mod:`fleet.ps.server.sockets`; how it answers
(errors, parked requests, failures) is :mod:`fleet.ps.server.replies`.

Bounds, so that neither a stranger nor one worker can take the server from the others:
before authentication a peer can make the server allocate one frame (:mod:`fleet.ps.server.sockets`);
after it, every message kind has a byte budget checked from the header before any tensor is built
(:meth:`~fleet.ps.server.table_ops.TableRequests.budget`), and a sparse request at most the ids of
:class:`~fleet.ps.protocol.limits.RequestLimits`, so one request holds the loop for a fraction of a
second. A request that fails inside a table -- out of memory included -- leaves the table as it was
and gets an error naming the server, the table and the cause.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from collections import defaultdict
from typing import Any

import torch
import zmq

from fleet.ps.protocol import auth, small
from fleet.ps.protocol.errors import WireError
from fleet.ps.protocol.limits import RequestLimits
from fleet.ps.protocol.liveness import Workers
from fleet.ps.protocol.quick_pulls import DENSE_BYTES, dense_pull, plain_pull, whole_pull
from fleet.ps.protocol.wire import (
    DTYPE_CODES,
    Message,
    Op,
    RequestTooLarge,
    Status,
    decode,
    encode,
    op_name,
    read_request_id,
)
from fleet.ps.server import aggregator as agg
from fleet.ps.server.inbox import FairInbox
from fleet.ps.server.lanes import MAX_QUEUED, Lanes, Outbox, ServerLock, default_threads
from fleet.ps.server.many import Inline, ManyRequests, Part, deliver
from fleet.ps.server.reduce import Reductions
from fleet.ps.server.replies import Replies
from fleet.ps.server.sockets import ServerSockets, Waiter
from fleet.ps.server.table_ops import TableRequests
from fleet.ps.server.waitlist import Waitlist

log = logging.getLogger(__name__)

_MAX_BATCH = 256  # messages handled per poll wake-up before deadlines are checked again
_IDLE_POLL_MS = 100  # upper bound on a poll, so shutdown() is noticed promptly
# Ops that concern no one table (a composite request counts under each table it names, part by part).
_NOT_ON_A_TABLE = frozenset(
    (Op.HELLO, Op.BARRIER, Op.SAVE, Op.LOAD, Op.STATS, Op.STOP, Op.ALL_REDUCE, Op.SHRINK,
     Op.PULL_SPARSE_MANY, Op.PUSH_SPARSE_GRAD_MANY)
)  # fmt: skip
# One table's pulls and pushes: run in that table's lane when the server has table threads (fleet.ps.server.lanes).
_LANE_OPS = frozenset(
    (Op.PULL_DENSE, Op.PULL_SPARSE, Op.PUSH_DENSE_GRAD, Op.PUSH_SPARSE_GRAD, Op.PUSH_DENSE_DELTA, Op.PUSH_SPARSE_DELTA)
)
# Served on the loop thread without waiting for the lanes: they touch no table (a composite's parts go to lanes).
_BESIDE_LANES = frozenset((Op.HELLO, Op.PULL_SPARSE_MANY, Op.PUSH_SPARSE_GRAD_MANY))
_PULL_DENSE = int(Op.PULL_DENSE)
_REQUEST = int(Status.REQUEST)
_FLOAT32 = DTYPE_CODES[torch.float32]


class ParameterServer:
    """Holds table shards and answers workers until every worker has sent STOP.

    ``endpoint`` is bound at construction (so a port clash surfaces at once and
    port 0 resolves to :attr:`endpoint`); :meth:`serve` runs the loop in the
    calling thread and returns the stats. :meth:`shutdown` may be called from
    any thread.
    """

    def __init__(
        self,
        endpoint: str,
        secret: bytes,
        server_index: int,
        num_workers: int,
        timeout_s: float,
        *,
        limits: RequestLimits | None = None,
        encryption: str = "none",
        rejoin: bool = False,
        torch_threads: int | None = 1,
        checkpoint_record_dir: str | None = None,
        ipc: bool = True,
        threads: int | None = None,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers}; a parameter server needs at least one worker")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}; it must be positive")
        if threads is not None and not 0 <= threads <= 256:
            raise ValueError(f"threads={threads}; a parameter server runs its tables on 0 (the loop) to 256 threads")
        self.server_index = server_index
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.torch_threads = torch_threads
        self.limits = limits if limits is not None else RequestLimits()
        auth.check_secret(secret)
        self.encryption = auth.check_encryption(encryption)
        self._sockets = ServerSockets(endpoint, secret, server_index, self.encryption, ipc)
        self.endpoint = self._sockets.endpoint
        #: the Unix socket workers on this host use instead of TCP (None: off, or unusable here)
        self.ipc_path = self._sockets.ipc_path
        self.incarnation = self._sockets.incarnation
        self._sock = self._sockets.router
        self._zap = self._sockets.zap
        self._direct = self._sockets.direct
        self._shutdown = threading.Event()
        self._waiter = Waiter()
        self._closed = False
        self._shards: dict[int, agg.DenseShard | agg.SparseShard] = {}
        self._waiting = Waitlist()
        self._inbox = FairInbox()
        self.rejoin = rejoin
        self._workers = Workers(num_workers, rejoin, dead_after_s=max(3.0, min(self.timeout_s, 10.0)))
        self._liveness = self._workers.liveness
        self._started = time.monotonic()
        self._ops: dict[str, int] = defaultdict(int)
        self._table_ops: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._counts: dict[str, int] = defaultdict(int)
        #: per small dense table, the reply its last quick pull sent (see _quick_dense; the table's bytes at most)
        self._flat_replies: dict[int, small.FlatReply] = {}
        #: table threads (fleet.ps.server.lanes); 0: every table operation on the loop thread
        self.threads = default_threads() if threads is None else threads
        self._lock = ServerLock()
        self._lanes: Lanes | None = None  # started by serve()
        self._outbox = Outbox() if self.threads else None
        self.replies = replies = Replies(server_index, self.timeout_s, self._counts, self._send)
        self.reductions = Reductions(
            self._waiting, replies, lambda: self._workers.active, server_index, lambda: self.tables.close_ready_steps()
        )
        self.tables = TableRequests(
            self._shards,
            self._waiting,
            replies,
            self._counts,
            lambda: self._workers.active,
            server_index=server_index,
            num_workers=num_workers,
            limits=self.limits,
            checkpoint_record_dir=checkpoint_record_dir,
            outside=self._lock.outside,
        )
        tables = self.tables
        # without table threads a composite whose parts all answer at once is served at once (fleet.ps.server.many)
        inline = Inline(lambda: self._lanes is None, tables, self._count_table_op, self._failed)
        many = ManyRequests(self._shards, self._route, replies.ok, inline)
        self._handlers = {
            Op.HELLO: self._hello,
            Op.CREATE_DENSE: tables.create,
            Op.CREATE_SPARSE: tables.create,
            Op.PULL_DENSE: tables.pull,
            Op.PULL_SPARSE: tables.pull,
            Op.PUSH_DENSE_GRAD: tables.push,
            Op.PUSH_SPARSE_GRAD: tables.push,
            Op.PUSH_DENSE_DELTA: tables.push,
            Op.PUSH_SPARSE_DELTA: tables.push,
            Op.BARRIER: self.reductions.barrier,
            Op.SAVE: tables.save,
            Op.LOAD: tables.load,
            Op.STATS: lambda ident, msg: replies.ok(msg, blob=json.dumps(self.stats()).encode()),
            Op.STOP: self._stop,
            Op.ALL_REDUCE: self.reductions.all_reduce,
            Op.SHRINK: tables.shrink,
            Op.EXPORT_SPARSE: tables.export_sparse,
            Op.DENSE_STATE: tables.dense_state,
            Op.WRITE_SPARSE_ROWS: tables.write_sparse_rows,
            Op.PULL_SPARSE_MANY: many.pull,
            Op.PUSH_SPARSE_GRAD_MANY: many.push,
        }

    # ------------------------------------------------------------------ loop
    def serve(self) -> dict[str, Any]:
        """Answer requests until all workers stopped or :meth:`shutdown`; then close and return stats.

        Sets torch's intra-op threads for the process to ``torch_threads``
        (unless None): table updates are memory-bound, and idle OpenMP workers
        spin-waiting next to ZeroMQ's IO thread cost more than they save --
        measured on 2 cores, a 4 MB push took 3.5x the server CPU with 2 threads.
        """
        if self.torch_threads is not None:
            torch.set_num_threads(self.torch_threads)
        if self.threads:
            self._lanes = Lanes(self.threads, self._lock, name=f"fleet-ps{self.server_index}-table")
        poller = self._waiter
        self._sockets.register(poller)
        if self._outbox is not None:
            poller.register(self._outbox.wake_r, zmq.POLLIN)
        lock = self._lock.lock
        sockets = self._sockets
        # bound once: each round of the loop is part of a small pull's round trip
        stopping, done, zap, direct = self._shutdown.is_set, self._workers.done, self._zap.socket, self._direct
        put, serve_direct, serve_whole = self._inbox.put, self._serve_direct, self._serve_whole
        log.info("parameter server %d serving at %s", self.server_index, self.endpoint)
        try:
            with lock:
                timeout = self._poll_timeout_ms(time.monotonic())
            while not stopping() and not done():
                ready = poller.poll(timeout)  # the table threads have the lock meanwhile
                sent_before = sockets.zmq_sends
                touched = False  # whether this round received from a ZeroMQ socket (Waiter.settle)
                if zap in ready:
                    self._zap.serve()
                    touched = True
                if direct is not None:
                    direct.serve(ready, put, serve_direct, serve_whole)
                if self._sock in ready or len(self._inbox):
                    look = self._sock in ready
                    touched = True
                    for _ in range(_MAX_BATCH):
                        if look or len(self._inbox):  # before each request: a newcomer goes next
                            self._inbox.take_from(self._sock)
                        look = False  # with nothing queued the loop polls again, which sees a newcomer
                        frames = self._inbox.next()
                        if frames is None:
                            break
                        with lock:  # per request: the table threads take turns with the loop in between
                            self._send_outbox()
                            self._handle(frames)
                with lock:  # one turn of the lock for the round's end and the next wait's bound
                    self._send_outbox()
                    timeout = self._round_end(time.monotonic())
                poller.settle(ready, touched or sockets.zmq_sends != sent_before)
        finally:
            self.close()
        return self.stats()

    def _send_outbox(self) -> None:
        """Send the replies the table threads made (the loop thread owns the sockets)."""
        if self._outbox is not None:
            for ident, reply in self._outbox.take():
                self._send(ident, reply)

    def shutdown(self) -> None:
        """Ask :meth:`serve` to return (thread-safe); parked requests get an error reply."""
        self._shutdown.set()

    def _round_end(self, now: float) -> int:
        """:meth:`_expire` at ``now``, then the next wait's bound in ms (0: requests are queued)."""
        if not self._waiting.empty():
            self._expire(now)
            return 0 if len(self._inbox) else self._poll_timeout_ms(now)
        if now >= self._liveness.next_check:  # the usual round: nothing parked, so nothing expires, nobody to check
            self._check_liveness(now)
        return 0 if len(self._inbox) else _IDLE_POLL_MS + 1

    def _poll_timeout_ms(self, now: float) -> int:
        nearest = self._waiting.next_deadline(now + _IDLE_POLL_MS / 1000)
        return max(0, int((nearest - now) * 1000) + 1)

    def close(self) -> None:
        """Answer parked requests with an error and release the socket (idempotent; :meth:`serve` ends with it)."""
        if self._closed:
            return
        self._closed = True
        with self._lock.lock:
            if self._lanes is not None:  # what the lanes hold is served and answered before the socket goes
                self._lanes.drain()
                self._lanes.close()
                self._send_outbox()
            self._close_parked()
        if self._outbox is not None:
            self._outbox.close()
        self._counts["dropped"] += self._inbox.clear()  # unread, as ZeroMQ drops what its pipes hold
        self._sockets.close()
        log.info("parameter server %d at %s stopped", self.server_index, self.endpoint)

    def _close_parked(self) -> None:
        for parked in self._waiting.clear():
            self.replies.reply_error(parked.ident, parked.msg, "the parameter server is shutting down")

    # ------------------------------------------------------------- dispatch
    def _handle(self, frames: list[Any]) -> None:
        if len(frames) < 2:
            self._counts["dropped"] += 1  # not even an identity plus one frame: nobody to answer
            return
        ident = frames[0].bytes
        self._counts["bytes_in"] += sum(len(f) for f in frames[1:])
        try:
            msg = decode(frames[1:], self.tables.budget)
        except WireError as exc:
            over = isinstance(exc, RequestTooLarge)
            self._counts["over_limit" if over else "malformed"] += 1
            rid, op = (exc.request_id, exc.op) if exc.request_id else read_request_id(frames[1])
            text = f"request over the limit on parameter server {self.server_index}: {exc}" if over else None
            self.replies.reply_error(ident, Message(op=op, request_id=rid), text or f"malformed message: {exc}")
            return
        except Exception as exc:  # joining a large tensor's frames can run out of memory: answer, keep serving
            rid, op = read_request_id(frames[1])
            self.replies.reply_error(
                ident, Message(op=op, request_id=rid), self.replies.failure(exc, op_name(op), None)
            )
            return
        self._serve(ident, msg)

    def _serve(self, ident: Any, msg: Message, here: bool = False) -> None:
        """Check and serve a decoded request (``here``: on this thread, the lanes being idle)."""
        name = op_name(msg.op)
        self._ops[name] += 1
        if msg.status != Status.REQUEST:
            self.replies.reply_error(ident, msg, f"{name} arrived with reply status {msg.status}; expected a request")
            return
        if not 0 <= msg.peer < self.num_workers:
            self.replies.reply_error(ident, msg, f"worker index {msg.peer} is outside [0, {self.num_workers - 1}]")
            return
        if self._workers.seen(msg.peer, time.monotonic()):
            log.warning("parameter server %d: worker %d is back", self.server_index, msg.peer)
        if here:
            reply = self._dispatch(ident, msg)
        else:
            if self._lanes is not None and self._lanes.queued >= MAX_QUEUED:
                self._lanes.wait_below()  # the table threads are behind: take no more until they catch up
            reply = self._route(ident, msg)
        if reply is not None:
            self._send(ident, reply)

    def _serve_direct(self, ident: bytes, frames: list[memoryview]) -> bool:
        """Serve a small pull from a direct connection as it is read (:mod:`fleet.ps.protocol.quick_pulls`).

        False (it then takes the usual way, through the inbox): it is not a plain pull, or other requests
        wait in the inbox (they go first, in their turns), or a table thread is busy (it must see its
        table alone).
        """
        if len(self._inbox):
            return False
        msg = plain_pull(frames, self.tables.request_budget.bytes)
        return msg is not None and self._serve_quick(ident, msg, sum(map(len, frames)))

    def _serve_whole(self, ident: bytes, data: memoryview, got: int) -> bool:
        """:meth:`_serve_direct` of a read that is exactly one message, length prefix included (the usual pull)."""
        if len(self._inbox):
            return False
        if got == DENSE_BYTES:  # the usual small pull, a PULL_DENSE: its fields, no Message unless it is served
            fields = dense_pull(data)
            return fields is not None and self._serve_quick(ident, fields, got - 3 * 4)
        msg = whole_pull(data, got, self.tables.request_budget.bytes)
        # the frames' bytes: the read less its length prefix (a frame count and a length per frame)
        return msg is not None and self._serve_quick(ident, msg, got - (3 + len(msg.tensors)) * 4)

    def _serve_quick(self, ident: bytes, msg: Message | tuple, nbytes: int) -> bool:
        """Serve a pull read as it came (``msg``, or a PULL_DENSE's fields as :func:`dense_pull` gives them)."""
        with self._lock.lock:
            if self._outbox is not None:  # table threads: they must be idle, and what they answered leaves first
                if self._lanes is not None and self._lanes.queued:
                    return False
                if self._outbox.pending:
                    self._send_outbox()
            # counted before the answer leaves: a caller that got its answer then reads the server's stats sees it
            counts = self._counts
            counts["bytes_in"] += nbytes
            counts["direct_quick"] += 1
            if type(msg) is tuple:
                if not self._quick_dense(ident, *msg):
                    self._serve(ident, Message(_PULL_DENSE, *msg, status=_REQUEST), here=True)
            elif (
                msg.op != _PULL_DENSE
                or msg.tensors
                or not self._quick_dense(ident, msg.table, msg.peer, msg.request_id, msg.step, msg.arg)
            ):
                self._serve(ident, msg, here=True)
        return True

    def _quick_dense(self, ident: bytes, table: int, peer: int, request_id: int, step: int, arg: int, *_: Any) -> bool:
        """Answer a plain PULL_DENSE (no tensors) of a small table as :meth:`_serve` would, from the bytes the table
        keeps per version (:meth:`~fleet.ps.server.table_ops.TableRequests.quick_dense`); False: anything else (a
        worker index out of range, a table that is not a ready dense one, a pull that must wait) is left to
        :meth:`_serve`.

        Why: the usual small pull's round trip is mostly Python on both ends; this answer skips the request's and
        the reply's :class:`Message`, the reply's tensor and the general encoder, and writes the same bytes: the
        reply to a table's values at one version is written once (:class:`~fleet.ps.protocol.small.FlatReply`),
        each pull then writes its request id and step into it.
        """
        if not 0 <= peer < self.num_workers:
            return False
        quick = self.tables.quick_dense(table, arg, small.COPY_BYTES)
        if quick is None:
            return False
        version, data = quick
        reply = self._flat_replies.get(table)
        if reply is None or reply.data is not data or reply.version != version:  # new values: a new reply
            reply = small.FlatReply(_PULL_DENSE, table, self.server_index, version, _FLOAT32, data)
            self._flat_replies[table] = reply
        # the counts of _serve and _dispatch, before the answer leaves (see _serve_quick)
        self._ops["PULL_DENSE"] += 1
        self._table_ops[table]["PULL_DENSE"] += 1
        self._counts["bytes_out"] += reply.frame_bytes
        sent = self._direct.send_reused(ident, reply.fill(request_id, step))
        # the worker's liveness record once the answer is on its way (the caller waits for it meanwhile)
        if self._workers.seen(peer, time.monotonic()):
            log.warning("parameter server %d: worker %d is back", self.server_index, peer)
        if not sent:
            self._counts["replies_dropped"] += 1
        return True

    def _route(self, ident: Any, msg: Message) -> Message | None:
        """Serve ``msg`` now, or queue it in its table's lane (None: answered later, through ``ident``)."""
        lanes = self._lanes
        if lanes is None:
            return self._dispatch(ident, msg)
        if msg.op in _LANE_OPS:
            lanes.submit(msg.table, lambda: self._in_lane(ident, msg))
            return None
        if msg.op not in _BESIDE_LANES:
            lanes.drain()  # it sees every earlier table operation done, and none runs beside it
            self._send_outbox()  # and their answers leave before its own
        return self._dispatch(ident, msg)

    def _in_lane(self, ident: Any, msg: Message) -> None:
        """A table operation on a table thread (holding the server lock but around the table's kernel)."""
        if isinstance(ident, Part) and ident.gather.answer is not None:
            return  # an earlier part of its composite failed: the parts after a failure are not served
        reply = self._dispatch(ident, msg)
        if reply is not None:
            self._send(ident, reply)

    def _dispatch(self, ident: Any, msg: Message) -> Message | None:
        """Serve one request: its reply, or None when it was parked (answered later, through ``ident``)."""
        name = op_name(msg.op)
        on_table = msg.op not in _NOT_ON_A_TABLE
        if on_table:
            self._table_ops[msg.table][name] += 1
        try:
            handler = self._handlers.get(msg.op)  # keyed by Op, which hashes as its int
            return (handler or self._handlers[Op(msg.op)])(ident, msg)
        except Exception as exc:  # out of memory, or a bug in a table: either must not take the server down
            return self._failed(msg, exc)

    def _count_table_op(self, table: int, name: str) -> None:
        self._table_ops[table][name] += 1

    def _failed(self, msg: Message, exc: Exception) -> Message:
        """The error reply to ``msg``, whose handler raised ``exc`` (called while ``exc`` is being handled)."""
        if isinstance(exc, agg.ShardError):
            return self.replies.error(msg, str(exc), exc.details)
        if isinstance(exc, (ValueError, KeyError, TypeError)):
            return self.replies.error(msg, str(exc) or type(exc).__name__)
        on_table = msg.op not in _NOT_ON_A_TABLE
        return self.replies.error(msg, self.replies.failure(exc, op_name(msg.op), msg.table if on_table else None))

    def _send(self, ident: bytes | Part, reply: Message) -> None:
        if self._outbox is not None and self._lock.on_pool_thread():
            self._outbox.put(ident, reply)  # the loop thread sends it: sockets are not thread-safe
            return
        if isinstance(ident, Part):  # one table's part of a composite request (fleet.ps.server.many)
            due = deliver(ident, reply)
            if due is None:
                return
            ident, reply = due
        direct = self._direct
        if direct is not None and type(ident) is bytes and direct.owns(ident):
            packed = small.pack(reply)  # the usual answer on the direct path: one struct call, the same bytes
            if packed is not None:
                self._counts["bytes_out"] += packed[1]
                if not direct.send_buffers(ident, packed[0]):
                    self._counts["replies_dropped"] += 1
                return
        try:
            frames = encode(reply)
        except WireError as exc:  # e.g. a table answered with a tensor the wire cannot carry
            log.error("parameter server %d cannot encode its %s reply: %s", self.server_index, reply.op_name(), exc)
            text = f"internal error: the reply cannot be encoded ({exc})".encode()
            frames = encode(
                Message(reply.op, reply.table, self.server_index, reply.request_id, status=Status.ERROR, blob=text)
            )
        self._counts["bytes_out"] += sum(map(len, frames))
        try:
            sent = self._sockets.send(ident, frames)
        except zmq.ZMQError as exc:
            sent = False
            log.warning("could not answer %s: %s", op_name(reply.op), exc)
        if not sent:
            self._counts["replies_dropped"] += 1

    def _check_liveness(self, now: float) -> None:
        """Name the workers that went silent (the loop runs this after every batch of requests)."""
        for worker in self._workers.newly_gone(now, lambda: {parked.msg.peer for parked in self._waiting}):
            log.warning(
                "parameter server %d: worker %d sent nothing for %.1f s: it died or hung%s",
                self.server_index,
                worker,
                self._workers.liveness.dead_after_s,
                "; sync steps go on without it until it rejoins" if self.rejoin else "",
            )
            if self.rejoin:
                if self._lanes is not None:
                    self._lanes.drain()  # steps close on the loop thread: no table may be working meanwhile
                self.tables.close_ready_steps()
                self.reductions.release_barrier()
                self.reductions.release()

    # ------------------------------------------------------------------ ops
    def _hello(self, ident: bytes, msg: Message) -> Message:
        info = {"server_index": self.server_index, "num_workers": self.num_workers, "endpoint": self.endpoint}
        info.update(self._sockets.hello())  # where a worker on this host may reach this server
        return self.replies.ok(msg, blob=json.dumps(info).encode(), version=self.incarnation)

    def _stop(self, ident: bytes, msg: Message) -> Message:
        self._workers.stop(msg.peer)
        self._waiting.barrier.pop(msg.peer, None)
        self._waiting.reduce.pop(msg.peer, None)
        # fewer workers now: sync steps, barriers and all-reduces waiting for the stopped one may complete
        self.tables.close_ready_steps()
        self.reductions.release_barrier()
        self.reductions.release()
        return self.replies.ok(msg)

    # ------------------------------------------------------------- deadlines
    def _expire(self, now: float) -> None:
        self._check_liveness(now)
        if self._waiting.empty():
            return
        pulls, creates, barrier = self._waiting.expired(now)
        self.tables.expire_pulls(pulls, now)
        for table, parked in creates:
            waited = now - parked.since
            text = f"table {table} was not created with initial values (by worker 0) within {waited:.2f} s"
            self.replies.reply_error(parked.ident, parked.msg, text)
        self.reductions.expire_barrier(barrier, now)
        self.reductions.expire(now)

    def restore(self, dirname: str) -> list[int]:
        """Load this server's shards saved under ``dirname`` (see :meth:`TableRequests.restore`)."""
        return self.tables.restore(dirname)

    # ----------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        """Counters for tests, metrics and the end-of-run report (JSON-serialisable)."""
        stale: dict[str, int] = defaultdict(int)
        for shard in self._shards.values():
            for worker, n in shard.stale_dropped.items():
                stale[str(worker)] += n
        return {
            "server_index": self.server_index,
            "endpoint": self.endpoint,
            "uptime_s": round(time.monotonic() - self._started, 3),
            "ops": dict(self._ops),
            "table_ops": {str(t): dict(ops) for t, ops in self._table_ops.items()},
            "tables": {str(t): shard.info() for t, shard in self._shards.items()},
            "stale_dropped": dict(stale),
            "stopped_workers": sorted(self._workers.stopped),
            "gone_workers": sorted(self._workers.liveness.ever_gone),
            **{
                k: self._counts.get(k, 0)
                for k in ("bytes_in", "bytes_out", "errors", "malformed", "over_limit", "out_of_memory", "disk_full")
            },
            "auth_rejected": self._zap.rejected,
            "ipc_endpoint": self.ipc_path,
            "peers_admitted": dict(self._zap.admitted),
            "direct_admitted": self._direct.admitted if self._direct is not None else 0,
            "direct_rejected": self._direct.rejected if self._direct is not None else 0,
            "direct_quick": self._counts.get("direct_quick", 0),  # pulls served as read (fleet.ps.protocol.quick_pulls)
            "dropped": self._counts.get("dropped", 0) + self._counts.get("replies_dropped", 0),
            "table_threads": self.threads,
        }


def main(argv: list[str] | None = None) -> int:
    """Process entry point: ``python -m fleet.ps.server.loop --endpoint H:P --index I --workers N``.

    The secret comes from FLEET_SECRET (hex), never from the command line,
    where other users of the machine could read it.
    """
    from fleet.runtime import env

    parser = argparse.ArgumentParser(description="fleet parameter server")
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--max-request-ids", type=int, default=RequestLimits.max_ids)
    parser.add_argument("--max-request-mb", type=float, default=RequestLimits.max_bytes / (1 << 20))
    parser.add_argument("--encryption", choices=auth.ENCRYPTIONS, default="none")
    parser.add_argument("--no-ipc", dest="ipc", action="store_false", help="TCP only, for workers on this host too")
    parser.add_argument(
        "--threads", type=int, default=None, help="table threads (0: all on the loop thread; default: by the cores)"
    )
    args = parser.parse_args(argv)
    secret_hex = env.current().require(env.FLEET_SECRET, "the parameter server authenticates workers with it")
    try:
        secret = bytes.fromhex(secret_hex)
    except ValueError:
        raise env.EnvError(f"{env.FLEET_SECRET} is not hex") from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        limits = RequestLimits(args.max_request_ids, int(args.max_request_mb * (1 << 20)))
        server = ParameterServer(
            args.endpoint,
            secret,
            args.index,
            args.workers,
            args.timeout,
            limits=limits,
            encryption=args.encryption,
            ipc=args.ipc,
            threads=args.threads,
        )
    except zmq.ZMQError as exc:
        if exc.errno == zmq.EADDRINUSE:
            log.error("cannot bind %s: address in use", args.endpoint)
            return env.EXIT_PORT_IN_USE
        raise
    print(f"fleet parameter server {args.index} listening on {server.endpoint}", flush=True)
    stats = server.serve()
    print(json.dumps(stats), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
