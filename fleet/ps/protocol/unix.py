"""The direct same-host path: small requests over a plain Unix stream socket, answered by the server loop.

Why: a request through ZeroMQ crosses four threads' hand-offs per round trip on top of the two
processes (the worker's and the server's ZeroMQ IO threads, each way); on a busy host every
hand-off is a wait for a core. A caller that waits for its answer at once
(:mod:`fleet.ps.client.direct`) writes its request straight into a Unix socket the server loop
polls, and reads the answer from it: two hand-offs, like a raw echo. Everything above the bytes
is the same: the same messages (:mod:`fleet.ps.protocol.wire`), decoded by the server with the same
request limits, served by the same handlers, in the same turns.

The socket sits beside the server's ZeroMQ Unix socket in the job's private directory
(:mod:`fleet.ps.protocol.local`), and is offered only when that path is (never with CURVE: a
job that asks for encryption keeps every request inside it). Authentication: the server sends a
random challenge; the worker answers ``HMAC-SHA256(secret, label + challenge)`` (the secret never
travels); the server compares in constant time and checks that the peer runs as its own user
(``SO_PEERCRED``), then answers its incarnation, so the worker knows it reached the server process
its HELLO came from. Before that, a peer can make the server hold :data:`CHALLENGE_BYTES`;
after it, one message of at most :data:`MAX_MESSAGE` bytes, checked from its length prefix.

Framing: ``<nframes u32><lengths u32 x nframes>`` then the frames' bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
from collections.abc import Sequence
from typing import Any

#: the challenge and its answer
CHALLENGE_BYTES = 32
_LABEL = b"fleet-ps-direct-v1:"
#: the largest message either side accepts on this path (a direct request is far smaller: fleet.ps.client.direct)
MAX_MESSAGE = 8 << 20
#: the most frames of one message (a header, a blob and a few tensors)
MAX_FRAMES = 64
COUNT = struct.Struct("<I")
INCARNATION = struct.Struct("<Q")
SUFFIX = ".direct"


class FramingError(ValueError):
    """A peer sent bytes that are not a message of this path (the connection is dropped)."""


def answer(secret: bytes, challenge: bytes) -> bytes:
    """The worker's answer to the server's challenge."""
    return hmac.new(secret, _LABEL + challenge, hashlib.sha256).digest()


def answer_challenge(sock: socket.socket, secret: bytes) -> None:
    """The worker's half of the handshake on a connected blocking socket: read the challenge, send the answer."""
    challenge = bytes(recv_exactly(sock, CHALLENGE_BYTES))
    sock.sendall(answer(secret, challenge))


def read_incarnation(sock: socket.socket) -> int:
    """The server's incarnation, which it sends once the answer checks out (it closes the connection otherwise)."""
    (incarnation,) = INCARNATION.unpack(recv_exactly(sock, INCARNATION.size))
    return incarnation


def check_answer(secret: bytes, challenge: bytes, got: bytes) -> bool:
    return hmac.compare_digest(answer(secret, challenge), bytes(got))


