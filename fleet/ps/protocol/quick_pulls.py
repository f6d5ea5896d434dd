"""Small pulls recognised as they are read: the wire format's second reader, for the server's quick way.

Why: a caller blocked on ``client.pull_dense(t).result()`` waits for the server's whole
path, and for a 16-byte request that path was all overhead: queue the copied frames in the
inbox, go round the poller again, decode them generically, answer through the table lanes.
Measured on 2 cores, the server spent ~160 us of CPU per such request against ~25 us for a
raw echo. So the server's direct connections (:mod:`fleet.ps.server.direct_conns`) hand each
complete message to the loop, which serves it at once when :func:`plain_pull` reads it as a
plain, well-formed pull -- with the same handler, the same checks and the same reply as any
other request. It lives here, beside :func:`~fleet.ps.protocol.wire.decode`, because it reads
the same bytes: the wire format is read and written in this package only.

Nothing new is trusted: :func:`plain_pull` accepts only the messages that
:func:`~fleet.ps.protocol.wire.decode` would turn into the same :class:`~fleet.ps.protocol.wire.Message`
(and within the request budget); anything else -- a malformed header, an unknown op, a tensor
of the wrong kind, a blob, a request over a limit -- returns None and takes the usual way,
which answers it with the usual error. The server also takes the usual way whenever other
requests are queued or a table thread is busy (fleet.ps.server.loop), so the order in which
requests are served, and the tables' one-at-a-time rule, are those of the usual path.
"""

from __future__ import annotations

import struct

import torch

from fleet.ps.protocol.unix import COUNT
from fleet.ps.protocol.wire import (
    DESCRIPTOR,
    DTYPE_CODES,
    FRAME_BYTES,
    HEADER,
    MAGIC,
    PROTOCOL_VERSION,
    Message,
    Op,
    Status,
)

_PULL_DENSE, _PULL_SPARSE = int(Op.PULL_DENSE), int(Op.PULL_SPARSE)
_REQUEST = int(Status.REQUEST)
_INT64 = DTYPE_CODES[torch.int64]
_ONE_TENSOR = HEADER.size + DESCRIPTOR.size
#: a whole PULL_DENSE as the direct path frames it: frame count, the header's and the blob's lengths, the header
_DENSE = struct.Struct("<3I" + HEADER.format.lstrip("<"))
#: a whole PULL_SPARSE's prefix: frame count, the header's, blob's and ids' lengths, the header, the ids' descriptor
_SPARSE = struct.Struct("<4I" + HEADER.format.lstrip("<") + DESCRIPTOR.format.lstrip("<"))
assert _DENSE.size == 3 * COUNT.size + HEADER.size and _SPARSE.size == 4 * COUNT.size + _ONE_TENSOR


def plain_pull(frames: list[memoryview], max_bytes: int) -> Message | None:
    """The PULL_DENSE or PULL_SPARSE request ``frames`` (header, blob, ids) hold, or None for anything else.

    ``max_bytes``: the request budget (what :func:`~fleet.ps.protocol.wire.decode` would check). The
    message returned holds no view of ``frames`` (the ids are copied): it may be parked and outlive them.
    """
    nframes = len(frames)
    if nframes < 2 or nframes > 3 or len(frames[1]):
        return None  # a pull has no blob
    head = frames[0]
    size = len(head)
    if size < HEADER.size:
        return None
    magic, version, op, status, ntensors, table, peer, rid, step, arg, lr, timeout_ms = HEADER.unpack_from(head, 0)
    if magic != MAGIC or version != PROTOCOL_VERSION or status != _REQUEST:
        return None
    if op == _PULL_DENSE:
        if ntensors or nframes != 2 or size != HEADER.size:
            return None
        tensors = []
    elif op == _PULL_SPARSE:
        if ntensors != 1 or nframes != 3 or size != _ONE_TENSOR:
            return None
        code, ndim, n, *rest = DESCRIPTOR.unpack_from(head, HEADER.size)
        data = frames[2]
        nbytes = len(data)
        if code != _INT64 or ndim != 1 or any(rest) or n < 0 or nbytes != 8 * n:
            return None
        if nbytes > max_bytes or nbytes > FRAME_BYTES:
            return None  # over the budget, or a tensor of several frames: the usual way says what is wrong
        ids = torch.frombuffer(bytearray(data), dtype=torch.int64) if n else torch.empty(0, dtype=torch.int64)
        tensors = [ids]
    else:
        return None
    return Message(op, table, peer, rid, step, arg, lr, timeout_ms, status, tensors, b"")


#: the length of a read that is one whole PULL_DENSE as the direct path frames it (see :func:`dense_pull`)
DENSE_BYTES = _DENSE.size


def dense_pull(buf: memoryview) -> tuple[int, int, int, int, int, float, int] | None:
    """The fields (table, peer, request id, step, arg, lr, timeout_ms) of the PULL_DENSE that is exactly
    ``buf[:DENSE_BYTES]``, length prefix included, else None: what :func:`whole_pull` accepts of that length,
    without a :class:`Message` (the server's quick dense pull answers it from the fields)."""
    (count, hsize, bsize, magic, version, op, status, ntensors, table, peer, rid, step, arg, lr,
     timeout_ms) = _DENSE.unpack_from(buf, 0)  # fmt: skip
    if count != 2 or hsize != HEADER.size or bsize or op != _PULL_DENSE or ntensors:
        return None
    if magic != MAGIC or version != PROTOCOL_VERSION or status != _REQUEST:
        return None
    return table, peer, rid, step, arg, lr, timeout_ms


def whole_pull(buf: memoryview, got: int, max_bytes: int) -> Message | None:
    """:func:`plain_pull` of the one message that is exactly ``buf[:got]``, length prefix included, else None.

    Why: a direct connection's read usually holds exactly one small pull; one ``struct`` call over the
    prefix and header reads it, where :func:`~fleet.ps.protocol.unix.parse` then :func:`plain_pull` cut
    frames out first. It accepts exactly the messages those two accept (a prefix of the frames a pull
    has, the bytes that follow being the whole message); anything else returns None for them to read.
    """
    if got == _DENSE.size:
        (count, hsize, bsize, magic, version, op, status, ntensors, table, peer, rid, step, arg, lr,
         timeout_ms) = _DENSE.unpack_from(buf, 0)  # fmt: skip
        if count != 2 or hsize != HEADER.size or bsize or op != _PULL_DENSE or ntensors:
            return None
        tensors = []
    elif got >= _SPARSE.size:
        (count, hsize, bsize, nbytes, magic, version, op, status, ntensors, table, peer, rid, step, arg, lr,
         timeout_ms, code, ndim, n, *rest) = _SPARSE.unpack_from(buf, 0)  # fmt: skip
        if count != 3 or hsize != _ONE_TENSOR or bsize or op != _PULL_SPARSE or ntensors != 1:
            return None
        if got != _SPARSE.size + nbytes or code != _INT64 or ndim != 1 or any(rest) or n < 0 or nbytes != 8 * n:
            return None
        if nbytes > max_bytes or nbytes > FRAME_BYTES:
            return None
        ids = (
            torch.frombuffer(bytearray(buf[_SPARSE.size : got]), dtype=torch.int64)
            if n
            else torch.empty(0, dtype=torch.int64)
        )
        tensors = [ids]
    else:
        return None
    if magic != MAGIC or version != PROTOCOL_VERSION or status != _REQUEST:
        return None
    return Message(op, table, peer, rid, step, arg, lr, timeout_ms, status, tensors, b"")
