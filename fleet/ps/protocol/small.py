"""Small messages of the direct path written and read in one step: the same bytes, fewer calls.

Why: on the direct same-host path (:mod:`fleet.ps.protocol.unix`) a small pull's round trip is
mostly Python on both ends, and most of that was the general writer and reader: a frame list,
then a length prefix for it, then a buffer per frame; on receipt the prefix read twice, the frames
cut out, the header and descriptor unpacked one by one. The usual small message -- a request or
reply with an empty blob and at most one tensor of one frame (a pull, its answer) -- has a fixed
layout, so :func:`pack` writes its prefix, header and descriptor with one ``struct`` call and
:func:`read` reads them back with one.

The bytes are exactly those of :func:`fleet.ps.protocol.unix.buffers` over
:func:`fleet.ps.protocol.wire.encode`, so either end may use either way. :func:`read` accepts only
what :func:`~fleet.ps.protocol.wire.decode` would turn into the same message, whole in the bytes
given; anything else (an error reply with its text, several tensors, a malformed header, a partial
read) returns None and takes the general way, which raises the general errors. Nothing read is
interpreted as code; every length is checked against the bytes there before a tensor is built.
"""

from __future__ import annotations

import math
import struct
from ctypes import string_at
from typing import Any

import torch

from fleet.ps.protocol.unix import COUNT
from fleet.ps.protocol.wire import (
    _ITEMSIZE,
    _NO_DIMS,
    _OP_CODES,
    _STATUS_CODES,
    CODE_DTYPES,
    DESCRIPTOR,
    DTYPE_CODES,
    FRAME_BYTES,
    HEADER,
    MAGIC,
    PROTOCOL_VERSION,
    Message,
    Status,
    tensor_buffer,
)

#: frame count and the header's and blob's lengths, then the header (a message without tensors)
_BARE = struct.Struct("<3I" + HEADER.format.lstrip("<"))
#: frame count and the header's, blob's and data's lengths, then the header and one descriptor
_ONE = struct.Struct("<4I" + HEADER.format.lstrip("<") + DESCRIPTOR.format.lstrip("<"))
_ONE_HEAD = HEADER.size + DESCRIPTOR.size
_ERROR = int(Status.ERROR)
_OK = int(Status.OK)
#: the length prefix of a one-tensor message on the direct path (frame count, then each frame's length): not frame bytes
PREFIX_BYTES = 4 * COUNT.size
#: a tensor up to this size is copied into the message's one buffer rather than viewed (see :func:`pack`)
COPY_BYTES = 64 << 10
assert _BARE.size == 3 * COUNT.size + HEADER.size and _ONE.size == 4 * COUNT.size + _ONE_HEAD


def pack(msg: Message) -> tuple[list[Any], int] | None:
    """(the byte views to write for ``msg``, its frames' bytes) when it is small and plain, else None.

    Plain: an empty blob and at most one tensor, of a dtype the wire carries, at most
    :data:`~fleet.ps.protocol.wire.MAX_NDIM` dims, one frame's bytes. Up to :data:`COPY_BYTES` of a CPU
    tensor are copied after the header into one buffer; a larger tensor's bytes are a view of its
    memory (no copy), as in :func:`~fleet.ps.protocol.wire.encode`.
    """
    if len(msg.blob):
        return None
    tensors = msg.tensors
    if not tensors:
        head = _BARE.pack(
            2, HEADER.size, 0, MAGIC, PROTOCOL_VERSION, msg.op, msg.status, 0, msg.table, msg.peer,
            msg.request_id, msg.step, msg.arg, msg.lr, msg.timeout_ms,
        )  # fmt: skip
        return [memoryview(head)], HEADER.size
    if len(tensors) != 1:
        return None
    t = tensors[0]
    code = DTYPE_CODES.get(t.dtype)
    shape = t.shape
    ndim = len(shape)
    if code is None or ndim > 4:
        return None
    nbytes = t.nbytes
    if nbytes <= COPY_BYTES and t.is_cpu and t.is_contiguous():
        # a copy of the bytes is cheaper than a view: numpy's view costs ~6 us, this ~1 us, and head and data go
        # as one buffer (data_ptr includes the storage offset; the tensor lives until string_at returns)
        data: Any = string_at(t.data_ptr(), nbytes) if nbytes else b""
    else:
        data = tensor_buffer(t)
        nbytes = len(data)
        if nbytes > FRAME_BYTES:
            return None
    head = _ONE.pack(
        3, _ONE_HEAD, 0, nbytes, MAGIC, PROTOCOL_VERSION, msg.op, msg.status, 1, msg.table, msg.peer,
        msg.request_id, msg.step, msg.arg, msg.lr, msg.timeout_ms, code, ndim, *shape, *_NO_DIMS[ndim:],
    )  # fmt: skip
    if type(data) is bytes:
        return [memoryview(head + data)], _ONE_HEAD + nbytes
    return ([memoryview(head), memoryview(data)] if nbytes else [memoryview(head)]), _ONE_HEAD + nbytes


