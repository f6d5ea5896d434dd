"""The parameter-server wire format: a fixed binary header plus raw tensor bytes.

A message is a ZeroMQ multipart sequence::

    [header][blob][data 0]...[data n-1]

``header`` is :data:`HEADER` followed by ``n`` fixed-size tensor descriptors
(:data:`DESCRIPTOR`: dtype code, ndim, four dims). ``blob`` is opaque bytes,
possibly empty: UTF-8 JSON for configs and stats, a path for SAVE/LOAD, the
message of an error reply. Each ``data`` frame holds exactly
``numel * itemsize`` bytes of one C-contiguous tensor.

Why this shape: nothing on the receiving side ever interprets bytes as code
(no pickle), every length is checked against the header before a tensor is
built, and tensor bytes are separate frames so they go out straight from the
tensor's memory (``copy=False``) and come in as a tensor over ZeroMQ's own
buffer (:func:`torch.frombuffer`) -- no serialisation copy on either side.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fleet.ps.errors import WireError

MAGIC = b"FLPS"
PROTOCOL_VERSION = 1
MAX_NDIM = 4
MAX_TENSORS = 8

#: magic, version, op, status, ntensors, table, peer, request id, step, arg, lr, timeout_ms
HEADER = struct.Struct("<4sBBBBIIQqqdI")
#: dtype code, ndim, 6 pad bytes, 4 dims
DESCRIPTOR = struct.Struct("<BB6x4q")


class Op(enum.IntEnum):
    """Operations; a reply carries the op of its request."""

    HELLO = 1
    CREATE_DENSE = 2
    CREATE_SPARSE = 3
    PULL_DENSE = 4
    PUSH_DENSE_GRAD = 5
    PUSH_DENSE_DELTA = 6
    PULL_SPARSE = 7
    PUSH_SPARSE_GRAD = 8
    PUSH_SPARSE_DELTA = 9
    BARRIER = 10
    SAVE = 11
    LOAD = 12
    STATS = 13
    STOP = 14
    ALL_REDUCE = 15
    SHRINK = 16
    EXPORT_SPARSE = 17
    DENSE_STATE = 18


#: DENSE_STATE (a user's own optimizer/model state_dict round trips): ``arg`` says what.
#: GET: reply [values, param_steps, *optimizer state] with blob {"names": [...], "step": n};
#: param_steps holds each of the table's parameters' step count (-1: not on this server).
#: SET_OPTIMIZER: request [param_steps, *optimizer state] with blob {"names": [...], "step": n}.
#: SET_VALUES: request [values] (parameters the user wrote: model.load_state_dict, clamping).
DENSE_STATE_GET, DENSE_STATE_SET_OPTIMIZER, DENSE_STATE_SET_VALUES = 0, 1, 2


#: ALL_REDUCE (``fleet.metrics``): one 1-D float64 tensor, ``arg`` = the reduction's index here;
#: server 0 answers every worker with the element-wise reduction once every active worker sent its own.
REDUCE_OPS = ("sum", "max", "min")


class Status(enum.IntEnum):
    """Reply status. STALE is a success: the push was late and dropped on purpose."""

    REQUEST = 0
    OK = 1
    ERROR = 2
    STALE = 3


_DTYPES: tuple[torch.dtype, ...] = (
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
)
DTYPE_CODES: dict[torch.dtype, int] = {dt: i + 1 for i, dt in enumerate(_DTYPES)}
CODE_DTYPES: dict[int, torch.dtype] = {i + 1: dt for i, dt in enumerate(_DTYPES)}
_ITEMSIZE: dict[int, int] = {code: torch.empty((), dtype=dt).element_size() for code, dt in CODE_DTYPES.items()}


@dataclass(slots=True)
class Message:
    """One request or reply, decoded.

    ``peer`` is the sender's worker index in requests and the server index in
    replies; ``arg`` is the op's integer argument (min_version of a pull, the
    table version in replies); ``timeout_ms`` is how long the sender waits.
    """

    op: int
    table: int = 0
    peer: int = 0
    request_id: int = 0
    step: int = 0
    arg: int = 0
    lr: float = 0.0
    timeout_ms: int = 0
    status: int = Status.REQUEST
    tensors: list[torch.Tensor] = field(default_factory=list)
    blob: bytes | memoryview = b""

    def op_name(self) -> str:
        return op_name(self.op)

    def text(self) -> str:
        """The blob as text (error messages, paths)."""
        return bytes(self.blob).decode("utf-8", errors="replace")


def op_name(op: int) -> str:
    try:
        return Op(op).name
    except ValueError:
        return f"op {op}"


def tensor_buffer(t: torch.Tensor) -> Any:
    """A zero-copy buffer over a tensor's bytes, for ``send_multipart(copy=False)``.

    The byte view works for every dtype numpy lacks (bfloat16) and for bool.
    Non-contiguous or non-CPU tensors are copied once, here, on purpose.
    """
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy()


def encode(msg: Message) -> list[Any]:
    """Frames for ``msg``; tensor frames reference the tensors' memory (no copy)."""
    if len(msg.tensors) > MAX_TENSORS:
        raise WireError(f"{len(msg.tensors)} tensors in one message; at most {MAX_TENSORS}")
    head = bytearray(HEADER.size + DESCRIPTOR.size * len(msg.tensors))
    HEADER.pack_into(
        head,
        0,
        MAGIC,
        PROTOCOL_VERSION,
        int(msg.op),
        int(msg.status),
        len(msg.tensors),
        msg.table,
        msg.peer,
        msg.request_id,
        msg.step,
        msg.arg,
        msg.lr,
        msg.timeout_ms,
    )
    data: list[Any] = []
    for i, t in enumerate(msg.tensors):
        code = DTYPE_CODES.get(t.dtype)
        if code is None:
            raise WireError(f"tensor {i} has dtype {t.dtype}, which the wire format does not carry")
        if t.dim() > MAX_NDIM:
            raise WireError(f"tensor {i} has {t.dim()} dims; the wire format carries at most {MAX_NDIM}")
        dims = list(t.shape) + [0] * (MAX_NDIM - t.dim())
        DESCRIPTOR.pack_into(head, HEADER.size + i * DESCRIPTOR.size, code, t.dim(), *dims)
        data.append(tensor_buffer(t))
    return [bytes(head), msg.blob, *data]


