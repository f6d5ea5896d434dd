"""The parameter-server wire format: round trips, zero-copy receive, and every malformed case."""

from __future__ import annotations

import struct

import pytest
import torch
import zmq

from fleet.ps.protocol.errors import WireError
from fleet.ps.protocol.wire import DESCRIPTOR, HEADER, MAGIC, Message, Op, Status, decode, encode

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
]
SHAPES = [(), (0,), (7,), (3, 0), (2, 3), (2, 3, 4), (1, 2, 3, 2)]


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex or dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g).to(dtype)


def _as_bytes(frames: list) -> list[bytes]:
    return [bytes(memoryview(f)) for f in frames]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_every_dtype_and_shape(dtype: torch.dtype) -> None:
    for shape in SHAPES:
        t = _sample(dtype, shape)
        msg = Message(Op.PUSH_DENSE_GRAD, table=3, peer=1, request_id=99, step=5, arg=-2, lr=0.25, timeout_ms=7)
        msg.tensors = [t, t.flip(0) if t.dim() else t]  # a non-contiguous one too
        msg.blob = b'{"a": 1}'
        back = decode(_as_bytes(encode(msg)))
        assert (back.op, back.table, back.peer, back.request_id) == (Op.PUSH_DENSE_GRAD, 3, 1, 99)
        assert (back.step, back.arg, back.lr, back.timeout_ms, back.status) == (5, -2, 0.25, 7, Status.REQUEST)
        assert bytes(back.blob) == b'{"a": 1}'
        for sent, got in zip(msg.tensors, back.tensors, strict=True):
            assert got.dtype == dtype and got.shape == sent.shape
            assert torch.equal(got, sent)


@pytest.mark.timeout(60)
def test_zero_copy_over_zmq() -> None:
    """Sent from the tensor's memory, received as a tensor over ZeroMQ's buffer, writable."""
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://wire-test")
        b.connect("inproc://wire-test")
        big = torch.arange(1 << 20, dtype=torch.float32)
        frames = encode(Message(Op.PULL_DENSE, tensors=[big, torch.empty(0, 16)]))
        assert frames[2].__array_interface__["data"][0] == big.data_ptr()  # the frame is the tensor's memory
        a.send_multipart(frames, copy=False)
        got = decode(b.recv_multipart(copy=False))
        assert torch.equal(got.tensors[0], big) and got.tensors[1].shape == (0, 16)
        got.tensors[0].add_(1)  # the receiver owns the buffer and may update it in place
        assert got.tensors[0][0].item() == 1.0
    finally:
        a.close(0)
        b.close(0)
        ctx.term()


def _frames(**over) -> list[bytes]:
    msg = Message(Op.PULL_SPARSE, table=1, request_id=42, tensors=[torch.arange(4)])
    frames = _as_bytes(encode(msg))
    for k, v in over.items():
        frames[int(k[1:])] = v
    return frames


def _patched_header(offset: int, fmt: str, value) -> bytes:
    head = bytearray(_frames()[0])
    struct.pack_into(fmt, head, offset, value)
    return bytes(head)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "frames, needle",
    [
        ([], "empty message"),
        ([b"FLPS"], "truncated header"),
        (_frames(f0=b"XXXX" + _frames()[0][4:]), "bad magic"),
        (_frames(f0=_patched_header(4, "<B", 9)), "protocol version 9"),
        (_frames(f0=_patched_header(5, "<B", 200)), "unknown op 200"),
        (_frames(f0=_patched_header(6, "<B", 77)), "unknown status 77"),
        (_frames(f0=_frames()[0][:-3]), "header is"),
        (_frames()[:2], "frames, expected 3"),
        (_frames(f2=b"\x00" * 31), "31 data bytes"),
        (_frames(f0=_patched_header(HEADER.size, "<B", 250)), "unknown dtype code 250"),
        (_frames(f0=_patched_header(HEADER.size + 1, "<B", 5)), "5 dims"),
        (_frames(f0=_patched_header(HEADER.size + 8, "<q", -4)), "invalid shape"),
        (_frames(f0=_patched_header(HEADER.size + 8, "<q", 1 << 60)), "frames, expected"),
    ],
)
def test_malformed_messages_are_named(frames: list[bytes], needle: str) -> None:
    with pytest.raises(WireError, match=needle) as info:
        decode(frames)
    if len(frames) and len(frames[0]) >= HEADER.size and frames[0][:4] == MAGIC:
        assert info.value.request_id == 42  # still addressable for an error reply


@pytest.mark.timeout(60)
def test_encode_refuses_what_the_wire_cannot_carry() -> None:
    with pytest.raises(WireError, match="dtype"):
        encode(Message(Op.PUSH_DENSE_GRAD, tensors=[torch.zeros(2, dtype=torch.uint16)]))
    with pytest.raises(WireError, match="dims"):
        encode(Message(Op.PUSH_DENSE_GRAD, tensors=[torch.zeros(1, 1, 1, 1, 1)]))
    assert DESCRIPTOR.size == 40 and HEADER.size == 52


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.complex128])
def test_a_misaligned_frame_is_read_without_crashing(dtype: torch.dtype) -> None:
    """A direct reply's data sits at offset 108 of its buffer: a float64 scalar there crashed decode (a clone)."""
    for shape in [(), (3,), (2, 2)]:
        t = (torch.randn(shape) * 10).to(dtype)
        frames = encode(Message(Op.PULL_DENSE, status=Status.OK, tensors=[t]))
        data = bytes(frames[2])
        buf = bytearray(4 + len(data))
        buf[4:] = data
        got = decode([frames[0], frames[1], memoryview(buf)[4:]]).tensors[0]
        assert got.shape == t.shape and torch.equal(got, t)
        assert got.data_ptr() % got.element_size() == 0