_REQUEST = int(Status.REQUEST)


def pull_request(op: int, table: int, peer: int, request_id: int, arg: int, timeout_ms: int) -> bytes:
    """:func:`pack`'s bytes for a request without tensors (a PULL_DENSE): ``Message(op, table, peer, request_id,
    arg=arg, timeout_ms=timeout_ms)``, in one ``struct`` call (the quick pull of :mod:`fleet.ps.client.direct`)."""
    return _BARE.pack(
        2, HEADER.size, 0, MAGIC, PROTOCOL_VERSION, op, _REQUEST, 0, table, peer, request_id, 0, arg, 0.0, timeout_ms
    )


def pack_flat_reply(
    op: int, table: int, peer: int, request_id: int, step: int, arg: int, code: int, data: bytes
) -> memoryview:
    """:func:`pack`'s bytes for an OK reply of one flat tensor (dtype ``code``) whose bytes are ``data``, at most
    :data:`COPY_BYTES` (a copy the caller made), with no ``lr`` and no deadline.

    Why: the server's quick dense pull (fleet.ps.server.loop) answers from the bytes its table keeps per version,
    without a :class:`Message` and the tensor's attributes read again on every pull.
    """
    nbytes = len(data)
    itemsize = _ITEMSIZE[code]
    head = _ONE.pack(
        3, _ONE_HEAD, 0, nbytes, MAGIC, PROTOCOL_VERSION, op, _OK, 1, table, peer,
        request_id, step, arg, 0.0, 0, code, 1, nbytes // itemsize, *_NO_DIMS[1:],
    )  # fmt: skip
    return memoryview(head + data)


#: where a one-tensor reply's request id and step lie in its bytes (after the length prefix and the header's first fields)
_ID_STEP = struct.Struct("<Qq")
_ID_STEP_AT = PREFIX_BYTES + struct.calcsize("<4sBBBBII")
assert HEADER.format.lstrip("<").startswith("4sBBBBIIQq")


class FlatReply:
    """:func:`pack_flat_reply`'s bytes for one table's values at one version, written once and answered with many
    times: each answer writes only its request id and step into them (:meth:`fill`).

    Why: the 22 fields of the reply's prefix, header and descriptor were most of the server's Python per small
    pull; of them, only the request id and the step differ between two pulls of the same values.
    """

    __slots__ = ("buf", "data", "frame_bytes", "version")

    def __init__(self, op: int, table: int, peer: int, version: int, code: int, data: bytes):
        #: the values' bytes the reply carries (who keeps them compares with ``is``: a new snapshot is a new object)
        self.data = data
        self.version = version
        self.buf = bytearray(pack_flat_reply(op, table, peer, 0, 0, version, code, data))
        #: the reply's frames' bytes (its length prefix is not counted, as for :func:`pack`)
        self.frame_bytes = len(self.buf) - PREFIX_BYTES

    def fill(self, request_id: int, step: int) -> bytearray:
        """The reply to the request ``request_id`` (whose step was ``step``): the one buffer, rewritten in place
        (so it is sent, or copied, before the next :meth:`fill`)."""
        _ID_STEP.pack_into(self.buf, _ID_STEP_AT, request_id, step)
        return self.buf


#: where a one-tensor reply's version (its ``arg``) lies in its bytes: between the step and the ``lr``
_ARG = struct.Struct("<q")
_ARG_AT = _ID_STEP_AT + _ID_STEP.size


