"""The server's requests, taken in turns by peer, so one worker's stream of pieces cannot crowd out another.

ZeroMQ's ROUTER socket queues each connection's messages in its own pipe and reads the
pipes in turns, but a pipe that becomes active goes after the one being read: a worker
whose single request arrives while another streams the pieces of a huge batch waited for
the piece being served *and* the next one. Here the loop takes everything the socket holds
into one queue per peer before serving each request, and serves the peers in rotation
(each peer's requests in their order), so a newcomer waits at most for the request being
served. The queues are bounded in messages and bytes; past the bound the rest waits in
ZeroMQ, as before, and the client sends at most a few pieces of one call at a time
(:data:`fleet.ps.client.io.PIECES_ON_THE_WIRE`), so the bound is not reached in practice.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any

import zmq

MAX_MESSAGES = 1024
MAX_BYTES = 64 << 20


class FairInbox:
    """Per-peer queues of received multipart messages (the first frame is the peer's routing id)."""

    def __init__(self, max_messages: int = MAX_MESSAGES, max_bytes: int = MAX_BYTES) -> None:
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self._queues: OrderedDict[bytes, deque[list[Any]]] = OrderedDict()
        self._messages = 0
        self._bytes = 0
        self._last: bytes | None = None  # the peer whose request was served last

    def __len__(self) -> int:
        return self._messages

    def take_from(self, sock: zmq.Socket) -> None:
        """Receive, without blocking, what ``sock`` holds (up to the bounds)."""
        while self._messages < self.max_messages and self._bytes < self.max_bytes:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            size = sum(len(f) for f in frames)
            self._queues.setdefault(frames[0].bytes, deque()).append((frames, size))
            self._messages += 1
            self._bytes += size

    def put(self, frames: list[Any]) -> None:
        """Queue one message received elsewhere (the direct path: :mod:`fleet.ps.server.direct_conns`)."""
        size = sum(len(f) for f in frames)
        self._queues.setdefault(frames[0].bytes, deque()).append((frames, size))
        self._messages += 1
        self._bytes += size

    def next(self) -> list[Any] | None:
        """The oldest request of the peer whose turn it is (None when empty).

        The peer served last goes behind every other peer with a request, including those
        whose request came in while it was being served.
        """
        if not self._queues:
            return None
        if len(self._queues) > 1 and next(iter(self._queues)) == self._last:
            self._queues.move_to_end(self._last)
        peer, queue = next(iter(self._queues.items()))
        frames, size = queue.popleft()
        if not queue:
            del self._queues[peer]
        self._last = peer
        self._messages -= 1
        self._bytes -= size
        return frames

    def clear(self) -> int:
        """Drop everything queued (the server is closing); the number dropped."""
        dropped, self._messages, self._bytes = self._messages, 0, 0
        self._queues.clear()
        return dropped
