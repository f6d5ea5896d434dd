"""The server loop's waiter (fleet.ps.server.sockets): the plain poll stands for ZeroMQ's only while nothing can be missed."""

from __future__ import annotations

import socket
import time

import pytest
import zmq

from fleet.ps.server.sockets import Waiter


@pytest.fixture
def parts():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send(b"hello")  # the handshake done before a test starts: its wake-ups are the test's own
    assert router.poll(10_000) and router.recv_multipart()[1] == b"hello"
    a, b = socket.socketpair()
    a.setblocking(False)
    try:
        yield router, dealer, a, b
    finally:
        a.close()
        b.close()
        dealer.close(0)
        router.close(0)
        ctx.term()


def test_raw_sockets_are_waited_for_in_the_plain_poll(parts) -> None:
    router, dealer, a, b = parts
    w = Waiter()
    w.register(router, zmq.POLLIN)
    w.register(a.fileno(), zmq.POLLIN)
    ready = w.poll(0)
    assert ready == {}
    w.settle(ready, touched_zmq=False)
    assert w.quiet
    b.send(b"x")
    ready = w.poll(1000)
    assert ready == {a.fileno(): zmq.POLLIN} and w.plain_waits == 1
    a.recv(16)
    w.modify(a.fileno(), zmq.POLLIN | zmq.POLLOUT)  # a change of what is watched goes through ZeroMQ's poll once
    assert not w.quiet
    ready = w.poll(0)
    assert ready == {a.fileno(): zmq.POLLOUT}
    w.settle(ready, touched_zmq=False)
    assert w.poll(0) == {a.fileno(): zmq.POLLOUT} and w.plain_waits == 2
    b.close()
    w.modify(a.fileno(), zmq.POLLIN)
    w.settle(w.poll(0), touched_zmq=False)
    assert w.quiet and w.poll(0) == {a.fileno(): zmq.POLLIN | zmq.POLLERR}  # the peer hung up: read, then close


def test_a_zeromq_message_wakes_the_plain_poll(parts) -> None:
    router, dealer, a, _ = parts
    w = Waiter()
    w.register(router, zmq.POLLIN)
    w.register(a.fileno(), zmq.POLLIN)
    for i in range(20):
        w.settle(w.poll(0), touched_zmq=False)
        assert w.quiet
        dealer.send(b"%d" % i)
        started = time.monotonic()
        ready = w.poll(5000)
        assert router in ready, ready
        assert time.monotonic() - started < 2.5  # woken by the message, not by the timeout
        assert router.recv_multipart(zmq.NOBLOCK)[1] == b"%d" % i
        w.settle(ready, touched_zmq=True)
        assert not w.quiet


def test_touching_a_zeromq_socket_ends_the_plain_poll(parts) -> None:
    router, dealer, a, _ = parts
    w = Waiter()
    w.register(router, zmq.POLLIN)
    w.settle(w.poll(0), touched_zmq=True)
    assert not w.quiet  # a send or receive may have used up the edge a new message would make
    dealer.send_multipart([b"1"])
    dealer.send_multipart([b"2"])
    ready = w.poll(5000)
    assert router in ready
    router.recv_multipart()  # one of two read: the second makes no new edge
    w.settle(ready, touched_zmq=True)
    assert router in w.poll(5000)  # so ZeroMQ's own poll must see it


def test_a_wake_up_with_nothing_to_read_waits_on(parts) -> None:
    """A new peer's handshake makes the router's FD readable with no message: that is not an answer."""
    router, dealer, a, _ = parts
    w = Waiter()
    w.register(router, zmq.POLLIN)
    w.register(a.fileno(), zmq.POLLIN)
    w.settle(w.poll(0), touched_zmq=False)
    assert w.quiet
    late = router.context.socket(zmq.DEALER)
    try:
        late.connect(router.getsockopt_string(zmq.LAST_ENDPOINT))  # a handshake, no message
        give_up = time.monotonic() + 20
        while w.empty_wakes == 0 and time.monotonic() < give_up:  # the handshake reaches the router
            started = time.monotonic()
            assert w.poll(300) == {}  # empty only once the time is up, as ZeroMQ's own poll answers
            assert time.monotonic() - started >= 0.25
        assert w.empty_wakes >= 1
        w.settle({}, touched_zmq=False)
        late.send(b"late")
        ready = w.poll(5000)
        assert router in ready, ready
        assert router.recv_multipart(zmq.NOBLOCK)[1] == b"late"
    finally:
        late.close(0)