def _buffer(frame: Any) -> memoryview:
    """The bytes of a received frame: a zmq.Frame (copy=False) or plain bytes."""
    buf = getattr(frame, "buffer", None)
    return buf if buf is not None else memoryview(frame)


def read_request_id(frame: Any) -> tuple[int, int]:
    """(request id, op) from a header, best effort, for error replies to bad headers."""
    buf = _buffer(frame)
    if len(buf) < HEADER.size:
        return 0, 0
    fields = HEADER.unpack_from(buf, 0)
    return fields[7], fields[2]


def decode(frames: Sequence[Any]) -> Message:
    """Parse and check a frame sequence; raise :class:`WireError` saying what is wrong.

    Tensors are views over the received frames' memory (no copy) unless the
    frame is misaligned for its dtype, in which case it is copied once.
    """
    if not frames:
        raise WireError("empty message")
    head = _buffer(frames[0])
    if len(head) < HEADER.size:
        raise WireError(f"truncated header: {len(head)} bytes, expected at least {HEADER.size}")
    magic, version, op, status, ntensors, table, peer, rid, step, arg, lr, timeout_ms = HEADER.unpack_from(head, 0)
    if magic != MAGIC:
        raise WireError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}", rid, op)
    if version != PROTOCOL_VERSION:
        raise WireError(f"protocol version {version}, this side speaks {PROTOCOL_VERSION}", rid, op)
    try:
        Status(status)
    except ValueError:
        raise WireError(f"unknown status {status}", rid, op) from None
    if status != Status.ERROR:  # an error reply may echo the unknown op it complains about
        try:
            Op(op)
        except ValueError:
            raise WireError(f"unknown op {op}", rid, op) from None
    if ntensors > MAX_TENSORS:
        raise WireError(f"{ntensors} tensors announced; at most {MAX_TENSORS}", rid, op)
    want = HEADER.size + DESCRIPTOR.size * ntensors
    if len(head) != want:
        raise WireError(f"header is {len(head)} bytes, expected {want} for {ntensors} tensors", rid, op)
    if len(frames) != 2 + ntensors:
        raise WireError(f"{len(frames)} frames, expected {2 + ntensors} (header, blob, {ntensors} tensors)", rid, op)
    tensors = []
    for i in range(ntensors):
        code, ndim, *dims = DESCRIPTOR.unpack_from(head, HEADER.size + i * DESCRIPTOR.size)
        tensors.append(_tensor(i, code, ndim, dims, _buffer(frames[2 + i]), rid, op))
    blob = _buffer(frames[1])
    return Message(op, table, peer, rid, step, arg, lr, timeout_ms, status, tensors, blob)


def _tensor(i: int, code: int, ndim: int, dims: list[int], data: memoryview, rid: int, op: int) -> torch.Tensor:
    dtype = CODE_DTYPES.get(code)
    if dtype is None:
        raise WireError(f"tensor {i}: unknown dtype code {code}", rid, op)
    if ndim > MAX_NDIM:
        raise WireError(f"tensor {i}: {ndim} dims, at most {MAX_NDIM}", rid, op)
    shape = dims[:ndim]
    if any(d < 0 for d in shape) or any(d != 0 for d in dims[ndim:]):
        raise WireError(f"tensor {i}: invalid shape {dims[:ndim]} (ndim {ndim}, dims {dims})", rid, op)
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * _ITEMSIZE[code]
    if len(data) != nbytes:
        raise WireError(
            f"tensor {i}: {len(data)} data bytes, but shape {shape} of {dtype} needs {nbytes}",
            rid,
            op,
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    if data.readonly:  # plain bytes (copy=True receives, tests); zmq frames are writable
        data = memoryview(bytearray(data))
    t = torch.frombuffer(data, dtype=dtype).view(shape)
    if t.data_ptr() % _ITEMSIZE[code]:
        t = t.clone()  # small frames can sit at odd offsets inside ZeroMQ's batch buffer
    return t