class Expected:
    """The answer a small pull of one flat tensor will most likely get: that of the last pull of the same table,
    but for its request id, step, version and values. Made ready (:meth:`ready`) while the request is on its way:
    a :class:`Message` over a tensor of its own, for the answer's version and values to be written into.

    Why: the caller waits for the server meanwhile, so what is made then costs the round trip nothing; once the
    answer is in, :meth:`take` checks it with a few comparisons and copies the values, where :func:`read` would
    unpack and check every field, then build the tensor and the message.

    ``buf`` (given to :meth:`take`) is a ``bytearray``, the answer at its start. What it takes is exactly what
    :func:`read` takes of those bytes and gives the same message (every other byte is that of a valid message;
    any version and any values are read as they are); anything else is None, for :func:`read` to read. One caller
    at a time: :meth:`ready` replaces the message the last call made ready (the caller kept it, or dropped it).
    """

    __slots__ = ("_after", "_dtype", "_nbytes", "_prefix", "_size", "data", "msg", "op", "peer", "table")

    def __init__(self, op: int, table: int, peer: int, code: int, numel: int):
        self.op, self.table, self.peer = op, table, peer
        self._nbytes = nbytes = numel * _ITEMSIZE[code]
        head = _ONE.pack(
            3, _ONE_HEAD, 0, nbytes, MAGIC, PROTOCOL_VERSION, op, _OK, 1, table, peer,
            0, 0, 0, 0.0, 0, code, 1, numel, *_NO_DIMS[1:],
        )  # fmt: skip
        self._prefix = head[:_ID_STEP_AT]  # up to the request id
        self._after = head[_ARG_AT + _ARG.size :]  # after the version
        self._size = _ONE.size + nbytes
        self._dtype = CODE_DTYPES[code]
        #: the message :meth:`ready` made, and its values' buffer (the tensor's memory; None: no values)
        self.msg: Message | None = None
        self.data: bytearray | None = None

    def ready(self, request_id: int, step: int) -> Expected:
        """Make the answer to the request ``request_id`` (of step ``step``) ready: a message and its own tensor."""
        dtype = self._dtype
        if self._nbytes:
            self.data = data = bytearray(self._nbytes)
            t = torch.frombuffer(data, dtype=dtype)
        else:
            self.data, t = None, torch.empty((0,), dtype=dtype)
        self.msg = Message(self.op, self.table, self.peer, request_id, step, 0, 0.0, 0, _OK, [t], b"")
        return self

    def take(self, buf: bytearray, got: int) -> Message | None:
        """The message made ready, with the version and values of ``buf[:got]``, when those bytes are it (it is then
        the caller's: :attr:`msg` is None until the next :meth:`ready`); else None."""
        msg = self.msg
        if (
            msg is None
            or got != self._size
            or not buf.startswith(self._prefix)
            or _ID_STEP.unpack_from(buf, _ID_STEP_AT) != (msg.request_id, msg.step)
            or not buf.startswith(self._after, _ARG_AT + _ARG.size)
        ):
            return None
        msg.set_arg(_ARG.unpack_from(buf, _ARG_AT)[0])
        if self.data is not None:
            self.data[:] = memoryview(buf)[_ONE.size : got]
        self.msg = self.data = None  # the caller's now: nothing here writes into it again
        return msg


def read(buf: Any, got: int) -> Message | None:
    """The message of one tensor (or none) and an empty blob that is exactly ``buf[:got]``, else None.

    The tensor is built over a copy of its bytes (the caller reuses ``buf``).
    """
    if got == _BARE.size:
        (count, hsize, bsize, magic, version, op, status, ntensors, table, peer, rid, step, arg, lr,
         timeout_ms) = _BARE.unpack_from(buf, 0)  # fmt: skip
        if count != 2 or hsize != HEADER.size or bsize or ntensors:
            return None
        tensors: list[torch.Tensor] = []
    elif got >= _ONE.size:
        (count, hsize, bsize, nbytes, magic, version, op, status, ntensors, table, peer, rid, step, arg, lr,
         timeout_ms, code, ndim, d0, d1, d2, d3) = _ONE.unpack_from(buf, 0)  # fmt: skip
        if count != 3 or hsize != _ONE_HEAD or bsize or ntensors != 1 or got != _ONE.size + nbytes:
            return None
        itemsize = _ITEMSIZE.get(code)
        if itemsize is None or nbytes > FRAME_BYTES:
            return None
        if ndim == 1 and not (d1 or d2 or d3):  # the usual answer, a flat tensor: fewer checks to the same end
            if d0 * itemsize != nbytes:
                return None
            shape: tuple[int, ...] | None = None
        else:
            dims = (d0, d1, d2, d3)
            if ndim > 4 or min(dims) < 0 or any(dims[ndim:]):
                return None
            shape = dims[:ndim]
            if math.prod(shape) * itemsize != nbytes:
                return None
        dtype = CODE_DTYPES[code]
        if nbytes:
            t = torch.frombuffer(bytearray(buf[_ONE.size : got]), dtype=dtype)
            tensors = [t if shape is None else t.view(shape)]
        else:
            tensors = [torch.empty((0,) if shape is None else shape, dtype=dtype)]
    else:
        return None
    if magic != MAGIC or version != PROTOCOL_VERSION or status not in _STATUS_CODES:
        return None
    if status != _ERROR and op not in _OP_CODES:
        return None
    return Message(op, table, peer, rid, step, arg, lr, timeout_ms, status, tensors, b"")