def same_user(sock: socket.socket) -> bool:
    """Whether the peer of Unix socket ``sock`` runs as this process's user."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return False
    _, uid, _ = struct.unpack("3i", creds)
    return uid == os.getuid()


def frame_bytes(frame: Any) -> int:
    return frame.nbytes if isinstance(frame, memoryview) else len(frame)


_PREFIXES = [struct.Struct(f"<I{n}I") for n in range(MAX_FRAMES + 1)]
_SIZES = [struct.Struct(f"<{n}I") for n in range(MAX_FRAMES + 1)]


def _pack_prefix(sizes: list[int]) -> bytes:
    n = len(sizes)
    return (_PREFIXES[n] if n <= MAX_FRAMES else struct.Struct(f"<I{n}I")).pack(n, *sizes)


def prefix(frames: Sequence[Any]) -> bytes:
    """The length prefix of a message of ``frames``."""
    return _pack_prefix([frame_bytes(f) for f in frames])


def buffers(frames: Sequence[Any]) -> list[memoryview]:
    """The bytes to write for ``frames``, prefix first, each as a flat byte view (no copy)."""
    out: list[memoryview] = [memoryview(b"")]
    sizes = []
    for f in frames:
        view = memoryview(f)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        sizes.append(view.nbytes)
        if view.nbytes:
            out.append(view)
    out[0] = memoryview(_pack_prefix(sizes))
    return out


def parse(buf: bytearray | memoryview, start: int = 0) -> tuple[list[memoryview], int] | None:
    """The frames of the message at ``buf[start:]`` and where the next one starts; None while incomplete.

    Raises :class:`FramingError` for a message over :data:`MAX_FRAMES` frames or :data:`MAX_MESSAGE` bytes.
    """
    have = len(buf) - start
    if have < COUNT.size:
        return None
    (count,) = COUNT.unpack_from(buf, start)
    if not 1 <= count <= MAX_FRAMES:
        raise FramingError(f"a message of {count} frames (1 to {MAX_FRAMES})")
    head = COUNT.size * (1 + count)
    if have < head:
        return None
    sizes = _SIZES[count].unpack_from(buf, start + COUNT.size)
    total = sum(sizes)
    if total > MAX_MESSAGE:
        raise FramingError(f"a message of {total:,} bytes (at most {MAX_MESSAGE:,} on the direct path)")
    if have < head + total:
        return None
    frames, at = [], start + head
    with memoryview(buf) as view:
        for size in sizes:
            frames.append(view[at : at + size])
            at += size
    return frames, at


def drop_sent(pending: list[memoryview], sent: int) -> None:
    """Take the first ``sent`` bytes (what one ``sendmsg`` wrote) off the front of ``pending``."""
    while sent and pending:
        if sent >= pending[0].nbytes:
            sent -= pending[0].nbytes
            pending.pop(0)
        else:
            pending[0] = pending[0][sent:]
            sent = 0


def send_all(sock: socket.socket, frames: Sequence[Any]) -> None:
    """Write one message on a blocking socket (scatter-gather, the tensors' memory as it is)."""
    pending = buffers(frames)
    while pending:
        drop_sent(pending, sock.sendmsg(pending))


#: what one read of an answer takes at first: a small answer comes in one system call
FIRST_READ = 64 << 10


def recv_message(sock: socket.socket) -> list[memoryview]:
    """Read one message from a blocking socket (its frames are views of one buffer).

    The peer sends nothing after it (one request, one answer), so reading ahead is safe.
    """
    buf = bytearray(FIRST_READ)
    got = sock.recv_into(buf)
    if got == 0:
        raise ConnectionResetError("the parameter server closed the connection")
    while True:
        parsed = parse(memoryview(buf)[:got])
        if parsed is not None:
            return parsed[0]
        need = message_length(buf, got)
        if need is not None and need > len(buf):
            buf.extend(bytes(need - len(buf)))
        elif len(buf) == got:
            buf.extend(bytes(len(buf)))
        k = sock.recv_into(memoryview(buf)[got:])
        if k == 0:
            raise ConnectionResetError("the parameter server closed the connection")
        got += k


def message_length(buf: bytearray | memoryview, got: int) -> int | None:
    """The whole message's length once its prefix is in ``buf[:got]`` (else None)."""
    if got < COUNT.size:
        return None
    (count,) = COUNT.unpack_from(buf, 0)
    if not 1 <= count <= MAX_FRAMES:
        raise FramingError(f"a message of {count} frames (1 to {MAX_FRAMES})")
    head = COUNT.size * (1 + count)
    if got < head:
        return None
    total = sum(_SIZES[count].unpack_from(buf, COUNT.size))
    if total > MAX_MESSAGE:
        raise FramingError(f"a message of {total:,} bytes (at most {MAX_MESSAGE:,} on the direct path)")
    return head + total


def recv_exactly(sock: socket.socket, n: int) -> bytearray:
    """Exactly ``n`` bytes from a blocking socket (ConnectionResetError if it closes first)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionResetError("the parameter server closed the connection")
        got += k
    return buf
