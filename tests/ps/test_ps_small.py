"""The direct path's small-message writer and reader: the general way's bytes, and only messages it would decode."""

from __future__ import annotations

import random

import pytest
import torch

from fleet.ps.protocol import quick_pulls, small, unix
from fleet.ps.protocol.errors import WireError
from fleet.ps.protocol.wire import DTYPE_CODES, FRAME_BYTES, Message, Op, Status, decode, encode

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]  # fmt: skip
SHAPES = [(), (0,), (7,), (3, 0), (2, 3), (2, 3, 4), (1, 2, 3, 2)]


def _general(msg: Message) -> bytes:
    return b"".join(bytes(b) for b in unix.buffers(encode(msg)))


def _small(msg: Message) -> bytes:
    packed = small.pack(msg)
    assert packed is not None
    buffers, frame_bytes = packed
    assert frame_bytes == sum(unix.frame_bytes(f) for f in encode(msg))
    return b"".join(bytes(b) for b in buffers)


def _same(a: Message, b: Message) -> None:
    assert (a.op, a.table, a.peer, a.request_id, a.step, a.arg, a.lr, a.timeout_ms, a.status) == (
        b.op, b.table, b.peer, b.request_id, b.step, b.arg, b.lr, b.timeout_ms, b.status,
    )  # fmt: skip
    assert bytes(a.blob) == bytes(b.blob)
    assert len(a.tensors) == len(b.tensors)
    for x, y in zip(a.tensors, b.tensors, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape  # and the same bytes (a flipped byte may make a NaN)
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))


