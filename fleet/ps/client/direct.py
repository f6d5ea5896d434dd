"""Small blocking requests sent and answered on the calling thread, over the server's direct socket.

Why: a request through the IO thread (:mod:`fleet.ps.client.io`) wakes that thread to send it and
again to hand back the answer, and ZeroMQ's own IO threads add two hand-offs more on each side; for
a small pull those waits for a core cost more than the server's work. A caller that waits for the
answer at once (:meth:`fleet.ps.client.client.PSClient.direct`) writes its request into the server's
direct Unix socket (:mod:`fleet.ps.protocol.unix`: authenticated by a challenge on the job's secret,
the same messages and the same server-side limits) and reads the answer there itself.

When (all checked by :meth:`~fleet.ps.client.io.IOThread.call_direct`): the call is a pull
(:data:`DIRECT_OPS`), each of its messages goes to a different server whose requests already travel
over its Unix socket and that offers a direct socket, each message is at most :data:`SMALL_BYTES`,
and this client has no request queued or unanswered (two connections keep no order between them,
and a pull must never overtake the push before it). Anything else takes the IO thread as before.

Each thread keeps one connection per server. A server that dies closes it (the call fails at once
with :class:`~fleet.ps.protocol.errors.PSServerUnavailable`, as on the IO thread); a call that times
out or fails closes its connections, so an answer that comes late is never read as the next call's.

A call costs two system calls, like a raw echo: one ``sendmsg`` of the whole request and one
``recv_into`` of a small answer. The sockets block in the kernel, which bounds each wait
(``SO_SNDTIMEO``/``SO_RCVTIMEO``, set when the call's deadline needs a shorter bound than the
last one); a socket timeout in Python would add a ``poll`` before every send and read, and two
``fcntl`` calls each time it is set. Between the two, while the server works on the request, a
blocking pull makes ready the answer the last pull of the same table got, but for its version and
values (:class:`fleet.ps.protocol.small.Expected`): what is left to do once the answer is in is a
few comparisons and a copy of the values.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures._base import FINISHED
from typing import Any

from fleet.ps.protocol import small, unix
from fleet.ps.protocol.errors import PSAuthError, PSClientClosed, PSError, PSServerUnavailable, WireError
from fleet.ps.protocol.wire import DTYPE_CODES, Message, Op, Status, decode, op_name

#: the requests that may go from the calling thread: reads, which a worker waits for before it goes on
DIRECT_OPS = frozenset((Op.PULL_DENSE, Op.PULL_SPARSE, Op.PULL_SPARSE_MANY))
#: the largest request (all its frames) sent from the calling thread
SMALL_BYTES = 64 << 10


def message_bytes(frames: Sequence[Any]) -> int:
    """The size on the wire of an encoded message's frames."""
    return sum(map(unix.frame_bytes, frames))


#: a deadline may pass by this much before a kernel bound on a wait is lowered to it (each change is two calls)
_SLACK_S = 0.02
_TIMEVAL = struct.Struct("@ll")


_ERROR = int(Status.ERROR)
_OK = int(Status.OK)


def _named(msg: Message | tuple) -> Message:
    """The request's :class:`Message` (from its fields: the quick way builds one only to name a failed request)."""
    return msg if type(msg) is Message else Message(*msg)


#: the one condition of every :class:`Settled` future: nobody waits on a future that is already done
_SETTLED = threading.Condition()


class Settled(Future):
    """A future made already done: what a direct call returns (its caller holds the answer when it gets it).

    Why not ``Future()`` then ``set_result``: that builds a condition and a lock per call and takes them
    twice more, a few microseconds of a small pull's round trip. A settled future shares one condition
    (only held for a moment: its state never changes, so nothing waits on it) and is otherwise a plain
    :class:`~concurrent.futures.Future`: ``result``, ``exception``, callbacks, ``wait`` and ``as_completed``
    behave as for any finished future.
    """

    def __init__(self, result: Any = None, exception: BaseException | None = None):  # noqa: D107
        # Future's own fields, as Future.__init__ then set_result / set_exception leave them
        self._condition = _SETTLED
        self._state = FINISHED
        self._result = result
        self._exception = exception
        self._waiters: list[Any] = []
        self._done_callbacks: list[Any] = []

    def result(self, timeout: float | None = None) -> Any:
        """As :meth:`Future.result` answers a finished future, without taking the condition (nothing can change)."""
        if self._exception is not None:
            try:
                raise self._exception
            finally:
                self = None  # noqa: PLW0642 -- as Future does: no cycle through the traceback's frame
        return self._result


