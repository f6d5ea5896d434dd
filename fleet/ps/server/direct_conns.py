"""The server's end of the direct same-host path (:mod:`fleet.ps.protocol.unix`): a listening Unix socket and its connections.

Polled by the server loop with its ZeroMQ sockets (one waiter, :mod:`fleet.ps.server.sockets`; one thread: nothing here blocks).
A connection is challenged first; once its answer and its user check out, every complete message
it sends goes into the loop's inbox under a routing identity of its own (never one ZeroMQ makes:
those start with a zero byte), and the reply to that identity is written back on it. A connection
that sends anything else (a wrong answer, a message over the path's bounds) is closed.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import socket
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from fleet.ps.protocol import unix

log = logging.getLogger(__name__)

_READ = 1 << 16
_SNDBUF = 4 << 20
_MAX_CONNECTIONS = 1024
# plain ints: ZeroMQ's flags are enum members, and their arithmetic costs a call per request
_POLLIN, _POLLOUT, _POLLERR = int(zmq.POLLIN), int(zmq.POLLOUT), int(zmq.POLLERR)

#: ``fast(ident, frames)``: serve a complete message at once from the frames (views of a buffer the next read
#: reuses: what it keeps, it copies); False leaves it to the inbox, as a copy
Fast = Callable[[bytes, list[memoryview]], bool]
#: ``whole(ident, data, got)``: serve at once the one message that is exactly ``data[:got]`` (its length prefix
#: included; a buffer the next read reuses); False leaves it to be cut into frames (then ``fast``, or the inbox)
Whole = Callable[[bytes, memoryview, int], bool]


class Ident:
    """A routing identity as the inbox and the loop read it from a received message's first frame."""

    __slots__ = ("bytes",)

    def __init__(self, value: bytes):
        self.bytes = value

    def __len__(self) -> int:
        return len(self.bytes)


class _Conn:
    __slots__ = ("challenge", "ident", "inbuf", "out", "ready", "sock", "watching_out")

    def __init__(self, sock: socket.socket, ident: bytes):
        self.sock = sock
        self.ident = ident
        self.challenge = secrets.token_bytes(unix.CHALLENGE_BYTES)
        self.ready = False
        self.inbuf = bytearray()
        self.out: deque[memoryview] = deque()
        self.watching_out = False  # whether the poller watches it for POLLOUT (only while ``out`` waits)

    def watch_out(self, want: bool) -> bool:
        """Record whether the poller should watch for POLLOUT; True when that changed."""
        changed, self.watching_out = want != self.watching_out, want
        return changed

    def take_inbuf(self) -> bytearray:
        """Hand the buffer over whole (a long message that fills it is queued as it is, no copy); start a new one."""
        buf, self.inbuf = self.inbuf, bytearray()
        return buf

    def grow_inbuf(self, size: int) -> None:
        """Make the buffer ``size`` bytes at once, what was read first then zeros (one allocation, no temporary)."""
        grown = bytearray(size)
        grown[: len(self.inbuf)] = self.inbuf
        self.inbuf = grown

    def admit(self, incarnation: int) -> None:
        """The challenge was answered: from now on its bytes are messages; the peer learns the incarnation."""
        self.ready, self.inbuf = True, bytearray()
        self.out.append(memoryview(unix.INCARNATION.pack(incarnation)))


