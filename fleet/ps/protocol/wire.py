"""The parameter-server wire format: a fixed binary header plus raw tensor bytes.

A message is a ZeroMQ multipart sequence::

    [header][blob][data 0]...[data n-1]

``header`` is :data:`HEADER` followed by ``n`` fixed-size tensor descriptors
(:data:`DESCRIPTOR`: dtype code, ndim, four dims). ``blob`` is opaque bytes,
possibly empty: UTF-8 JSON for configs and stats, a path for SAVE/LOAD, the
message of an error reply. Each ``data`` frame holds exactly
``numel * itemsize`` bytes of one C-contiguous tensor.

No frame is larger than :data:`FRAME_BYTES`: a tensor of more bytes travels as
``ceil(nbytes / FRAME_BYTES)`` consecutive data frames, all full but the last
(both sides compute the count from the descriptor, so it is not sent), and the
blob must fit one frame. Why: ZeroMQ allocates a frame as soon as its header
declares the size, before the peer has authenticated, so every socket caps a
frame at :data:`FRAME_BYTES` (``zmq.MAXMSGSIZE``) and a stranger's handshake
can make a process allocate at most that much per connection. How much one
request may carry in all is a separate, per-kind limit (:mod:`fleet.ps.protocol.limits`).

Why this shape: nothing on the receiving side ever interprets bytes as code
(no pickle), every length is checked against the header before a tensor is
built, and tensor bytes are separate frames so they go out straight from the
tensor's memory (``copy=False``) and come in as a tensor over ZeroMQ's own
buffer (:func:`torch.frombuffer`) -- no serialisation copy on either side,
except one copy on receipt for a tensor spread over several frames.
"""

from __future__ import annotations

import enum
import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fleet.ps.protocol.errors import WireError
from fleet.ps.protocol.limits import Limit

MAGIC = b"FLPS"
PROTOCOL_VERSION = 2  # 2: tensors larger than FRAME_BYTES span several frames
MAX_NDIM = 4
MAX_TENSORS = 8
#: the largest frame either side sends or accepts (``zmq.MAXMSGSIZE`` of every socket). 4 MiB keeps
#: W3's 4 MiB dense push and pull one zero-copy frame each, and bounds what an unauthenticated
#: connection can make a process allocate: 8 such connections, 32 MiB.
FRAME_BYTES = 4 << 20
#: ``zmq.MAXMSGSIZE``: a frame and what CURVE wraps it in (a MESSAGE command: name, nonce, flags, MAC)
MAX_WIRE_FRAME = FRAME_BYTES + 256

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
    WRITE_SPARSE_ROWS = 19
    PULL_SPARSE_MANY = 20
    PUSH_SPARSE_GRAD_MANY = 21


#: DENSE_STATE (a user's own optimizer/model state_dict round trips): ``arg`` says what.
#: GET: reply [values, param_steps, *optimizer state] with blob {"names": [...], "step": n};
#: param_steps holds each of the table's parameters' step count (-1: not on this server).
#: SET_OPTIMIZER: request [param_steps, *optimizer state] with blob {"names": [...], "step": n}.
#: SET_VALUES: request [values] (parameters the user wrote: model.load_state_dict, clamping).
DENSE_STATE_GET, DENSE_STATE_SET_OPTIMIZER, DENSE_STATE_SET_VALUES = 0, 1, 2
#: LOAD's ``arg``: load at once (check everything, then apply), or the phases of a load over every
#: server: stage (check and load aside), commit (apply what was staged), discard it.
LOAD_NOW, LOAD_STAGE, LOAD_COMMIT, LOAD_DISCARD = 0, 1, 2, 3


#: PUSH_DENSE_GRAD's optional second tensor: a uint8 flag per parameter of the dense table (its config's
#: ``shapes``): frozen (``requires_grad=False``), trainable without a gradient on this worker, or with one.
FROZEN, NO_GRAD, HAS_GRAD = 0, 1, 2


#: EXPORT_SPARSE with ``step`` > 0 reads one bounded page: ``arg`` = first slot, ``step`` = rows asked for
#: (the server gives at most what fits one request); reply [ids, *fields] with blob {"names": [...], "total": n}.
#: WRITE_SPARSE_ROWS: request [ids, *fields] with blob {"names": [...]}; ``arg`` = WRITE_REPLACE clears the shard first.
WRITE_REPLACE = 1


def row_width(fields: dict[str, torch.Tensor]) -> int:
    """Values per row over the per-row ``fields`` of such a page or write (``[n, dim]`` count dim, ``[n]`` one):
    what the request limits size it by."""
    return max(1, sum(math.prod(t.shape[1:]) for t in fields.values()))


#: PULL_SPARSE_MANY / PUSH_SPARSE_GRAD_MANY: several sparse tables' pulls or pushes in one request;
#: their layout, and the functions both ends write and read it with, are :mod:`fleet.ps.protocol.composite`.