def _decoded(wire: bytes) -> Message:
    parsed = unix.parse(bytearray(wire))
    assert parsed is not None
    return decode(parsed[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_small_messages_are_the_general_bytes_and_read_back(dtype: torch.dtype) -> None:
    for shape in SHAPES:
        t = (torch.randn(shape) * 10).to(dtype)
        msg = Message(Op.PULL_DENSE, 3, 1, 99, -5, 7, 0.25, 1234, Status.OK, [t])
        wire = _small(msg)
        assert wire == _general(msg)
        scratch = bytearray(len(wire) + 64)  # the reader gets a buffer longer than the message, as on the path
        scratch[: len(wire)] = wire
        got = small.read(memoryview(scratch), len(wire))
        assert got is not None
        _same(got, _decoded(wire))
        scratch[: len(wire)] = bytes(len(wire))  # the tensor owns its bytes: the buffer is reused
        _same(got, _decoded(wire))


def test_a_request_without_tensors() -> None:
    msg = Message(Op.PULL_DENSE, 2, 0, 7, 0, 3, 0.0, 30000)
    wire = _small(msg)
    assert wire == _general(msg)
    got = small.read(bytearray(wire), len(wire))
    assert got is not None
    _same(got, _decoded(wire))


def test_what_the_small_way_leaves_to_the_general_way() -> None:
    t = torch.arange(4.0)
    assert small.pack(Message(Op.STATS, blob=b"{}")) is None  # a blob
    assert small.pack(Message(Op.PUSH_DENSE_GRAD, tensors=[t, t])) is None  # two tensors
    assert small.pack(Message(Op.PULL_DENSE, tensors=[torch.zeros(FRAME_BYTES // 4 + 1)])) is None  # two frames
    error = Message(Op.PULL_DENSE, status=Status.ERROR, blob=b"table 3 does not exist")
    wire = _general(error)
    assert small.read(bytearray(wire), len(wire)) is None  # an error reply carries its text: the general way
    one = _small(Message(Op.PULL_DENSE, status=Status.OK, tensors=[t]))
    assert small.read(bytearray(one), len(one) - 1) is None  # not all there yet
    assert small.read(bytearray(one + b"\0"), len(one) + 1) is None  # more than one message


def test_corrupted_bytes_never_make_a_different_message() -> None:
    """Every byte flipped and every truncation: the reader gives None, or what decode gives for those bytes."""
    rng = random.Random(0)
    msgs = [
        Message(Op.PULL_DENSE, 2, 0, 7, 0, 3, 0.0, 30000),
        Message(Op.PULL_SPARSE, 1, 0, 8, 2, 0, 0.0, 500, Status.REQUEST, [torch.arange(5)]),
        Message(Op.PULL_DENSE, 2, 1, 9, 0, 4, 0.0, 0, Status.OK, [torch.randn(2, 3)]),
    ]
    for msg in msgs:
        wire = _small(msg)
        cases = [wire[:n] for n in range(len(wire))]
        for at in range(len(wire)):
            for value in (0, 255, rng.randrange(256)):
                cases.append(wire[:at] + bytes([value]) + wire[at + 1 :])
        for case in cases:
            got = small.read(bytearray(case), len(case))
            if got is None:
                continue
            try:
                want = _decoded(case)
            except (WireError, unix.FramingError, AssertionError) as exc:
                raise AssertionError(f"the small reader took bytes the general way refuses ({exc})") from None
            _same(got, want)


def test_the_whole_pull_reader_takes_what_the_frame_reader_takes() -> None:
    """The server's one-struct reader of a whole pull (``whole_pull``) against cutting frames then ``plain_pull``,
    over every byte flipped and every truncation: the same message, or None where they refuse or it is no pull."""
    rng = random.Random(1)
    msgs = [
        Message(Op.PULL_DENSE, 2, 0, 7, 0, 3, 0.0, 30000),
        Message(Op.PULL_SPARSE, 1, 0, 8, 2, 0, 0.0, 500, Status.REQUEST, [torch.arange(5)]),
        Message(Op.PULL_SPARSE, 1, 0, 8, 2, 0, 0.0, 500, Status.REQUEST, [torch.arange(0)]),
        Message(Op.PUSH_DENSE_GRAD, 2, 0, 9, 1, 0, 0.1, 0, Status.REQUEST, [torch.randn(3)]),
    ]
    budget = 1 << 20
    for msg in msgs:
        wire = _small(msg)
        cases = [wire[:n] for n in range(len(wire))] + [wire + b"\0"]
        for at in range(len(wire)):
            for value in (0, 255, rng.randrange(256)):
                cases.append(wire[:at] + bytes([value]) + wire[at + 1 :])
        for case in cases:
            buf = bytearray(case)
            got = quick_pulls.whole_pull(memoryview(buf), len(buf), budget)
            try:
                parsed = unix.parse(bytearray(case))
            except unix.FramingError:
                parsed = None
            want = None
            if parsed is not None and parsed[1] == len(case):
                want = quick_pulls.plain_pull(parsed[0], budget)
            assert (got is None) == (want is None)
            if got is None:
                continue
            _same(got, want)
    assert quick_pulls.whole_pull(memoryview(bytearray(_small(msgs[1]))), len(_small(msgs[1])), 8) is None  # budget


def test_a_settled_future_is_a_finished_future() -> None:
    """What a direct call returns (``direct.Settled``): result, exception, callbacks, wait and as_completed as for
    a future resolved the usual way."""
    from concurrent.futures import FIRST_COMPLETED, Future, as_completed, wait

    from fleet.ps.client.direct import Settled

    done, failed, pending = Settled(5), Settled(exception=ValueError("no")), Future()
    assert done.done() and not done.cancelled() and not done.running() and not done.cancel()
    assert done.result(timeout=0) == 5 and done.exception() is None
    assert isinstance(failed.exception(), ValueError)
    with pytest.raises(ValueError, match="no"):
        failed.result()
    seen: list[int] = []
    done.add_done_callback(lambda f: seen.append(f.result()))
    assert seen == [5]
    assert wait([done, failed, pending], timeout=0.01, return_when=FIRST_COMPLETED)[0] == {done, failed}
    pending.set_result(1)
    assert set(as_completed([done, failed, pending], timeout=1)) == {done, failed, pending}


def test_a_flat_reply_packed_from_its_bytes_is_packs_bytes() -> None:
    for n in (0, 1, 4, 1000, small.COPY_BYTES // 4):
        t = torch.randn(n)
        for rid, step, arg in ((1, 0, 0), (2**40, -3, 17), (7, 2**62, 2**62)):
            reply = Message(Op.PULL_DENSE, 5, 2, rid, step, arg, status=Status.OK, tensors=[t])
            code = DTYPE_CODES[torch.float32]
            flat = small.pack_flat_reply(int(Op.PULL_DENSE), 5, 2, rid, step, arg, code, t.numpy().tobytes())
            assert bytes(flat) == _small(reply) == _general(reply)
            assert len(flat) - small.PREFIX_BYTES == small.pack(reply)[1]


def test_a_reply_written_once_and_filled_per_pull_is_packs_bytes() -> None:
    """The server's reply of one table's values at one version, rewritten per pull (FlatReply): pack_flat_reply's
    bytes for every request id and step, whatever the pulls before it."""
    code = DTYPE_CODES[torch.float32]
    for n in (0, 1, 4, 1000):
        data = torch.randn(n).numpy().tobytes()
        reply = small.FlatReply(int(Op.PULL_DENSE), 5, 2, 17, code, data)
        assert reply.data is data and reply.version == 17
        for rid, step in ((1, 0), (2**64 - 1, -(2**63)), (7, 2**63 - 1), (3, 0)):
            flat = small.pack_flat_reply(int(Op.PULL_DENSE), 5, 2, rid, step, 17, code, data)
            assert bytes(reply.fill(rid, step)) == bytes(flat)
            assert reply.frame_bytes == len(flat) - small.PREFIX_BYTES


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.bfloat16, torch.bool])
def test_an_expected_reply_is_taken_only_as_read_reads_it(dtype: torch.dtype) -> None:
    """The client's answer made ready while its pull is on the wire (Expected): over the expected reply with any
    version and values, every byte flipped, every truncation, a longer read and other replies, it takes exactly
    what read takes of the expected layout and gives the same message; anything else is None (read's to read)."""
    rng = random.Random(2)
    code = DTYPE_CODES[dtype]
    for n in (0, 1, 5):
        t = (torch.randn(n) * 10).to(dtype)
        wire = _small(Message(Op.PULL_DENSE, 3, 1, 99, 0, 12345, status=Status.OK, tensors=[t]))
        cases = [wire, wire + b"\0"] + [wire[:k] for k in range(len(wire))]
        for at in range(len(wire)):
            for value in (0, 255, rng.randrange(256)):
                cases.append(wire[:at] + bytes([value]) + wire[at + 1 :])
        cases.append(_small(Message(Op.PULL_DENSE, 3, 1, 99, 0, 1, status=Status.OK, tensors=[t.reshape(1, n)])))
        cases.append(_general(Message(Op.PULL_DENSE, 3, 1, 99, status=Status.ERROR, blob=b"table 3 is gone")))
        taken = 0
        for case in cases:
            expected = small.Expected(int(Op.PULL_DENSE), 3, 1, code, n).ready(99, 0)
            made = expected.msg
            buf = bytearray(len(case) + 64)  # a read buffer longer than the answer, as on the path
            buf[: len(case)] = case
            got = expected.take(buf, len(case))
            if got is None:
                continue
            taken += 1
            assert got is made and expected.msg is None and expected.take(buf, len(case)) is None
            want = small.read(bytearray(case), len(case))
            assert want is not None, "the expected reply took bytes the small reader refuses"
            _same(got, want)
            _same(got, _decoded(case))
            buf[: len(case)] = bytes(len(case))  # the tensor owns its bytes: the buffer is reused
            _same(got, want)
        assert taken >= 1  # the expected reply itself, at least (a flipped version or value byte too)