class DirectConnections:
    """Accept, authenticate and read the direct path's connections; write replies to them."""

    def __init__(self, path: str, secret: bytes, incarnation: int):
        self.path = path
        self._secret = secret
        self._incarnation = incarnation
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(path)
            os.chmod(path, 0o600)
            self._listener.listen(64)
            self._listener.setblocking(False)
        except OSError:
            self._listener.close()
            raise
        self._listener_fd = self._listener.fileno()
        self._conns: dict[int, _Conn] = {}  # by file descriptor
        self._by_ident: dict[bytes, _Conn] = {}
        self._next = 0
        self._poller: Any = None  # the loop's waiter (fleet.ps.server.sockets): a zmq.Poller's interface
        # a connection's bytes are read here first: a whole small request is served from it without a copy
        self._scratch = bytearray(_READ)
        self._scratch_view = memoryview(self._scratch)
        self.admitted = 0
        self.rejected = 0

    def attach(self, poller: Any) -> None:
        """Have ``poller`` watch the listening socket and every connection."""
        self._poller = poller
        poller.register(self._listener.fileno(), zmq.POLLIN)

    def serve(
        self,
        ready: dict[Any, int],
        put: Callable[[list[Any]], None],
        fast: Fast | None = None,
        whole: Whole | None = None,
    ) -> None:
        """Act on what ``ready`` (the poller's answer) says; each complete request goes to ``whole`` or ``fast``
        (when they take it) or to ``put``."""
        conns = self._conns
        for fd, flags in ready.items():
            conn = conns.get(fd) if type(fd) is int else None
            if conn is None:
                continue
            flags = int(flags)
            if flags & _POLLOUT:
                self._flush(conn)
            if flags & (_POLLIN | _POLLERR) and fd in conns:
                if conn.ready and not conn.inbuf:  # the usual read: one whole request (no call to _read first)
                    self._read_fresh(conn, put, fast, whole)
                else:
                    self._read(conn, put, fast, whole)
        if int(ready.get(self._listener_fd, 0)) & _POLLIN:
            self._accept()

    def owns(self, ident: Any) -> bool:
        return isinstance(ident, bytes) and ident in self._by_ident

    def send(self, ident: bytes, frames: list[Any]) -> bool:
        """Write a reply to the connection ``ident`` (False when it is gone: the reply is dropped)."""
        return self.send_buffers(ident, unix.buffers(frames))

    def send_buffers(self, ident: bytes, buffers: list[memoryview]) -> bool:
        """Write a reply given as :func:`fleet.ps.protocol.unix.buffers` gives its bytes (False: the connection
        is gone, the reply is dropped)."""
        conn = self._by_ident.get(ident)
        if conn is None:
            return False
        if not conn.out and len(buffers) == 1:  # the usual small reply: one send, no queue
            sent = _send_now(conn.sock, buffers[0])
            if sent == buffers[0].nbytes:
                return True
            if sent > 0:
                buffers = [buffers[0][sent:]]
        conn.out.extend(buffers)
        self._flush(conn)  # a small reply leaves in this one system call
        return True

    def send_reused(self, ident: bytes, buf: bytearray) -> bool:
        """:meth:`send_buffers` of a reply in a buffer its maker rewrites for the next reply
        (:class:`fleet.ps.protocol.small.FlatReply`): what cannot leave at once is queued as a copy."""
        conn = self._by_ident.get(ident)
        if conn is None:
            return False
        sent = 0 if conn.out else _send_now(conn.sock, buf)  # earlier replies still waiting: this one goes after them
        if sent == len(buf):
            return True
        conn.out.append(memoryview(bytes(buf[sent:] if sent > 0 else buf)))
        self._flush(conn)
        return True

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("direct path: accept failed: %s", exc)
                return
            if len(self._conns) >= _MAX_CONNECTIONS or not unix.same_user(sock):
                self.rejected += 1
                sock.close()
                continue
            sock.setblocking(False)
            # a step's rows leave in one sendmsg (a worker's IO thread pulls them here: fleet.ps.client.bulk)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SNDBUF)
            self._next += 1
            conn = _Conn(sock, b"\xffdirect" + self._next.to_bytes(8, "little"))
            self._conns[sock.fileno()] = conn
            self._by_ident[conn.ident] = conn
            assert self._poller is not None
            self._poller.register(sock.fileno(), zmq.POLLIN)
            conn.out.append(memoryview(conn.challenge))
            self._flush(conn)

    def _read(self, conn: _Conn, put: Callable[[list[Any]], None], fast: Fast | None, whole: Whole | None) -> None:
        if conn.ready and not conn.inbuf:
            self._read_fresh(conn, put, fast, whole)
            return
        try:
            data = conn.sock.recv(_READ)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        conn.inbuf.extend(data)
        if not conn.ready:
            if len(conn.inbuf) < unix.CHALLENGE_BYTES:
                return
            got = bytes(conn.inbuf[: unix.CHALLENGE_BYTES])
            if len(conn.inbuf) > unix.CHALLENGE_BYTES or not unix.check_answer(self._secret, conn.challenge, got):
                self.rejected += 1
                log.warning("direct path: a peer's answer to the challenge is wrong; connection closed")
                self._close(conn)
                return
            conn.admit(self._incarnation)
            self.admitted += 1
            self._flush(conn)
            return
        self._drain(conn, put)

    def _drain(self, conn: _Conn, put: Callable[[list[Any]], None]) -> None:
        """Read what the socket holds of a long message, then put each complete message of the buffer."""
        self._fill(conn)
        start = 0
        try:
            while True:
                parsed = unix.parse(conn.inbuf, start)
                if parsed is None:
                    break
                frames, start = parsed
                if start == len(conn.inbuf) and start > _READ:
                    # a long message that is the whole buffer (fleet.ps.client.bulk): it goes as it is, no copy
                    conn.take_inbuf()
                    start = 0
                    put([Ident(conn.ident), *frames])
                    break
                put([Ident(conn.ident), *[bytearray(f) for f in frames]])  # copies: the buffer is reused
                for f in frames:
                    f.release()
        except unix.FramingError as exc:
            log.warning("direct path: %s; connection closed", exc)
            self._close(conn)
            return
        if start:
            del conn.inbuf[:start]

    def _fill(self, conn: _Conn) -> None:
        """Read the rest of a message longer than one read as far as the socket holds it, straight into the
        connection's buffer: a worker's large request (fleet.ps.client.bulk) in a few system calls and one turn
        of the loop, not one turn per 64 KiB."""
        try:
            need = unix.message_length(conn.inbuf, len(conn.inbuf))
        except unix.FramingError:
            return  # parse reports it
        have = len(conn.inbuf)
        if need is None or need <= have:
            return
        conn.grow_inbuf(need)
        view = memoryview(conn.inbuf)
        try:
            while have < need:
                n = conn.sock.recv_into(view[have:need])
                if not n:
                    break  # the next read sees the end and closes the connection
                have += n
        except OSError:
            pass  # nothing more now (or an error the next read meets)
        finally:
            view.release()
            del conn.inbuf[have:]

    def _read_fresh(
        self, conn: _Conn, put: Callable[[list[Any]], None], fast: Fast | None, whole: Whole | None
    ) -> None:
        """Read an admitted connection with nothing buffered: the usual case, one whole request in one read.

        Its bytes land in the scratch buffer; a read that is one small pull goes to ``whole`` as it is; else each
        complete message goes to ``fast`` from there (no copy), or is copied for ``put``; a message not complete
        yet moves to the connection's own buffer for the next read.
        """
        view = self._scratch_view
        try:
            got = conn.sock.recv_into(view)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            got = 0
        if not got:
            self._close(conn)
            return
        if whole is not None and whole(conn.ident, view, got):
            return
        fd, data, start, partial = conn.sock.fileno(), view[:got], 0, False
        try:
            while fd in self._conns:  # a reply that failed to go closes the connection: read no more of it
                parsed = unix.parse(data, start)
                if parsed is None:
                    if start < got:
                        conn.inbuf.extend(data[start:])
                        partial = fd in self._conns
                    break
                frames, start = parsed
                if fast is None or not fast(conn.ident, frames):
                    put([Ident(conn.ident), *[bytearray(f) for f in frames]])
                for f in frames:
                    f.release()
        except unix.FramingError as exc:
            log.warning("direct path: %s; connection closed", exc)
            self._close(conn)
        finally:
            data.release()
        if partial:  # a message longer than this read (a worker's bulk request): the rest now, if it is there
            self._drain(conn, put)

    def _flush(self, conn: _Conn) -> None:
        while conn.out:
            try:
                sent = conn.sock.sendmsg(conn.out if len(conn.out) <= 64 else list(conn.out)[:64])
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                if exc.errno not in (errno.EPIPE, errno.ECONNRESET):
                    log.warning("direct path: send failed: %s", exc)
                self._close(conn)
                return
            while sent and conn.out:
                head = conn.out[0]
                if sent >= head.nbytes:
                    sent -= head.nbytes
                    conn.out.popleft()
                else:
                    conn.out[0] = head[sent:]
                    sent = 0
        want_out = bool(conn.out)
        if want_out != conn.watching_out and self._poller is not None and conn.sock.fileno() in self._conns:
            conn.watch_out(want_out)
            self._poller.modify(conn.sock.fileno(), _POLLIN | (_POLLOUT if want_out else 0))

    def _close(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        self._conns.pop(fd, None)
        self._by_ident.pop(conn.ident, None)
        if self._poller is not None:
            try:
                self._poller.unregister(fd)
            except KeyError:
                pass
        conn.sock.close()

    def close(self) -> None:
        for conn in list(self._conns.values()):
            self._close(conn)
        if self._poller is not None:
            try:
                self._poller.unregister(self._listener.fileno())
            except KeyError:
                pass
        self._listener.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass


def _send_now(sock: socket.socket, data: Any) -> int:
    """One non-blocking ``send`` of ``data``: the bytes it took (0: none now; -1: a socket error, which the
    caller's ``_flush`` meets again and closes the connection on)."""
    try:
        return sock.send(data)
    except (BlockingIOError, InterruptedError):
        return 0
    except OSError:
        return -1