@dataclass
class SparsePush:
    """One table's row gradients for a step (an entry of a push of several tables): ids may repeat (the server sums them); clicks optional."""

    table: int
    ids: torch.Tensor
    grads: torch.Tensor
    step: int
    lr: float
    clicks: torch.Tensor | None = None


#: ``arg`` of a sparse push that is a piece of a bigger one, when more pieces of it follow
#: (the client splits pushes over the request limits, :mod:`fleet.ps.protocol.limits`)
MORE_FOLLOWS = 1

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
_STATUS_CODES = frozenset(int(s) for s in Status)
_OP_CODES = frozenset(int(o) for o in Op)
_OP_NAMES = {int(o): o.name for o in Op}
_NO_DIMS = (0,) * MAX_NDIM
_UINT8 = np.uint8
#: dtypes whose tensors ``.numpy()`` takes as they are (bfloat16 and friends go through a uint8 view first)
_NUMPY_BYTES = frozenset(
    (torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
)


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

    def set_arg(self, arg: int) -> None:
        """Write the op's integer argument (a reply made before its version was known: small.Expected)."""
        self.arg = arg

    def text(self) -> str:
        """The blob as text (error messages, paths)."""
        return bytes(self.blob).decode("utf-8", errors="replace")


def op_name(op: int) -> str:
    name = _OP_NAMES.get(op)
    return name if name is not None else f"op {op}"


def tensor_buffer(t: torch.Tensor) -> Any:
    """A zero-copy buffer over a tensor's bytes, for ``send_multipart(copy=False)``.

    The byte view works for every dtype numpy lacks (bfloat16) and for bool.
    Non-contiguous or non-CPU tensors are copied once, here, on purpose.
    """
    if not t.is_cpu:
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return b""
    if (
        t.dtype in _NUMPY_BYTES and not t.requires_grad
    ):  # one call where numpy has the dtype (a small reply's cost is these calls)
        return t.numpy().reshape(-1).view(_UINT8)
    return t.reshape(-1).view(torch.uint8).numpy()


def encode(msg: Message) -> list[Any]:
    """Frames for ``msg``; tensor frames reference the tensors' memory (no copy)."""
    if len(msg.tensors) > MAX_TENSORS:
        raise WireError(f"{len(msg.tensors)} tensors in one message; at most {MAX_TENSORS}")
    ntensors = len(msg.tensors)
    head = bytearray(HEADER.size + DESCRIPTOR.size * ntensors)
    HEADER.pack_into(
        head,
        0,
        MAGIC,
        PROTOCOL_VERSION,
        int(msg.op),
        int(msg.status),
        ntensors,
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
        shape = t.shape
        DESCRIPTOR.pack_into(head, HEADER.size + i * DESCRIPTOR.size, code, len(shape), *shape, *_NO_DIMS[len(shape) :])
        buf = tensor_buffer(t)
        if len(buf) <= FRAME_BYTES:
            data.append(buf)
        else:  # numpy slices: still views of the tensor's memory
            data.extend(buf[lo : lo + FRAME_BYTES] for lo in range(0, len(buf), FRAME_BYTES))
    if len(msg.blob) > FRAME_BYTES:
        raise WireError(f"a {len(msg.blob):,}-byte blob does not fit one frame ({FRAME_BYTES:,} bytes)")
    return [bytes(head), msg.blob, *data]


def frame_count(nbytes: int) -> int:
    """Data frames of a tensor of ``nbytes`` bytes (an empty tensor still has its one empty frame)."""
    return max(1, -(-nbytes // FRAME_BYTES))


def _buffer(frame: Any) -> memoryview:
    """The bytes of a received frame: a zmq.Frame (copy=False) or plain bytes."""
    if type(frame) is memoryview:
        return frame
    buf = getattr(frame, "buffer", None)
    return buf if buf is not None else memoryview(frame)


def read_request_id(frame: Any) -> tuple[int, int]:
    """(request id, op) from a header, best effort, for error replies to bad headers."""
    buf = _buffer(frame)
    if len(buf) < HEADER.size:
        return 0, 0
    fields = HEADER.unpack_from(buf, 0)
    return fields[7], fields[2]


def decode(frames: Sequence[Any], budget: Budget | None = None) -> Message:
    """Parse and check a frame sequence; raise :class:`WireError` saying what is wrong.

    ``budget(op, table)``: the most payload bytes (tensors and blob) a message of that kind may
    carry, or None for no bound; checked from the header, before any tensor is built, and an
    excess raises :class:`RequestTooLarge` with the budget's explanation.

    Tensors are views over the received frames' memory (no copy) unless the
    frame is misaligned for its dtype, or the tensor spans several frames, in
    which case it is copied once.
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
    if status not in _STATUS_CODES:
        raise WireError(f"unknown status {status}", rid, op)
    if status != Status.ERROR and op not in _OP_CODES:  # an error reply may echo the unknown op it complains about
        raise WireError(f"unknown op {op}", rid, op)
    if ntensors > MAX_TENSORS:
        raise WireError(f"{ntensors} tensors announced; at most {MAX_TENSORS}", rid, op)
    want = HEADER.size + DESCRIPTOR.size * ntensors
    if len(head) != want:
        raise WireError(f"header is {len(head)} bytes, expected {want} for {ntensors} tensors", rid, op)
    specs = [
        _spec(i, DESCRIPTOR.unpack_from(head, HEADER.size + i * DESCRIPTOR.size), rid, op) for i in range(ntensors)
    ]
    counts = [frame_count(nbytes) for _, _, nbytes in specs] if ntensors else []
    if len(frames) != 2 + sum(counts):
        raise WireError(
            f"{len(frames)} frames, expected {2 + sum(counts)} (header, blob, {ntensors} tensors in {sum(counts)})",
            rid,
            op,
        )
    blob = _buffer(frames[1])
    if budget is not None:
        limit = budget(op, table)
        carried = len(blob) + sum(nbytes for _, _, nbytes in specs)
        if limit is not None and carried > limit.bytes:
            raise RequestTooLarge(f"{op_name(op)} carries {carried:,} bytes; {limit.explain}", rid, op)
    tensors, at = [], 2
    for i, (dtype, shape, nbytes) in enumerate(specs):
        count = counts[i]
        parts = [_buffer(frames[at])] if count == 1 else [_buffer(f) for f in frames[at : at + count]]
        tensors.append(_tensor(i, dtype, shape, nbytes, parts, rid, op))
        at += count
    return Message(op, table, peer, rid, step, arg, lr, timeout_ms, status, tensors, blob)


class RequestTooLarge(WireError):
    """A message larger than its kind's budget (a request limit, not a malformed message)."""


#: ``budget(op, table)``: what a message of that kind may carry, or None for no bound
Budget = Callable[[int, int], "Limit | None"]


def _spec(i: int, fields: tuple[int, ...], rid: int, op: int) -> tuple[torch.dtype, list[int], int]:
    """(dtype, shape, byte count) of tensor ``i`` from its descriptor, checked."""
    code, ndim = fields[0], fields[1]
    dims = fields[2:]
    dtype = CODE_DTYPES.get(code)
    if dtype is None:
        raise WireError(f"tensor {i}: unknown dtype code {code}", rid, op)
    if ndim > MAX_NDIM:
        raise WireError(f"tensor {i}: {ndim} dims, at most {MAX_NDIM}", rid, op)
    shape = list(dims[:ndim])
    if (shape and min(shape) < 0) or any(dims[ndim:]):
        raise WireError(f"tensor {i}: invalid shape {shape} (ndim {ndim}, dims {list(dims)})", rid, op)
    return dtype, shape, math.prod(shape) * _ITEMSIZE[code]


def _tensor(
    i: int, dtype: torch.dtype, shape: list[int], nbytes: int, parts: list[memoryview], rid: int, op: int
) -> torch.Tensor:
    if len(parts) == 1:  # the usual case, checked in fewer steps
        data = parts[0]
        if len(data) != nbytes:
            raise WireError(f"tensor {i}: {len(data)} data bytes, but shape {shape} of {dtype} needs {nbytes}", rid, op)
        return _one_frame(dtype, shape, nbytes, data)
    got = sum(len(p) for p in parts)
    if got != nbytes or any(len(p) != FRAME_BYTES for p in parts[:-1]):
        sizes = f" in frames of {[len(p) for p in parts]}"
        raise WireError(f"tensor {i}: {got} data bytes{sizes}, but shape {shape} of {dtype} needs {nbytes}", rid, op)
    out = torch.empty(nbytes, dtype=torch.uint8)  # a tensor over several frames: joined, one copy
    view, at = memoryview(out.numpy()), 0
    for p in parts:
        view[at : at + len(p)] = p
        at += len(p)
    return out.view(dtype).view(shape)


def _one_frame(dtype: torch.dtype, shape: list[int], nbytes: int, data: memoryview) -> torch.Tensor:
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    if data.readonly:  # plain bytes (copy=True receives, tests); zmq frames are writable
        data = memoryview(bytearray(data))
    t = torch.frombuffer(data, dtype=dtype)
    if t.data_ptr() % t.element_size():
        # Small frames can sit at odd offsets (inside ZeroMQ's batch buffer; a direct reply's 8-byte data at offset
        # 108): copy the bytes first, into a fresh (aligned) buffer. Cloning the misaligned tensor instead crashed the
        # process (a segmentation fault for a float64 scalar, torch 2.13).
        t = torch.frombuffer(bytearray(data), dtype=dtype)
    if len(shape) != 1:
        t = t.view(shape)
    return t
