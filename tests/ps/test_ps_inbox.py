"""The server's request inbox: peers served in turns, each peer's requests in order, bounded."""

from __future__ import annotations

import zmq

from fleet.ps.server.inbox import FairInbox


class Frame(bytes):
    @property
    def bytes(self) -> bytes:
        return bytes(self)


class FakeRouter:
    """Hands out queued (peer, body) messages as ROUTER frames, in the order given."""

    def __init__(self) -> None:
        self.waiting: list[list[Frame]] = []

    def send(self, peer: bytes, body: bytes) -> None:
        self.waiting.append([Frame(peer), Frame(body)])

    def recv_multipart(self, flags=0, copy=True):
        if not self.waiting:
            raise zmq.Again()
        return self.waiting.pop(0)


def served(inbox: FairInbox, sock: FakeRouter) -> list[bytes]:
    out = []
    while True:
        inbox.take_from(sock)
        frames = inbox.next()
        if frames is None:
            return out
        out.append(frames[1].bytes)


def test_a_request_arriving_during_a_stream_of_pieces_goes_next():
    sock, inbox = FakeRouter(), FairInbox()
    for k in range(4):
        sock.send(b"A", b"a%d" % k)
    inbox.take_from(sock)
    assert inbox.next()[1].bytes == b"a0"  # being served when B's request comes in
    sock.send(b"B", b"b0")
    sock.send(b"A", b"a4")
    assert served(inbox, sock) == [b"b0", b"a1", b"a2", b"a3", b"a4"]


def test_peers_take_turns_and_each_peers_requests_keep_their_order():
    sock, inbox = FakeRouter(), FairInbox()
    for k in range(3):
        sock.send(b"A", b"a%d" % k)
    for k in range(2):
        sock.send(b"B", b"b%d" % k)
    sock.send(b"C", b"c0")
    order = served(inbox, sock)
    assert order == [b"a0", b"b0", b"c0", b"a1", b"b1", b"a2"]
    assert len(inbox) == 0


def test_the_inbox_stops_taking_at_its_bounds_and_the_rest_waits_in_the_socket():
    sock, inbox = FakeRouter(), FairInbox(max_messages=3, max_bytes=1 << 20)
    for k in range(5):
        sock.send(b"A", b"a%d" % k)
    inbox.take_from(sock)
    assert len(inbox) == 3 and len(sock.waiting) == 2
    sock, by_bytes = FakeRouter(), FairInbox(max_messages=100, max_bytes=10)
    for _ in range(5):
        sock.send(b"B", b"0123456789")
    by_bytes.take_from(sock)
    assert len(by_bytes) == 1  # one message reaches the byte bound; the others stay in the socket
    assert by_bytes.clear() == 1 and by_bytes.next() is None
