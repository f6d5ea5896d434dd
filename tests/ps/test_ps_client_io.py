"""The PS client's IO loop against fake sockets: matching replies, errors, deadlines, back-pressure, lost servers.

The loop's steps (:meth:`IOThread._admit`, ``_flush``, ``_receive``, ``_expire``,
``_fail_server``) are driven by hand here, with no thread, socket or server.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import Future

import pytest
import torch
import zmq

from fleet.ps.client.io import IOThread, Job
from fleet.ps.protocol.errors import PSClientClosed, PSRemoteError, PSServerUnavailable
from fleet.ps.protocol.wire import Message, Op, Status, decode, encode

SECRET = b"s" * 32


class FakeSocket:
    """Records sent requests; hands back queued replies; can refuse sends (a full queue: zmq.Again)."""

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.replies: list[list] = []
        self.full = False

    def send_multipart(self, frames, flags=0, copy=True):
        if self.full:
            raise zmq.Again()
        self.sent.append(decode([bytes(f) for f in frames]))

    def recv_multipart(self, flags=0, copy=True):
        if not self.replies:
            raise zmq.Again()
        return self.replies.pop(0)

    def answer(self, request: Message, *, status=Status.OK, tensors=(), blob: bytes = b"", arg: int = 0) -> None:
        reply = Message(
            request.op, request.table, 0, request.request_id, arg=arg, status=status, tensors=list(tensors), blob=blob
        )
        self.replies.append([bytes(f) for f in encode(reply)])


def _io(servers: int = 2) -> tuple[IOThread, list[FakeSocket]]:
    io = IOThread([f"127.0.0.1:{7000 + s}" for s in range(servers)], SECRET, worker_index=1, max_in_flight=4)
    io._sockets = [FakeSocket() for _ in range(servers)]
    return io, io._sockets


def _job(parts, combine=lambda replies: [r.tensors for r in replies], timeout_s=5.0) -> Job:
    return Job(Future(), parts, combine, timeout_s)


def _request(op=Op.PULL_DENSE, table=3) -> Message:
    return Message(op=op, table=table, peer=1)


def test_replies_are_matched_by_request_id_and_combined_in_the_callers_order():
    io, (a, b) = _io()
    job = _job([(0, _request()), (1, _request())])
    io.queue.put(job)
    io._admit()
    assert io._flush() == set() and len(a.sent) == len(b.sent) == 1
    b.answer(b.sent[0], tensors=[torch.tensor([2.0])])  # the second server answers first
    a.answer(a.sent[0], tensors=[torch.tensor([1.0])])
    io._receive(1)
    assert not job.future.done()
    io._receive(0)
    assert [t[0].item() for t in job.future.result(timeout=1)] == [1.0, 2.0]
    assert not io._active and not io._inflight


def test_an_error_reply_fails_the_job_with_the_servers_details():
    io, (a,) = _io(1)
    job = _job([(0, _request(Op.CREATE_DENSE))])
    io.queue.put(job)
    io._admit()
    io._flush()
    details = {"message": "conflicting create of table 3", "code": "conflicting_create", "table": 3}
    a.answer(a.sent[0], status=Status.ERROR, blob=json.dumps(details).encode())
    io._receive(0)
    with pytest.raises(PSRemoteError, match="rejected CREATE_DENSE: conflicting create of table 3") as error:
        job.future.result(timeout=1)
    assert error.value.details == {"code": "conflicting_create", "table": 3}


def test_a_settling_job_fails_only_after_every_server_answered():
    """A SAVE whose directory the caller removes on one server's error must outwait the other servers."""
    io, (a, b) = _io(2)
    settling = Job(Future(), [(0, _request(Op.SAVE, 0)), (1, _request(Op.SAVE, 0))], lambda r: r, 5.0, settle=True)
    plain = _job([(0, _request(Op.SAVE, 0)), (1, _request(Op.SAVE, 0))])
    for job in (settling, plain):
        io.queue.put(job)
    io._admit()
    io._flush()
    for request in a.sent:
        a.answer(request, status=Status.ERROR, blob=b"No space left on device: writing /x failed")
    io._receive(0)
    assert plain.future.done() and not settling.future.done()  # server 1 may still be writing
    b.answer(b.sent[0])
    io._receive(1)
    with pytest.raises(PSRemoteError, match="parameter server 0 .*No space left on device"):
        settling.future.result(timeout=1)
    assert not io._active and not io._inflight


