"""The worker's IO thread: owns every ZeroMQ socket to the servers.

Why a thread: ZeroMQ sockets are not thread-safe, and the training thread
must be able to start a push, go on computing, and collect the result later.
Public calls build a :class:`Job` (one message per server it touches plus a
function that combines the replies) and put it on a bounded queue; this
thread sends the messages, matches replies by request id, enforces each
job's deadline and resolves the job's :class:`~concurrent.futures.Future`.

Failure detection: a deadline per job (the strategy's timeout); a socket
monitor per server that turns a lost connection into an immediate
:class:`PSServerUnavailable` for the requests in flight on it, and a refused
handshake into :class:`PSAuthError`.

Each server's socket is a :class:`~fleet.ps.client.routes.Route`: TCP, or the server's Unix
socket when it runs on this host (decided once, when the client starts). There, the pulls and
pushes of rows and gradients go over the server's direct socket instead, written and read by this
thread itself (:mod:`fleet.ps.client.bulk`).
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from fleet.ps.client import bulk
from fleet.ps.client.bulk import BulkConn, BulkLost, eligible
from fleet.ps.client.direct import DIRECT_OPS, SMALL_BYTES, DirectCalls, Settled, message_bytes
from fleet.ps.client.routes import Route
from fleet.ps.protocol import auth, small, unix
from fleet.ps.protocol import local as same_host
from fleet.ps.protocol.errors import (
    PSAuthError,
    PSClientClosed,
    PSError,
    PSRemoteError,
    PSServerUnavailable,
    WireError,
    name_tables,
    parse_error_reply,
)
from fleet.ps.protocol.wire import (
    MAX_WIRE_FRAME,
    MORE_FOLLOWS,
    Message,
    Op,
    Status,
    decode,
    encode,
    op_name,
    read_request_id,
)

log = logging.getLogger(__name__)

_IDLE_POLL_MS = 100
# Of one call split into pieces (a huge batch), at most this many per server are sent and not yet
# answered: the server then holds only a few of them queued, and another worker's request, served in
# turn with them (fleet.ps.server.inbox), is not stuck behind thousands in ZeroMQ's pipes.
PIECES_ON_THE_WIRE = 4
_MAX_BATCH = 256
# a plain int: ``zmq.POLLIN`` is an enum member, and ``&`` on one costs a Python-level call per poll
_POLLIN = int(zmq.POLLIN)
_POLLERR = int(zmq.POLLERR)
_POLLOUT = int(zmq.POLLOUT)


def _more_follows(msg: Message) -> bool:
    """Whether ``msg`` is a piece of a sparse push with more pieces after it."""
    return msg.op in (Op.PUSH_SPARSE_GRAD, Op.PUSH_SPARSE_DELTA) and msg.arg == MORE_FOLLOWS


@dataclass(eq=False)
class Job:
    """One logical request: a message per server, combined into one result."""

    future: Future
    parts: list[tuple[int, Message]]  # (server index, request)
    combine: Callable[[list[Message]], Any]
    timeout_s: float
    replies: list[Message | None] = field(default_factory=list)
    pending: set[int] = field(default_factory=set)  # request ids not answered yet
    deadline: float = 0.0
    done: bool = False
    # Wait for every server's answer before failing on one's error: a SAVE whose directory the
    # caller removes on failure must not have a server still writing into it.
    settle: bool = False
    error: BaseException | None = None
    held: dict[int, deque] = field(default_factory=dict)  # per server: parts beyond PIECES_ON_THE_WIRE
    # The caller waits for the result at once: it may be sent and answered on its own thread (fleet.ps.client.direct).
    direct: bool = False
    counted: bool = False  # counted in IOThread's outstanding jobs (uncounted once, when it settles)


class IOThread:
    """Runs the socket loop for one :class:`~fleet.ps.client.client.PSClient`."""

    def __init__(
        self,
        endpoints: Sequence[str],
        secret: bytes,
        worker_index: int,
        max_in_flight: int,
        encryption: str = "none",
        ipc: bool = True,
        pull_reply_bound: int = 0,
    ):
        self.endpoints = list(endpoints)
        self.secret = auth.check_secret(secret)
        self.encryption = auth.check_encryption(encryption)
        self.worker_index = worker_index
        self.max_in_flight = max_in_flight
        self.ipc = same_host.enabled(ipc)
        self._routes: list[Route] = []
        self._sockets: list[zmq.Socket] = []  # per server, the socket its requests go on: its route's
        self.queue: queue.Queue[Job] = queue.Queue(maxsize=max_in_flight)
        self.stale_pushes = 0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._closing = threading.Event()
        self._ready = threading.Event()
        # per server: request ids sent and not answered or given up; a route changes socket only when empty
        self._on_wire: list[set[int]] = [set() for _ in self.endpoints]
        self._startup_error: BaseException | None = None
        self._ids = itertools.count(1)
        self._inflight: dict[int, tuple[int, Job, int]] = {}  # request id -> (server, job, part index)
        self._active: set[Job] = set()
        self._outbox: list[deque[tuple[int, Message, Job]]] = [deque() for _ in self.endpoints]
        self._refused: dict[int, str] = {}  # server -> why its handshake failed
        self._table_names: dict[int, str] = {}  # table id -> its name in this worker's model, for error messages
        # server -> why its last handshake failed for a reason other than the secret (cleared by a handshake
        # that succeeds): requests made meanwhile fail at once with it instead of waiting for their deadline
        self._failing: dict[int, str] = {}
        self._incarnations = [0] * len(endpoints)  # per server, as its last HELLO reply said; 0: not known yet
        # Jobs submitted and not settled: a caller's own request may go only when none is (fleet.ps.client.direct).
        self._outstanding = 0
        self._count_lock = threading.Lock()
        self._direct = DirectCalls(self.secret, self._unavailable, self._remote)
        # per server: the IO thread's own connection to its direct socket (fleet.ps.client.bulk), whether one was
        # tried (once: a server whose connection failed or broke keeps ZeroMQ), and whether the requests on the
        # wire went that way (a server's requests change ways only when none is on the wire)
        self._pull_reply_bound = pull_reply_bound  # the most bytes a sparse pull's answer holds (0: pulls keep ZeroMQ)
        self._bulk: list[BulkConn | None] = [None] * len(self.endpoints)
        self._bulk_tried = [False] * len(self.endpoints)
        self._wire_bulk = [False] * len(self.endpoints)
        self._bulk_changed = False  # a bulk connection opened or closed: the poller is rebuilt
        self.thread = threading.Thread(target=self._run, name=f"fleet-ps-io-w{worker_index}", daemon=True)
        #: the IO thread's ``is_alive()``, kept as a flag: a direct call asks it each time, and the method takes a lock
        self._running = False

    # ------------------------------------------------------ caller side
    def start(self, timeout_s: float) -> None:
        self._running = True
        try:
            self.thread.start()
        except BaseException:
            self._running = False
            raise
        if not self._ready.wait(timeout_s):
            raise PSClientClosed(f"the parameter-server IO thread did not start within {timeout_s} s")
        if self._startup_error is not None:
            raise self._startup_error

    def submit(self, job: Job) -> Future:
        """Queue ``job`` (blocks while ``max_in_flight`` jobs are queued, up to the job's timeout).

        A ``direct`` job that may go from the calling thread (see :mod:`fleet.ps.client.direct`) is
        sent and answered there instead (:meth:`call_direct`): the future returned is resolved.
        """
        if job.direct:
            done = self.call_direct(job.parts, job.combine, job.timeout_s)
            if done is not None:
                return done
        elif self._closing.is_set() or not self.thread.is_alive():
            raise PSClientClosed("the parameter-server client is closed")
        with self._count_lock:
            self._outstanding += 1
        job.counted = True
        try:
            self.queue.put(job, timeout=job.timeout_s)
        except queue.Full:
            self._uncount(job)
            raise PSError(
                f"{self.max_in_flight} requests stayed queued for {job.timeout_s} s: the parameter servers are not "
                "answering, or a future callback blocks the client's IO thread"
            ) from None
        self.wake()
        if not self.thread.is_alive():  # it ended between the check above and the put: nobody will answer
            self._fail_everything(PSClientClosed("the parameter-server client is closed"))
        return job.future

    def call_direct(
        self, parts: list[tuple[int, Message]], combine: Callable[[list[Message]], Any], timeout_s: float
    ) -> Future | None:
        """Send ``parts`` and wait for their answers on this thread, over the servers' direct sockets, when they
        may go that way (see :mod:`fleet.ps.client.direct`): a resolved future (``combine`` of the replies, or
        the error the IO thread would give); None when they must be queued (:meth:`submit`).

        No :class:`Job` and no queue: the usual small pull's round trip is mostly this side's Python.
        """
        if self._closing.is_set() or not self._running:
            raise PSClientClosed("the parameter-server client is closed")
        ready = self._direct_parts(parts, timeout_s)
        if ready is None:
            return None
        try:
            result = combine(self._direct.call(ready, timeout_s))
        except BaseException as exc:
            return Settled(exception=exc)
        return Settled(result)

    def pull_direct(
        self, op: int, table: int, peer: int, arg: int, combine: Callable[[list[Message]], Any], timeout_s: float
    ) -> Future | None:
        """:meth:`call_direct` of the request ``Message(op, table, peer, arg=arg)`` (no tensors) to this client's
        one server, written without a :class:`Message` (:meth:`~fleet.ps.client.direct.DirectCalls.pull`);
        None when it must be queued.

        Why: a blocking small pull is the round trip W3 measures, and on this host most of it is this side's
        Python; the checks are :meth:`_direct_parts`' for one server.
        """
        if self._closing.is_set() or not self._running:
            raise PSClientClosed("the parameter-server client is closed")
        if self._outstanding or not self._routes or len(self._routes) != 1 or op not in DIRECT_OPS:
            return None
        path = self._routes[0].direct_path
        incarnation = self._incarnations[0]
        if path is None or not incarnation or 0 in self._refused or 0 in self._failing:
            return None
        request_id = next(self._ids)
        timeout_ms = int(timeout_s * 1000)
        request = small.pull_request(op, table, peer, request_id, arg, timeout_ms)
        fields = (op, table, peer, request_id, 0, arg, 0.0, timeout_ms)
        try:
            result = combine([self._direct.pull(0, path, incarnation, request, fields, timeout_s)])
        except BaseException as exc:
            return Settled(exception=exc)
        return Settled(result)

    def _uncount(self, job: Job) -> None:
        if job.counted:
            job.counted = False
            with self._count_lock:
                self._outstanding -= 1

    def _direct_parts(
        self, parts: list[tuple[int, Message]], timeout_s: float
    ) -> list[tuple[int, Message, list[memoryview], str, int]] | None:
        """Per message of a call that may go from the calling thread: (server, message, its bytes as the direct
        path writes them, the server's direct socket, the incarnation its last HELLO gave); else None."""
        if self._outstanding or not self._routes or not parts:
            return None  # a request of this client is queued or on the wire: this one must not overtake it
        routes, incarnations, out = self._routes, self._incarnations, []
        timeout_ms = int(timeout_s * 1000)
        for server, msg in parts:
            path = routes[server].direct_path
            if (
                path is None
                or msg.op not in DIRECT_OPS
                or not incarnations[server]
                or server in self._refused
                or server in self._failing
                or (out and any(server == o[0] for o in out))
            ):
                return None  # no direct socket (another host, TCP, CURVE), or a failure the IO thread reports
            msg.request_id = next(self._ids)
            msg.timeout_ms = timeout_ms
            packed = small.pack(msg)  # the usual pull: one struct call (same bytes as the general way)
            if packed is None:
                frames = encode(msg)
                packed = unix.buffers(frames), message_bytes(frames)
            if packed[1] > SMALL_BYTES:
                return None
            out.append((server, msg, packed[0], path, incarnations[server]))
        return out

    def wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full, so the IO thread is already due to wake up

    def close(self, timeout_s: float) -> None:
        self._closing.set()
        self.wake()
        self._direct.close()
        self.thread.join(timeout_s)
        if not self.thread.is_alive():
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)

    # ---------------------------------------------------------- IO side
    def _run(self) -> None:
        try:
            self._main()
        finally:
            self._running = False

    def _main(self) -> None:
        ctx = zmq.Context(io_threads=1)
        try:
            for endpoint in self.endpoints:
                self._routes.append(
                    Route(ctx, endpoint, self._configure, self.secret, self.worker_index, self._ids, self.ipc)
                )
        except BaseException as exc:
            self._startup_error = PSError(f"cannot set up connections to parameter servers {self.endpoints}: {exc}")
            self._ready.set()
            ctx.destroy(linger=0)
            return
        self._sockets = [route.socket for route in self._routes]
        self._ready.set()
        try:
            self._loop()
        except BaseException as exc:  # never leave a caller waiting on a dead thread
            log.exception("parameter-server IO thread failed")
            self._fail_everything(PSClientClosed(f"the parameter-server IO thread failed: {exc!r}"))
            raise
        finally:
            self._fail_everything(PSClientClosed("the parameter-server client was closed"))
            for conn in self._bulk:
                if conn is not None:
                    conn.close()
            for route in self._routes:
                route.close()
            ctx.destroy(linger=0)

    def _configure(self, sock: zmq.Socket, address: str) -> None:
        """Options of every socket to a server, TCP or Unix (``address``: where it will connect)."""
        sock.linger = 0
        sock.sndhwm = sock.rcvhwm = 10000
        sock.sndbuf = sock.rcvbuf = 4 << 20  # fixed kernel buffers: fewer wake-ups per MB than autotuning
        sock.maxmsgsize = MAX_WIRE_FRAME  # no frame of a reply is larger (fleet.ps.protocol.wire)
        auth.configure_client(sock, self.secret, f"worker-{self.worker_index}", self.encryption)
        if address.startswith("tcp://") and ":" in address.removeprefix("tcp://").rpartition(":")[0]:
            sock.ipv6 = True

    def transports(self) -> list[str]:
        """How each server is reached: "ipc" (its Unix socket on this host) or "tcp"."""
        return [route.transport for route in self._routes]

    def _poller(self) -> zmq.Poller:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        for route in self._routes:
            for sock, mon in route.polled(rebuilding=True):
                poller.register(sock, zmq.POLLIN)
                poller.register(mon, zmq.POLLIN)
        self._bulk_changed = False
        for conn in self._bulk:
            if conn is not None:
                poller.register(conn.fd, zmq.POLLIN | (zmq.POLLOUT if conn.pending else 0))
        return poller

    def _loop(self) -> None:
        poller = self._poller()
        blocked: set[int] = set()  # servers whose socket is also polled for POLLOUT
        bulk_out: set[int] = set()  # servers whose bulk connection is also polled for POLLOUT
        while not self._closing.is_set():
            self._admit()
            waiting_out = self._flush()
            if self._bulk_changed or any(route.changed for route in self._routes):  # (fleet.ps.client.routes)
                poller, blocked = self._poller(), set()
                bulk_out = {i for i, conn in enumerate(self._bulk) if conn is not None and conn.pending}
            for i in blocked ^ waiting_out:
                flags = zmq.POLLIN | (zmq.POLLOUT if i in waiting_out else 0)
                poller.modify(self._sockets[i], flags)
            blocked = waiting_out
            writing = {i for i, conn in enumerate(self._bulk) if conn is not None and conn.pending}
            for i in bulk_out ^ writing:
                poller.modify(self._bulk[i].fd, zmq.POLLIN | (zmq.POLLOUT if i in writing else 0))
            bulk_out = writing
            ready = dict(poller.poll(self._poll_timeout_ms()))
            if self._wake_r in ready:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
            for i, conn in enumerate(self._bulk):
                if conn is not None and conn.fd in ready:
                    self._bulk_event(i, conn, ready[conn.fd])
            for i, route in enumerate(self._routes):
                for sock, mon in route.polled():
                    if ready.get(sock, 0) & _POLLIN:
                        self._receive(i, sock)
                    if mon in ready:
                        if mon is route.monitor:
                            self._monitor_events(i)
                        else:
                            route.trial_events(mon)
            now = time.monotonic()
            for route in self._routes:
                route.tick(now)
            self._expire(now)

    def _poll_timeout_ms(self) -> int:
        if not self.queue.empty() and len(self._active) < self.max_in_flight:
            return 0
        now, nearest = time.monotonic(), _IDLE_POLL_MS / 1000
        for job in self._active:
            nearest = min(nearest, job.deadline - now)
        return max(0, int(nearest * 1000) + 1)

    def _admit(self) -> None:
        """Move queued jobs onto the wire while fewer than ``max_in_flight`` are active."""
        while len(self._active) < self.max_in_flight:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                return
            if not job.future.set_running_or_notify_cancel():
                self._uncount(job)
                continue
            job.deadline = time.monotonic() + job.timeout_s
            job.replies = [None] * len(job.parts)
            self._active.add(job)
            if not job.parts:
                self._finish(job)
                continue
            sent: dict[int, int] = {}
            for part, (server, msg) in enumerate(job.parts):
                if server in self._refused:
                    self._fail(job, self._refused_error(server, msg))
                    break
                if server in self._failing:
                    self._fail(job, self._unavailable(server, msg, self._failing[server]))
                    break
                msg.request_id = next(self._ids)
                msg.timeout_ms = int(job.timeout_s * 1000)
                job.pending.add(msg.request_id)
                self._inflight[msg.request_id] = (server, job, part)
                sent[server] = sent.get(server, 0) + 1
                if sent[server] > PIECES_ON_THE_WIRE:
                    job.held.setdefault(server, deque()).append((server, msg, job))
                else:
                    self._outbox[server].append((server, msg, job))

    def _flush(self) -> set[int]:
        """Send what the sockets accept now; return the servers with messages still waiting."""
        waiting = set()
        for server, box in enumerate(self._outbox):
            if self._routes and self._routes[server].verified and not self._on_wire[server]:
                self._routes[server].switch()  # nothing on the wire to overtake: its Unix socket from now on
                self._sockets[server] = self._routes[server].socket
            while box:
                _, msg, job = box[0]
                if job.done:
                    box.popleft()
                    continue
                frames = encode(msg)
                bulk = self._bulk_for(server, msg, frames)
                if self._on_wire[server] and self._wire_bulk[server] != (bulk is not None):
                    break  # the other way has requests on the wire: this one waits for their answers (order)
                if bulk is not None:
                    if bulk.pending:
                        break  # the request before it is still being written (POLLOUT)
                    box.popleft()
                    self._on_wire[server].add(msg.request_id)
                    self._wire_bulk[server] = True
                    try:
                        bulk.send(unix.buffers(frames))
                    except BulkLost as exc:
                        self._bulk_lost(server, str(exc))
                    continue
                try:
                    self._sockets[server].send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    waiting.add(server)
                    break
                box.popleft()
                self._on_wire[server].add(msg.request_id)
                self._wire_bulk[server] = False
        return waiting

    def _bulk_for(self, server: int, msg: Message, frames: list[Any]) -> BulkConn | None:
        """The bulk connection ``msg`` goes on (made at the first request that may use it), or None: ZeroMQ."""
        if not eligible(msg, self._pull_reply_bound) or message_bytes(frames) > bulk.MAX_BULK:
            return None
        conn = self._bulk[server]
        if conn is not None or self._bulk_tried[server] or not self._routes:
            return conn
        route = self._routes[server]
        path = route.direct_path
        if path is None or not self._incarnations[server] or server in self._refused or server in self._failing:
            return None  # not (yet) on the server's Unix socket, or it offers no direct socket
        self._bulk_tried[server] = True
        try:
            conn = BulkConn(path, self.secret, self._incarnations[server])
        except (OSError, BulkLost) as exc:
            log.info("parameter server %d: no bulk connection to its direct socket (%s); keeping ZeroMQ", server, exc)
            return None
        self._bulk[server] = conn
        self._bulk_changed = True
        return conn

    def _bulk_event(self, server: int, conn: BulkConn, flags: int) -> None:
        """Write on / read from ``server``'s bulk connection as the poller says."""
        try:
            if flags & _POLLOUT and conn.pending:
                conn.flush()
            if flags & (_POLLIN | _POLLERR):
                for frames in conn.receive():
                    self._bulk_reply(server, frames)
        except BulkLost as exc:
            self._bulk_lost(server, str(exc))

    def _bulk_reply(self, server: int, frames: list[memoryview]) -> None:
        try:
            reply = decode(frames)
        except WireError as exc:
            log.warning("malformed reply from parameter server %d: %s", server, exc)
            entry = self._inflight.get(exc.request_id or read_request_id(frames[0])[0])
            if entry is not None:
                self._fail(entry[1], self._remote(server, exc.op, f"malformed reply: {exc}"))
            return
        self._answered(server, reply)

    def _bulk_lost(self, server: int, why: str) -> None:
        """``server``'s bulk connection broke: what is on it fails now; its requests go through ZeroMQ from now on."""
        conn = self._bulk[server]
        if conn is not None:
            conn.close()
            self._bulk[server] = None
            self._bulk_changed = True
        log.info("parameter server %d: bulk connection lost (%s); keeping ZeroMQ", server, why)
        if self._wire_bulk[server]:
            self._fail_server(server, f"closed the connection ({why}; the server exited or crashed)")

    def _receive(self, server: int, sock: zmq.Socket | None = None) -> None:
        """Handle what arrived from ``server`` on ``sock`` (by default the socket its requests go on)."""
        sock = self._sockets[server] if sock is None else sock
        route = self._routes[server] if self._routes else None
        for _ in range(_MAX_BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                reply = decode(frames)
            except WireError as exc:
                rid = exc.request_id or read_request_id(frames[0])[0]
                entry = self._inflight.get(rid)
                log.warning("malformed reply from parameter server %d: %s", server, exc)
                if entry is not None:
                    self._fail(entry[1], self._remote(server, exc.op, f"malformed reply: {exc}"))
                continue
            if reply.op == Op.HELLO and reply.status == Status.OK and sock is self._sockets[server]:
                self._check_incarnation(server, reply.arg)
            if route is not None and route.answer(sock, reply):
                if route.changed:  # settled: the socket being read may be closed now
                    return
                continue
            self._answered(server, reply)

    def _answered(self, server: int, reply: Message) -> None:
        """Take ``server``'s answer to one of this client's requests (whichever way it came)."""
        self._on_wire[server].discard(reply.request_id)
        entry = self._inflight.pop(reply.request_id, None)
        if entry is None:
            return  # the answer to a request that already timed out or failed
        _, job, part = entry
        held = job.held.get(server)
        if held:  # one of this call's pieces is answered: the next may go
            self._outbox[server].append(held.popleft())
        if reply.status == Status.ERROR:
            error = self._remote(server, reply.op, reply.text())
            if not job.settle:
                self._fail(job, error)
                return
            job.error = job.error or error
            job.pending.discard(reply.request_id)
            if not job.pending:
                self._fail(job, job.error)
            return
        if reply.status == Status.STALE and not _more_follows(job.parts[part][1]):
            self.stale_pushes += 1  # once per push, with its last piece
        elif reply.op == Op.PUSH_SPARSE_GRAD_MANY and reply.tensors:  # once per table part found stale
            self.stale_pushes += int((reply.tensors[0] == Status.STALE).sum())
        job.pending.discard(reply.request_id)
        job.replies[part] = reply
        if not job.pending and not job.done:
            if job.error is not None:
                self._fail(job, job.error)
            else:
                self._finish(job)

    def _finish(self, job: Job) -> None:
        self._retire(job)
        try:
            result = job.combine(job.replies)  # type: ignore[arg-type]
        except BaseException as exc:
            job.future.set_exception(exc)
        else:
            job.future.set_result(result)

    def _fail(self, job: Job, exc: BaseException) -> None:
        if job.done:
            return
        self._retire(job)
        job.future.set_exception(exc)

    def _retire(self, job: Job) -> None:
        self._uncount(job)  # before its future resolves: the caller's next request may go from its own thread
        job.done = True
        self._active.discard(job)
        for rid in job.pending:
            entry = self._inflight.pop(rid, None)
            if entry is not None:
                self._on_wire[entry[0]].discard(rid)
        job.pending.clear()

    def name_table(self, table: int, name: str | None) -> None:
        """Name ``table`` in the errors servers send about it (its module's path in this worker's model)."""
        if name:
            self._table_names[table] = name

    def _remote(self, server: int, op: int, text: str) -> PSRemoteError:
        message, details = parse_error_reply(text)
        message = name_tables(message, self._table_names)
        return PSRemoteError(server, self.endpoints[server], op_name(op), message, details)

    def _unavailable(self, server: int, msg: Message, why: str, cls: type = PSServerUnavailable) -> PSError:
        name = op_name(msg.op)
        return cls(f"parameter server {server} at {self.endpoints[server]} {why}", server, self.endpoints[server], name)

    def _refused_error(self, server: int, msg: Message) -> PSError:
        return self._unavailable(server, msg, self._refused[server], PSAuthError)

    def _monitor_events(self, server: int) -> None:
        route = self._routes[server]
        mon = route.monitor
        for _ in range(_MAX_BATCH):
            try:
                event = recv_monitor_message(mon, zmq.NOBLOCK)
            except zmq.Again:
                return
            kind = event["event"]
            if kind == zmq.EVENT_DISCONNECTED:
                self._receive(server)  # replies that arrived before the connection dropped still count
                why = "closed the connection (the server exited or crashed, or refused an oversized message)"
                self._fail_server(server, why)
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._failing.pop(server, None)
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._refused[server] = "refused this worker's credentials: the shared secret (FLEET_SECRET) differs"
                self._fail_server(server, self._refused[server], PSAuthError, queued_too=True)
            else:
                hint = (
                    "the shared secret differs, or the servers do not use ps_encryption='curve'"
                    if self.encryption == "curve"
                    else "do the servers use ps_encryption='curve' while this worker does not?"
                )
                self._failing[server] = f"failed the connection handshake ({hint}; event {kind!r})"
                self._fail_server(server, self._failing[server], queued_too=True)

    def _check_incarnation(self, server: int, incarnation: int) -> None:
        """A new incarnation answering HELLO: the server restarted while this worker did not notice.

        Its requests to the old server may have reached the new one, which cannot answer them (a sync
        pull waits for a version it is no longer on); failing them now starts the recovery at once
        instead of after the request timeout.
        """
        known = self._incarnations[server]
        self._incarnations[server] = incarnation
        if known and incarnation != known:
            self._fail_server(server, "was restarted (a new server process answers at its endpoint)", not_op=Op.HELLO)

    def _fail_server(
        self,
        server: int,
        why: str,
        cls: type = PSServerUnavailable,
        queued_too: bool = False,
        not_op: int | None = None,
    ) -> None:
        """Fail the jobs whose requests to ``server`` are on the wire (or, with ``queued_too``, waiting)."""
        unsent = set()
        if not queued_too:
            unsent = {id(entry[1]) for entry in self._outbox[server]}
            unsent |= {id(entry[1]) for job in self._active for entry in job.held.get(server, ())}
        for srv, job, part in list(self._inflight.values()):
            if srv != server or job.done:
                continue
            msg = job.parts[part][1]
            if id(msg) in unsent or msg.op == not_op:
                continue
            self._fail(job, self._unavailable(server, msg, f"{why} while {op_name(msg.op)} was in flight", cls))

    def _expire(self, now: float) -> None:
        for job in [j for j in self._active if j.deadline <= now]:
            for rid in job.pending:
                server, _, part = self._inflight[rid]
                msg = job.parts[part][1]
                why = f"did not answer {op_name(msg.op)} within {job.timeout_s} s"
                self._fail(job, self._unavailable(server, msg, why))
                break

    def _fail_everything(self, exc: PSError) -> None:
        for job in list(self._active):
            self._fail(job, exc)
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                return
            self._uncount(job)
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(exc)