#: the most (op, table) pairs a connection remembers the answers of (small.Expected): a bound, not a working set
_EXPECT_MOST = 64


def _learn(expect: dict[tuple[int, int], small.Expected], op: int, table: int, reply: Message) -> None:
    """Remember what ``reply``, an answer to a quick pull of ``table``, was like, when it was an OK answer of one
    flat tensor small enough to be made ready before the next such answer comes; else forget the table."""
    tensors = reply.tensors
    if reply.status == _OK and len(tensors) == 1:
        t = tensors[0]
        code = DTYPE_CODES.get(t.dtype)
        if code is not None and t.dim() == 1 and t.nbytes <= small.COPY_BYTES:
            if len(expect) >= _EXPECT_MOST and (op, table) not in expect:
                expect.clear()
            expect[(op, table)] = small.Expected(op, table, reply.peer, code, t.numel())
            return
    expect.pop((op, table), None)


class _Conn:
    """One thread's connection to one server's direct socket."""

    __slots__ = ("bound", "expect", "first", "path", "scratch", "sock")

    def __init__(self, path: str, sock: socket.socket):
        self.path = path
        self.sock = sock
        self.bound = 0.0  # seconds the kernel lets one send or read on it wait (0: not set yet)
        # answers are read here first (their own buffer gets their exact size: the caller keeps their tensors)
        self.first = bytearray(unix.FIRST_READ)
        self.scratch = memoryview(self.first)
        #: (op, table) of a quick pull -> what its last answer, of one flat tensor, was like
        self.expect: dict[tuple[int, int], small.Expected] = {}

    def within(self, deadline: float) -> None:
        """Bound the socket's next waits by ``deadline``; TimeoutError once it has passed."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the call's deadline passed")
        if self.bound and left <= self.bound <= left + _SLACK_S:
            return
        wait = max(left, 0.001)  # (0 would be no bound at all)
        whole = int(wait)
        tv = _TIMEVAL.pack(whole, int((wait - whole) * 1e6))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        self.bound = left

    def send(self, buffers: Sequence[memoryview], deadline: float) -> None:
        """Write one request, its bytes as :func:`fleet.ps.protocol.unix.buffers` gives them (usually one ``sendmsg``)."""
        pending = list(buffers)  # a copy: a request sent again after a broken connection goes whole
        self.within(deadline)
        while pending:
            try:
                # one buffer (the usual small request): send, which costs less than building sendmsg's vector
                sent = self.sock.send(pending[0]) if len(pending) == 1 else self.sock.sendmsg(pending)
            except BlockingIOError:  # the bound passed: the deadline, or a bound set for a later one
                self.within(deadline)
                continue
            unix.drop_sent(pending, sent)

    def _read(self, view: memoryview, deadline: float) -> int:
        while True:
            try:
                got = self.sock.recv_into(view)
            except BlockingIOError:
                self.within(deadline)
                continue
            if got == 0:
                raise ConnectionResetError("the parameter server closed the connection")
            return got

    def receive(self, deadline: float, expected: small.Expected | None = None) -> Message | list[memoryview]:
        """Read one answer (usually one ``recv_into``): the message when it is small and plain (``expected``'s when
        it is that, :class:`fleet.ps.protocol.small.Expected`; else :func:`fleet.ps.protocol.small.read`'s), else
        its frames, views of a buffer of its own."""
        scratch = self.scratch
        self.within(deadline)
        got = self._read(scratch, deadline)
        if expected is not None:
            hit = expected.take(self.first, got)
            if hit is not None:
                return hit
        quick = small.read(scratch, got)
        if quick is not None:
            return quick
        need = unix.message_length(scratch, got)
        while need is None:  # the length prefix came in pieces
            got += self._read(scratch[got:], deadline)
            need = unix.message_length(scratch, got)
        buf = bytearray(need)
        have = min(got, need)  # the server sends nothing after its one answer
        buf[:have] = scratch[:have]
        view = memoryview(buf)
        while have < need:
            have += self._read(view[have:], deadline)
        parsed = unix.parse(buf)
        assert parsed is not None
        return parsed[0]


class DirectScope:
    """The ``with`` block of :meth:`~fleet.ps.client.client.PSClient.direct`: this thread is in ``threads`` inside it.

    A class, not a generator: it is entered around every small call, and a generator's context
    manager costs several calls more each time.
    """

    __slots__ = ("_me", "_nested", "_threads")

    def __init__(self, threads: set[int]):
        self._threads = threads
        self._me = 0
        self._nested = False

    def __enter__(self) -> None:
        self._me = me = threading.get_ident()
        self._nested = me in self._threads
        self._threads.add(me)

    def __exit__(self, *exc: object) -> None:
        if not self._nested:
            self._threads.discard(self._me)


class DirectCalls:
    """The calling threads' connections to the servers' direct sockets, and the blocking call over them."""

    def __init__(
        self,
        secret: bytes,
        unavailable: Callable[[int, Message, str, type], PSError],
        remote: Callable[[int, int, str], PSError],
    ):
        self._secret = secret
        self._unavailable = unavailable
        self._remote = remote
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: set[_Conn] = set()  # every thread's connections, closed with the client
        self._closed = False

    def _conn(self, server: int, path: str, incarnation: int, msg: Message, deadline: float) -> _Conn:
        mine: dict[int, _Conn] = self._local.__dict__.setdefault("conns", {})
        have = mine.get(server)
        if have is not None and have.path == path:
            return have
        if have is not None:
            self._drop(server, have)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            try:
                sock.connect(path)
            except OSError as exc:  # no server listening there now (it died; its restart binds it again)
                why = f"has no direct socket at {path} now ({exc})"
                raise self._unavailable(server, msg, why, PSServerUnavailable) from None
            try:
                unix.answer_challenge(sock, self._secret)
            except OSError as exc:
                why = f"closed its direct socket during the handshake ({exc})"
                raise self._unavailable(server, msg, why, PSServerUnavailable) from None
            try:
                answered = unix.read_incarnation(sock)
            except (ConnectionError, BrokenPipeError):
                why = "refused this worker's credentials on its direct socket: the shared secret (FLEET_SECRET) differs"
                raise self._unavailable(server, msg, why, PSAuthError) from None
            if answered != incarnation:
                why = "was restarted (a new server process answers at its direct socket)"
                raise self._unavailable(server, msg, why, PSServerUnavailable)
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)  # blocking from now on: the kernel bounds each wait (_Conn.within)
        made = _Conn(path, sock)
        with self._lock:
            if self._closed:
                sock.close()
                raise PSClientClosed("the parameter-server client is closed")
            self._all.add(made)
        mine[server] = made
        return made

    def _drop(self, server: int, conn: _Conn) -> None:
        conns = self._local.__dict__.get("conns", {})
        if conns.get(server) is conn:
            del conns[server]
        with self._lock:
            self._all.discard(conn)
        conn.sock.close()

    def call(self, parts: list[tuple[int, Message, list[memoryview], str, int]], timeout_s: float) -> list[Message]:
        """Send each (server, message, its bytes as :func:`fleet.ps.protocol.unix.buffers` gives them, the server's
        direct socket, the incarnation its HELLO gave), wait for every answer; raise what the IO thread would."""
        deadline = time.monotonic() + timeout_s
        used: dict[int, _Conn] = {}
        try:
            for server, msg, buffers, path, incarnation in parts:
                conn = used[server] = self._conn(server, path, incarnation, msg, deadline)
                try:
                    try:
                        conn.send(buffers, deadline)
                    except (BrokenPipeError, ConnectionResetError):
                        # This thread's connection outlived its server (it died and came back since this thread
                        # last called it): nothing was delivered, so connect anew (checking the incarnation the
                        # client knows now) and send once more.
                        self._drop(server, conn)
                        conn = used[server] = self._conn(server, path, incarnation, msg, deadline)
                        conn.send(buffers, deadline)
                except TimeoutError:
                    raise self._unavailable(
                        server, msg, f"took no {op_name(msg.op)} in time", PSServerUnavailable
                    ) from None
                except OSError as exc:  # the server exited (a restarted one is found by the next call)
                    why = (
                        f"closed the connection (the server exited or crashed: {exc}) before {op_name(msg.op)} was sent"
                    )
                    raise self._unavailable(server, msg, why, PSServerUnavailable) from None
            # each connection answers its one request
            return [self._answer(part[0], part[1], used[part[0]], deadline) for part in parts]
        except OSError as exc:  # anything the socket says that the cases above do not name
            for server, conn in used.items():
                self._drop(server, conn)
            server, msg = parts[0][:2]
            raise self._unavailable(server, msg, f"failed on its direct socket ({exc})", PSServerUnavailable) from None
        except BaseException:
            for server, conn in used.items():  # a late answer must not be read as the next call's
                self._drop(server, conn)
            raise

    def pull(
        self, server: int, path: str, incarnation: int, request: bytes, fields: tuple, timeout_s: float
    ) -> Message:
        """:meth:`call` of one small request already written as its bytes (``request``, as
        :func:`fleet.ps.protocol.small.pull_request` writes it); ``fields``: its :class:`Message`'s
        positional fields, built into one only when something fails (to name the request).

        Why: the usual blocking pull's round trip is mostly this side's Python; this way sends the
        bytes and reads the answer with one socket call each and no request :class:`Message`, with
        the same checks and errors as :meth:`call`, which takes every case but the usual one (the
        thread's first call to the server, a send that does not go whole at once).
        """
        conns = self._local.__dict__.get("conns")
        conn = conns.get(server) if conns is not None else None
        if conn is not None and conn.path == path:
            deadline = time.monotonic() + timeout_s
            sock = conn.sock
            try:
                conn.within(deadline)
                sent = sock.send(request)
            except OSError:
                sent = 0  # nothing went (a socket error is raised for what was not sent): call sends it
            if sent == len(request):
                # made while the server works on the request: the answer the last one to this table got, but for
                # its version and values (small.Expected)
                op, table = fields[0], fields[1]
                expected = conn.expect.get((op, table))
                try:
                    if expected is not None:
                        expected.ready(fields[3], fields[4])
                    reply = self._answer(server, fields, conn, deadline, expected)
                except BaseException:
                    self._drop(server, conn)  # a late answer must not be read as the next call's
                    raise
                if expected is None or expected.msg is not None:  # none made ready, or not what came
                    _learn(conn.expect, op, table, reply)
                return reply
            if sent:  # part of it went: the rest, as call sends it (an error there names the request)
                return self._finish(server, Message(*fields), conn, memoryview(request)[sent:], deadline)
        return self.call([(server, Message(*fields), [memoryview(request)], path, incarnation)], timeout_s)[0]

    def _finish(self, server: int, msg: Message, conn: _Conn, rest: memoryview, deadline: float) -> Message:
        """Send the ``rest`` of a request whose start went on ``conn``, then read its answer (errors as :meth:`call`)."""
        try:
            try:
                conn.send([rest], deadline)
            except TimeoutError:
                raise self._unavailable(
                    server, msg, f"took no {op_name(msg.op)} in time", PSServerUnavailable
                ) from None
            except OSError as exc:
                why = f"closed the connection (the server exited or crashed: {exc}) before {op_name(msg.op)} was sent"
                raise self._unavailable(server, msg, why, PSServerUnavailable) from None
            return self._answer(server, msg, conn, deadline)
        except BaseException:
            self._drop(server, conn)
            raise

    def _answer(
        self, server: int, msg: Message | tuple, conn: _Conn, deadline: float, expected: small.Expected | None = None
    ) -> Message:
        """Read and check ``conn``'s answer to ``msg`` (or to the request of these :class:`Message` fields;
        ``expected``: the answer it most likely gets, :meth:`_Conn.receive`)."""
        try:
            got = conn.receive(deadline, expected)
        except TimeoutError:
            msg = _named(msg)
            raise self._unavailable(
                server, msg, f"did not answer {op_name(msg.op)} in time", PSServerUnavailable
            ) from None
        except (OSError, unix.FramingError) as exc:
            if self._closed:
                raise PSClientClosed("the parameter-server client was closed during a call") from None
            msg = _named(msg)
            why = f"closed the connection (the server exited or crashed: {exc}) while {op_name(msg.op)} was in flight"
            raise self._unavailable(server, msg, why, PSServerUnavailable) from None
        try:
            reply = got if type(got) is Message else decode(got)
        except WireError as exc:
            raise self._remote(server, exc.op, f"malformed reply: {exc}") from None
        request_id = msg.request_id if type(msg) is Message else msg[3]
        if reply.request_id != request_id:
            raise self._remote(server, reply.op, f"answered request {reply.request_id} for {request_id}")
        if reply.status == _ERROR:
            raise self._remote(server, reply.op, reply.text())
        return reply

    def close(self) -> None:
        """Close every thread's connections (a call still waiting on one fails with PSClientClosed)."""
        with self._lock:
            self._closed = True
            conns, self._all = self._all, set()
        for conn in conns:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked reading it
            except OSError:
                pass
            conn.sock.close()