def test_a_call_in_many_pieces_keeps_only_a_few_on_the_wire_per_server():
    """The rest wait in the client, so the server's turns (fleet.ps.server.inbox) reach other workers' requests."""
    from fleet.ps.client.io import PIECES_ON_THE_WIRE

    io, (a, b) = _io(2)
    parts = [(0, _request(Op.PULL_SPARSE, k)) for k in range(PIECES_ON_THE_WIRE + 6)] + [(1, _request())]
    job = _job(parts, combine=lambda replies: [r.table for r in replies])
    io.queue.put(job)
    io._admit()
    io._flush()
    assert [m.table for m in a.sent] == list(range(PIECES_ON_THE_WIRE)) and len(b.sent) == 1
    b.answer(b.sent[0])
    io._receive(1)
    answered = 0
    while answered < len(parts) - 1:
        a.answer(a.sent[answered])
        io._receive(0)
        answered += 1
        io._flush()
        assert len(a.sent) - answered == min(PIECES_ON_THE_WIRE, len(parts) - 1 - answered)  # one goes per answer
    assert job.future.result(timeout=1) == [m.table for _, m in parts]
    assert not io._active and not io._inflight


def test_a_lost_server_fails_a_call_whose_pieces_wait_in_the_client():
    from fleet.ps.client.io import PIECES_ON_THE_WIRE

    io, (a,) = _io(1)
    job = _job([(0, _request(Op.PULL_SPARSE, k)) for k in range(PIECES_ON_THE_WIRE + 3)])
    io.queue.put(job)
    io._admit()
    io._flush()
    io._fail_server(0, "closed the connection")
    with pytest.raises(PSServerUnavailable, match="closed the connection"):
        job.future.result(timeout=1)
    assert not io._active and not io._inflight


def test_a_stale_reply_counts_and_a_late_reply_is_ignored():
    io, (a,) = _io(1)
    push, pull = _job([(0, _request(Op.PUSH_DENSE_GRAD))]), _job([(0, _request())], timeout_s=0.01)
    io.queue.put(push)
    io.queue.put(pull)
    io._admit()
    io._flush()
    a.answer(a.sent[0], status=Status.STALE)
    io._receive(0)
    assert push.future.result(timeout=1) == [[]] and io.stale_pushes == 1
    io._expire(time.monotonic() + 1)  # the pull's deadline passed
    with pytest.raises(PSServerUnavailable, match=r"parameter server 0 at 127.0.0.1:7000 did not answer PULL_DENSE"):
        pull.future.result(timeout=1)
    a.answer(a.sent[1])  # its answer arrives after all: nobody waits for it any more
    io._receive(0)
    assert not io._inflight


def test_a_full_socket_keeps_the_message_until_it_can_go():
    io, (a,) = _io(1)
    a.full = True
    job = _job([(0, _request())])
    io.queue.put(job)
    io._admit()
    assert io._flush() == {0} and not a.sent  # the loop then polls the socket for POLLOUT
    a.full = False
    assert io._flush() == set() and len(a.sent) == 1


def test_a_lost_server_fails_what_is_in_flight_on_it_and_only_that():
    io, (a, b) = _io()
    on_a, on_b = _job([(0, _request())]), _job([(1, _request())])
    io.queue.put(on_a)
    io.queue.put(on_b)
    io._admit()
    io._flush()
    io._fail_server(0, "closed the connection")
    with pytest.raises(PSServerUnavailable, match="parameter server 0 at 127.0.0.1:7000 closed the connection while"):
        on_a.future.result(timeout=1)
    assert not on_b.future.done()
    io._fail_everything(PSClientClosed("closed"))
    with pytest.raises(PSClientClosed):
        on_b.future.result(timeout=1)


def test_a_restarted_server_answering_hello_fails_the_requests_it_cannot_answer_at_once():
    io, (a,) = _io(1)

    def hello_answered_by(incarnation: int) -> Job:
        hello = _job([(0, _request(Op.HELLO))])
        io.queue.put(hello)
        io._admit()
        io._flush()
        a.answer(a.sent[-1], arg=incarnation)
        io._receive(0)
        return hello

    hello_answered_by(5)
    pull = _job([(0, _request(Op.PULL_SPARSE))])  # reaches the new server, which parks it for a version it lacks
    io.queue.put(pull)
    io._admit()
    io._flush()
    hello_answered_by(5).future.result(timeout=1)  # the same server: nothing happens
    assert not pull.future.done()
    beat = hello_answered_by(9)  # a heartbeat answered by a new incarnation
    beat.future.result(timeout=1)
    with pytest.raises(PSServerUnavailable, match="parameter server 0 at 127.0.0.1:7000 was restarted .* PULL_SPARSE"):
        pull.future.result(timeout=1)
