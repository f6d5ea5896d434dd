"""The IO thread's own connection to a same-host server's direct socket: its pulls and pushes without ZeroMQ.

Why: a step's rows and gradients (W6: ~1.5 MB each way per worker and step) crossed four threads
on their way through ZeroMQ: the IO thread woke ZeroMQ's IO thread, which wrote the socket, and
on the server ZeroMQ's IO thread read it and woke the loop; the answer came back the same way.
The bytes must cross the kernel anyway; the hand-offs, the wake-ups and ZeroMQ's zero-copy release
(a wake-up of pyzmq's garbage thread per large frame) need not. So once a server's requests go
over its Unix socket (:mod:`fleet.ps.client.routes`), the IO thread also opens the server's direct
socket (:mod:`fleet.ps.protocol.unix`: the same challenge on the job's secret, the same incarnation
check, the same messages, decoded by the server with the same limits) and writes its requests
there itself, non-blocking, polled with its ZeroMQ sockets; the answers are read there too.

Which requests (:func:`eligible`): pulls and pushes of rows and gradients and HELLO (the heartbeat,
so that it does not make the requests around it change ways), each at most :data:`MAX_BULK`, and whose
answer is bounded as well (a sparse pull's rows by the request limits). Anything
else (a save, an export, a dense pull of any size) goes through ZeroMQ as before.

Order: one worker's requests to a server must be served in the order sent (a pull never overtakes
the push before it), and two connections keep no order between them. The IO thread moves a
server's requests from one way to the other only when none of them is on the wire
(:meth:`fleet.ps.client.io.IOThread._flush`); on one connection the server serves them in order.

Failures: a server that exits closes the connection: what was on it fails at once with
:class:`~fleet.ps.protocol.errors.PSServerUnavailable`, as ZeroMQ's disconnect does, and the
server's requests go through ZeroMQ from then on (which finds a restarted server by itself).
A connection that cannot be made (no socket, a refused answer, another incarnation, no answer
within :data:`CONNECT_S`) leaves them on ZeroMQ too.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence

from fleet.ps.protocol import unix
from fleet.ps.protocol.wire import Message, Op

#: the longest the IO thread waits for a server's direct socket to accept and answer the challenge
CONNECT_S = 2.0
#: the largest message (request or answer) sent this way: inside what the path accepts, beyond a request's limits
MAX_BULK = unix.MAX_MESSAGE - (1 << 20)
#: the requests that may go this way: their answers are small, or bounded by the request limits (a pull's rows)
BULK_OPS = frozenset(
    (
        Op.HELLO,
        Op.PULL_SPARSE,
        Op.PULL_SPARSE_MANY,
        Op.PUSH_SPARSE_GRAD,
        Op.PUSH_SPARSE_GRAD_MANY,
        Op.PUSH_SPARSE_DELTA,
        Op.PUSH_DENSE_GRAD,
        Op.PUSH_DENSE_DELTA,
    )
)
_PULLS = frozenset((Op.PULL_SPARSE, Op.PULL_SPARSE_MANY))
#: kernel buffer of the connection: a step's request leaves in one ``sendmsg``
_SNDBUF = 4 << 20


def eligible(msg: Message, pull_reply_bound: int) -> bool:
    """Whether ``msg`` may go over a bulk connection (its size is checked when it is encoded).

    ``pull_reply_bound``: the most bytes a sparse pull's answer may hold (the request limits' bytes);
    over :data:`MAX_BULK`, pulls keep ZeroMQ.
    """
    return msg.op in BULK_OPS and (msg.op not in _PULLS or pull_reply_bound <= MAX_BULK)


class BulkLost(Exception):
    """The connection broke (the server exited, or sent bytes that are not a message of this path)."""


class BulkConn:
    """A non-blocking connection to one server's direct socket, owned by the IO thread."""

    def __init__(self, path: str, secret: bytes, incarnation: int):
        """Connect and authenticate (blocking, for at most :data:`CONNECT_S`); OSError or BulkLost when refused."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(CONNECT_S)
            sock.connect(path)
            unix.answer_challenge(sock, secret)
            if unix.read_incarnation(sock) != incarnation:
                raise BulkLost("another incarnation answers at the direct socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SNDBUF)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.fd = sock.fileno()
        self.pending: list[memoryview] = []  # the bytes of the request being written, not yet taken by the kernel
        self._scratch = bytearray(unix.FIRST_READ)
        self._view = memoryview(self._scratch)
        self._got = 0  # bytes in the scratch buffer
        self._big: bytearray | None = None  # an answer longer than the scratch buffer, read straight into its own
        self._have = 0

    def send(self, buffers: Sequence[memoryview]) -> bool:
        """Start writing one request (nothing else may be pending); True when all of it went."""
        assert not self.pending
        self.pending = list(buffers)
        return self.flush()

    def flush(self) -> bool:
        """Write what the kernel takes of the pending request; True when nothing is left."""
        pending = self.pending
        while pending:
            try:
                sent = self.sock.sendmsg(pending[:64])
            except (BlockingIOError, InterruptedError):
                return False
            except OSError as exc:
                raise BulkLost(f"the connection broke ({exc})") from None
            unix.drop_sent(pending, sent)
        return True

    def receive(self) -> list[list[memoryview]]:
        """The answers complete so far (each as its frames, views of a buffer of its own); BulkLost at the end."""
        out: list[list[memoryview]] = []
        try:
            while True:
                if self._big is not None:
                    with memoryview(self._big) as view:
                        n = self.sock.recv_into(view[self._have :])
                    if not n:
                        raise BulkLost("the server closed the connection")
                    self._have += n
                    if self._have == len(self._big):
                        out.append(self._parse(self._big))
                        self._big = None
                    continue
                n = self.sock.recv_into(self._view[self._got :])
                if not n:
                    raise BulkLost("the server closed the connection")
                self._got += n
                self._take(out)
        except (BlockingIOError, InterruptedError):
            return out
        except unix.FramingError as exc:
            raise BulkLost(f"the server sent bytes that are not a message of this path ({exc})") from None
        except OSError as exc:
            raise BulkLost(f"the connection broke ({exc})") from None

    def _take(self, out: list[list[memoryview]]) -> None:
        """Move the complete answers in the scratch buffer to ``out``; start a long one's own buffer."""
        while self._got:
            need = unix.message_length(self._scratch, self._got)
            if need is None:
                return
            if need > MAX_BULK:
                raise unix.FramingError(f"an answer of {need:,} bytes (at most {MAX_BULK:,} this way)")
            if need > self._got:
                if need <= len(self._scratch):
                    return  # the rest comes in the next read
                self._big = bytearray(need)
                self._big[: self._got] = self._view[: self._got]
                self._have, self._got = self._got, 0
                return
            out.append(self._parse(bytearray(self._view[:need])))
            rest = self._got - need
            if rest:
                self._scratch[:rest] = bytes(self._view[need : self._got])
            self._got = rest

    @staticmethod
    def _parse(buf: bytearray) -> list[memoryview]:
        parsed = unix.parse(buf)
        if parsed is None or parsed[1] != len(buf):
            raise unix.FramingError("an answer that does not fill its length")
        return parsed[0]

    def close(self) -> None:
        self.sock.close()
