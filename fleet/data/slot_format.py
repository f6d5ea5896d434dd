"""The two file formats ``fleet.SlotDataset`` reads: Paddle's MultiSlot text and a binary record file.

**Text** (what Paddle's ``MultiSlotDataGenerator`` writes, one sample per line): for every
slot its value count, then the values, separated by spaces or tabs. The slots come in the
order of Paddle's CTR (Wide&Deep) example: the dense slot, the sparse slots, the label::

    13 0.05 0.0066 ... 0.4   1 371155 1 846239 ... 1 27346   1 0
    ^ dense: count and values   ^ 26 sparse slots: "1 <id>"   ^ label: "1 <value>"

Every sparse slot holds exactly one id (Paddle's example hashes each categorical feature
to one id); ids are unsigned 64-bit integers (Paddle's feasigns), reinterpreted as int64
(2**64 - 1 becomes -1; a bijection, and ``fleet.nn.SparseEmbedding`` takes any int64).
Dense values and the label are decimal numbers (``-0.5``, ``3``, ``1.5e-05``, ``nan``).
``dense=0`` leaves the dense slot out. Every line is a sample: an empty line is an error.

**Binary** (``write_binary``): a 32-byte header (magic ``b"\\x93FLSLOTS"``, then
little-endian uint32 version, sparse slots, dense count, header size, 8 reserved bytes)
followed by packed little-endian records ``int64 ids[sparse] | float32 dense[dense] |
float32 label``. The record count follows from the file size; records are read in bounded
chunks with plain reads (no memory map: a file truncated while it is read would kill the
process with SIGBUS), and a file that shrinks or grows while it is read is an error naming it.
``convert`` turns a text file into a binary one.

Text is parsed a chunk (about 4 MB) at a time with numpy, with no per-line Python: token
bounds from one comparison over the bytes, ids and decimals from digit matrices; rare
tokens (exponents, nan) go through ``float``. A malformed line raises ``ValueError``
naming the file, the line number and what is wrong.

**Bounded memory.** Whatever the input, parsing a chunk needs a small multiple of the chunk:
fields are at most :data:`MAX_TOKEN_BYTES` long (ids at most 20 digits, since they must fit
64 bits), lines at most :data:`MAX_LINE_BYTES`, and the digit matrices are built for
:data:`_BLOCK_TOKENS` tokens at a time. A longer field or line is a ``ValueError`` naming the
file, the line and the limit, found before anything is allocated for it.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

import numpy as np

from fleet.storage.paths import is_url, store_for

MAGIC = b"\x93FLSLOTS"
VERSION = 1
HEADER = struct.Struct("<8sIIII8x")  # magic, version, sparse, dense, header size
DEFAULT_CHUNK_BYTES = 4 << 20
#: the longest field of a text line (a decimal such as -1.2345678901234567e-308 has 24 bytes)
MAX_TOKEN_BYTES = 64
#: the longest text line, newline excluded (a 26-slot CTR line has about 400 bytes)
MAX_LINE_BYTES = 1 << 20
MAX_ID_DIGITS = 20  # 2**64 - 1 has 20 digits
_BLOCK_TOKENS = 1 << 16  # tokens per digit matrix: at most 64 Ki x 20 bytes (x 8 as uint64)

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray]  # ids int64 [n, sparse], dense float32 [n, dense], label float32 [n]

_POW10_U = np.array([10**k if k < 20 else 0 for k in range(64)], dtype=np.uint64)
_POW10_F = 10.0 ** np.arange(23)
_MAX_ID = 2**64 - 1


@dataclass(frozen=True)
class SlotLayout:
    """What one sample holds: ``sparse`` slots of one id each, ``dense`` floats, one label."""

    sparse: int = 26
    dense: int = 13

    def __post_init__(self) -> None:
        if self.sparse < 0 or self.dense < 0:
            raise ValueError(f"sparse_slots({self.sparse}) and dense({self.dense}) must not be negative")

    @property
    def fields(self) -> int:
        """Tokens per text line."""
        return (1 + self.dense if self.dense else 0) + 2 * self.sparse + 2

    @property
    def record(self) -> np.dtype:
        return np.dtype([("ids", "<i8", (self.sparse,)), ("dense", "<f4", (self.dense,)), ("label", "<f4")])

    def describe(self) -> str:
        dense = f"a dense slot of {self.dense} values, " if self.dense else ""
        return f"{dense}{self.sparse} sparse slots of one id, a label slot"


# --- formats and counts ----------------------------------------------------------------


def _open(path: str, buffering: int = -1) -> IO[bytes]:
    """``path`` to read: a local file, or a URL through its store (``s3://bucket/part-00000``)."""
    if is_url(path):
        return store_for(path).open_read(path)
    return open(path, "rb", buffering=buffering)  # noqa: SIM115 - the caller closes it


def _size(path: str, handle: IO[bytes] | None = None) -> int:
    """The size of ``path`` now (of the open ``handle`` when it is a local file)."""
    if not is_url(path):
        return os.fstat(handle.fileno()).st_size if handle is not None else os.path.getsize(path)
    entry = store_for(path).entry(path, follow_links=True)
    if entry is None:
        raise FileNotFoundError(f"{path} does not exist")
    return entry.size


def is_binary(path: str) -> bool:
    with _open(path) as f:
        return f.read(len(MAGIC)) == MAGIC


def _binary_header(path: str, layout: SlotLayout) -> int:
    """Checks the header against ``layout``; returns the record count."""
    size = _size(path)
    with _open(path) as f:
        head = f.read(HEADER.size)
    if len(head) < HEADER.size:
        raise ValueError(f"{path}: a binary slot file's {HEADER.size}-byte header is cut short ({size} bytes).")
    _, version, sparse, dense, header = HEADER.unpack(head)
    if version != VERSION or header != HEADER.size:
        raise ValueError(
            f"{path}: binary slot file version {version} (header {header} bytes); this fleet reads {VERSION}."
        )
    if (sparse, dense) != (layout.sparse, layout.dense):
        raise ValueError(
            f"{path} holds {sparse} sparse slots and {dense} dense values per record; the dataset expects "
            f"sparse_slots={layout.sparse}, dense={layout.dense}."
        )
    records, rest = divmod(size - HEADER.size, layout.record.itemsize)
    if rest:
        raise ValueError(
            f"{path} is truncated: {rest} bytes after its last whole record ({layout.record.itemsize} bytes each)."
        )
    return records


def count_records(path: str, layout: SlotLayout) -> int:
    """Samples in ``path``: from the size of a binary file, from the line count of a text file."""
    if is_binary(path):
        return _binary_header(path, layout)
    lines, last = 0, b"\n"
    with _open(path) as f:
        while block := f.read(16 << 20):
            lines += block.count(b"\n")
            last = block[-1:]
    return lines + (last != b"\n")


# --- reading ------------------------------------------------------------------------


def read_chunks(path: str, layout: SlotLayout, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[Arrays]:
    """The samples of one file, text or binary, as arrays of up to about ``chunk_bytes``."""
    if is_binary(path):
        yield from _binary_chunks(path, layout, chunk_bytes)
    else:
        yield from _text_chunks(path, layout, chunk_bytes)


def _binary_chunks(path: str, layout: SlotLayout, chunk_bytes: int) -> Iterator[Arrays]:
    records = _binary_header(path, layout)
    if records == 0:
        return
    size = HEADER.size + records * layout.record.itemsize
    step = max(1, min(chunk_bytes // layout.record.itemsize, records))
    buffer = np.empty(step, dtype=layout.record)  # reused: its pages are faulted in once, not per chunk
    with _open(path, buffering=0) as f:
        f.seek(HEADER.size)
        for start in range(0, records, step):
            want = min(step, records - start)
            rows = buffer[:want]
            view, got = memoryview(rows).cast("B"), 0
            while got < len(view) and (part := f.readinto(view[got:])):  # a regular file rarely reads short
                got += part
            now = _size(path, f)
            if got != rows.nbytes or now != size:
                raise ValueError(
                    f"{path} changed while it was read: it had {size} bytes ({records} records) when reading began "
                    f"and has {now} now, at record {start + got // layout.record.itemsize}. "
                    "Do not rewrite a data file while a job reads it."
                )
            yield rows["ids"].copy(), rows["dense"].copy(), rows["label"].copy()  # out of the reused buffer


def _text_chunks(path: str, layout: SlotLayout, chunk_bytes: int) -> Iterator[Arrays]:
    line = 1  # number of the chunk's first line
    carry = b""
    with _open(path) as f:
        while True:
            block = f.read(chunk_bytes)
            data = carry + block
            if not block:  # end of file: the last line may lack its newline
                if data:
                    yield parse_text(data if data.endswith(b"\n") else data + b"\n", layout, path, line)
                return
            cut = data.rfind(b"\n") + 1
            if cut == 0:  # one line longer than a chunk: read on, up to the limit
                if len(data) > MAX_LINE_BYTES:
                    raise ValueError(
                        f"{path}, line {line}: longer than {MAX_LINE_BYTES} bytes without a newline, the limit for "
                        f"one line ({layout.describe()} takes a few hundred bytes)"
                    )
                carry = data
                continue
            carry = data[cut:]
            arrays = parse_text(data[:cut], layout, path, line)
            line += len(arrays[2])
            yield arrays


def parse_text(chunk: bytes, layout: SlotLayout, path: str = "<text>", first_line: int = 1) -> Arrays:
    """Parse whole lines (``chunk`` ends with a newline) of the MultiSlot text format."""
    buf = np.frombuffer(chunk, dtype=np.uint8)
    lines = chunk.count(b"\n")
    width = layout.fields
    solid = buf > 32  # not a space, tab, newline or other control byte
    flips = np.flatnonzero(solid[1:] != solid[:-1]) + 1
    if solid[0]:
        flips = np.concatenate(([0], flips))
    if len(buf) < 2**31:
        flips = flips.astype(np.int32)  # half the memory traffic of int64 positions
    starts, ends = flips[0::2], flips[1::2]
    if len(starts) != lines * width or int((ends - starts).max(initial=0)) > MAX_TOKEN_BYTES:
        _raise_first_error(chunk, layout, path, first_line)
    newlines = np.flatnonzero(buf == 10)
    if int(np.diff(newlines, prepend=-1).max()) > MAX_LINE_BYTES + 1:
        _raise_first_error(chunk, layout, path, first_line)
    # Line i holds exactly tokens [i*width, (i+1)*width): its last token ends before its newline
    # and the next line's first token starts after it.
    if not ((ends[width - 1 :: width] <= newlines).all() and (starts[width::width] > newlines[:-1]).all()):
        _raise_first_error(chunk, layout, path, first_line)
    starts, ends = starts.reshape(lines, width), ends.reshape(lines, width)

    def column(first: int, stop: int | None = None, step: int = 1) -> tuple[np.ndarray, np.ndarray]:
        cols = slice(first, stop if stop is not None else first + 1, step)
        return np.ascontiguousarray(starts[:, cols]), np.ascontiguousarray(ends[:, cols])

    ok = True
    at = 0
    if layout.dense:
        counts, good = _uints(buf, *column(0))
        ok &= bool(good.all() and (counts == layout.dense).all())
        dense, good = _floats(buf, *column(1, 1 + layout.dense))
        ok &= bool(good)
        at = 1 + layout.dense
    else:
        dense = np.zeros((lines, 0), dtype=np.float32)
    stop = at + 2 * layout.sparse
    count_starts, count_ends = column(at, stop, 2)
    ok &= bool(((count_ends - count_starts) == 1).all() and (buf[count_starts] == ord("1")).all())
    ids, good = _uints(buf, *column(at + 1, stop + 1, 2))
    ok &= bool(good.all())
    label_count = column(stop)
    ok &= bool(((label_count[1] - label_count[0]) == 1).all() and (buf[label_count[0]] == ord("1")).all())
    label, good = _floats(buf, *column(stop + 1))
    ok &= bool(good)
    if not ok:
        _raise_first_error(chunk, layout, path, first_line)
    return ids.view(np.int64).reshape(lines, layout.sparse), dense, label.reshape(lines)


def _digit_matrix(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, pad: int) -> np.ndarray:
    """The tokens' bytes right-aligned in a [tokens, widest] uint8 matrix, padded on the left with ``pad``."""
    width = int((ends - starts).max())
    at = ends[:, None] - np.arange(width, 0, -1, dtype=ends.dtype)
    outside = at < starts[:, None]
    if width > int(ends.min()):
        np.maximum(at, 0, out=at)
    chars = buf[at]
    chars[outside] = pad
    return chars


def _rows_all(matrix: np.ndarray) -> np.ndarray:
    """``matrix.all(1)``, with the common all-true case as one fast whole-array test."""
    return np.ones(len(matrix), dtype=bool) if matrix.all() else matrix.all(1)


def _place_sum(digits: np.ndarray) -> np.ndarray:
    """Each row of a right-aligned digit matrix read as one number: sum of digit * 10**place, exact, as uint64.

    Up to 15 columns through a float64 matrix-vector product (exact below 2**53, and fast);
    wider ones through uint64 arithmetic (exact below 2**64).
    """
    width = digits.shape[1]
    if width <= 15:
        return (digits @ _POW10_F[width - 1 :: -1]).astype(np.uint64)
    return (digits.astype(np.uint64) * _POW10_U[np.minimum(np.arange(width)[::-1], 63)]).sum(1, dtype=np.uint64)


def _uints(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unsigned decimal integers at [starts, ends): values (uint64) and which tokens were valid."""
    shape = starts.shape
    starts, ends = starts.ravel(), ends.ravel()
    values, ok = np.zeros(starts.size, dtype=np.uint64), np.ones(starts.size, dtype=bool)
    for lo in range(0, starts.size, _BLOCK_TOKENS):
        part = slice(lo, lo + _BLOCK_TOKENS)
        values[part], ok[part] = _uints_block(buf, starts[part], ends[part])
    return values.reshape(shape), ok.reshape(shape)


def _uints_block(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    lengths = ends - starts
    # A token of more than 20 digits is no id: its last 20 bytes keep the digit matrix narrow.
    digits = _digit_matrix(buf, np.maximum(starts, ends - MAX_ID_DIGITS), ends, pad=48) - np.uint8(48)
    ok = _rows_all(digits <= 9) & (lengths <= MAX_ID_DIGITS)
    values = _place_sum(digits)
    for i in np.flatnonzero((lengths == MAX_ID_DIGITS) & ok):  # 20 digits may exceed 2**64 - 1
        ok[i] = int(bytes(buf[starts[i] : ends[i]])) <= _MAX_ID
    return values, ok


def _floats(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, bool]:
    """Decimal numbers at [starts, ends) as float32; False when one is not a number.

    Plain decimals (``-12.50``) with up to 17 digits are read from a digit matrix: the
    mantissa as an exact integer, divided by a power of ten (one rounding, as ``float()``
    for up to 15 digits); anything else (exponents, nan, inf, longer mantissas) by ``float``.
    """
    shape = starts.shape
    starts, ends = starts.ravel(), ends.ravel()
    values = np.zeros(starts.size, dtype=np.float32)
    for lo in range(0, starts.size, _BLOCK_TOKENS):
        part = slice(lo, lo + _BLOCK_TOKENS)
        values[part], good = _floats_block(buf, starts[part], ends[part])
        if not good:
            return values.reshape(shape), False
    return values.reshape(shape), True


_PLAIN_BYTES = 19  # a plain decimal: sign, 17 figures, point


def _floats_block(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, bool]:
    given = starts
    long = (ends - starts) > _PLAIN_BYTES  # never plain: read by float() below, kept out of the digit matrix
    if long.any():
        starts = np.where(long, ends - 1, starts)
    lengths = ends - starts
    chars = _digit_matrix(buf, starts, ends, pad=48)
    width = chars.shape[1]
    first = buf[starts]
    signed = (first == 45) | (first == 43)
    chars[np.flatnonzero(signed), (width - lengths)[signed]] = 48  # the sign reads as a leading "0"
    dot = chars == 46
    dots = dot.sum(1)
    frac = np.where(dots > 0, width - 1 - dot.argmax(1), 0)  # digits after the point
    chars[dot] = 48
    digits = chars - np.uint8(48)
    figures = lengths - signed - (dots > 0)
    plain = _rows_all(digits <= 9) & (dots <= 1) & (figures >= 1) & (figures <= 17) & (frac < len(_POW10_F)) & ~long
    frac = np.where(plain, frac, 0)
    # With the point read as a 0 digit, the digits left of it stand one place too high:
    # whole = high * 10**(frac + 1) + low, and the mantissa is high * 10**frac + low.
    whole = _place_sum(digits)
    scale = _POW10_U[frac]
    low = whole % scale
    mantissa = np.where(dots > 0, (whole - low) // np.uint64(10) + low, whole)
    values = mantissa.astype(np.float64) / _POW10_F[frac]
    values[first == 45] *= -1
    for i in np.flatnonzero(~plain):
        try:
            values[i] = float(bytes(buf[given[i] : ends[i]]))
        except ValueError:
            return values.astype(np.float32), False
    return values.astype(np.float32), True


def _raise_first_error(chunk: bytes, layout: SlotLayout, path: str, first_line: int) -> None:
    """Find the first bad line of ``chunk`` (per line, in Python: only on the error path) and raise.

    Bounded like the fast path: a line is cut into at most ``fields + 1`` pieces, and its
    length and fields' lengths are checked before any is read.
    """
    start = 0
    for number, end in enumerate(np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10).tolist(), first_line):
        if end - start > MAX_LINE_BYTES:
            raise ValueError(
                f"{path}, line {number}: {end - start} bytes, longer than {MAX_LINE_BYTES} bytes, the limit for one "
                f"line ({layout.describe()} takes a few hundred bytes)"
            )
        line = chunk[start:end]
        start = end + 1
        tokens = line.split(None, layout.fields)
        total = _count_fields(line) if len(tokens) > layout.fields else len(tokens)
        problem = line_error(tokens[: layout.fields], layout, total)
        if problem:
            raise ValueError(f"{path}, line {number}: {problem}")
    raise ValueError(f"{path}, lines {first_line} and later: cannot be read as {layout.describe()}.")


def _count_fields(line: bytes) -> int:
    solid = np.frombuffer(line, dtype=np.uint8) > 32
    return int(solid[0]) + int(np.count_nonzero(solid[1:] & ~solid[:-1])) if len(solid) else 0


def _show(token: bytes) -> str:
    """A field for an error message, cut short when long."""
    text = token[:24].decode(errors="replace")
    return repr(text) + (f" ({len(token)} bytes)" if len(token) > 24 else "")


def line_error(tokens: list[bytes], layout: SlotLayout, total: int | None = None) -> str | None:
    """What is wrong with one text line split into tokens, or None.

    ``total``: how many fields the line has, when ``tokens`` holds only the first of them.
    """
    total = len(tokens) if total is None else total
    if not tokens:
        return "empty line (every line must be a sample)"
    at = 0
    slots = ([("dense", layout.dense, False)] if layout.dense else []) + [
        (f"sparse slot {k + 1}", 1, True) for k in range(layout.sparse)
    ]
    for name, count, is_id in [*slots, ("label", 1, False)]:
        if at + count >= len(tokens):
            where = "before" if at >= len(tokens) else "inside"
            return f"the line ends {where} the {name} ({len(tokens)} fields where {layout.fields} were expected)"
        if tokens[at] != str(count).encode():
            have = tokens[at]
            if is_id and have.isdigit() and len(have) <= MAX_ID_DIGITS and int(have) > 1:
                return (
                    f"{name} has {int(have)} ids; SlotDataset reads exactly one id per sparse slot "
                    "(hash a multi-valued feature into one id, or give it several slots)"
                )
            return f"the {name} count is {_show(have)}, expected {count}"
        for token in tokens[at + 1 : at + 1 + count]:
            if is_id and token.isdigit() and len(token) > MAX_ID_DIGITS:
                return (
                    f"{name}: an id of {len(token)} digits; ids must fit in 64 bits (unsigned, at most "
                    f"{MAX_ID_DIGITS} digits, up to {_MAX_ID}; fleet stores them as int64)"
                )
            if len(token) > MAX_TOKEN_BYTES:
                return f"{name}: a field of {len(token)} bytes, longer than {MAX_TOKEN_BYTES} bytes, the limit for one"
            text = token.decode(errors="replace")
            if is_id and not (text.isascii() and text.isdigit() and int(text) <= _MAX_ID):
                return f"{name}: {text!r} is not an id (an unsigned 64-bit integer: ids must fit int64)"
            if not is_id:
                try:
                    float(text)
                except ValueError:
                    return f"{name}: {text!r} is not a number"
        at += 1 + count
    if total != at:
        return f"{total} fields where {layout.fields} were expected ({layout.describe()})"
    return None


# --- writing ------------------------------------------------------------------------


def _as_arrays(ids, dense, label, layout: SlotLayout | None = None) -> tuple[Arrays, SlotLayout]:
    ids = np.asarray(ids, dtype=np.int64)
    label = np.asarray(label, dtype=np.float32).reshape(-1)
    dense = np.asarray(dense, dtype=np.float32).reshape(len(label), -1)
    if ids.ndim != 2 or len(ids) != len(label):
        raise ValueError(
            f"ids must be [samples, slots] with one row per label; got {tuple(ids.shape)} and {len(label)}"
        )
    return (ids, dense, label), SlotLayout(ids.shape[1], dense.shape[1])


def write_binary(path: str | os.PathLike, ids, dense, label) -> None:
    """Write samples (ids int64 [n, slots], dense float32 [n, d], label [n]) as a binary slot file."""
    (ids, dense, label), layout = _as_arrays(ids, dense, label)
    records = np.empty(len(label), dtype=layout.record)
    records["ids"], records["dense"], records["label"] = ids, dense, label
    with open(path, "wb") as f:
        f.write(HEADER.pack(MAGIC, VERSION, layout.sparse, layout.dense, HEADER.size))
        f.write(records.tobytes())


def write_text(path: str | os.PathLike, ids, dense, label) -> None:
    """Write samples in Paddle's MultiSlot text format; floats with 9 digits, so they read back exactly."""
    (ids, dense, label), layout = _as_arrays(ids, dense, label)
    dense_part = (f"{layout.dense} " + " ".join(["%.9g"] * layout.dense) + " ") if layout.dense else ""
    line = dense_part + " ".join(["1 %d"] * layout.sparse) + " 1 %.9g\n"
    unsigned = ids.view(np.uint64)
    with open(path, "w") as f:
        for k in range(0, len(label), 4096):
            rows = zip(
                dense[k : k + 4096].tolist(), unsigned[k : k + 4096].tolist(), label[k : k + 4096].tolist(), strict=True
            )
            f.write("".join(line % (*d, *i, y) for d, i, y in rows))


def convert(source: str | os.PathLike, target: str | os.PathLike, layout: SlotLayout) -> int:
    """Write text file ``source`` as binary file ``target``; returns the number of samples."""
    chunks = list(read_chunks(os.fspath(source), layout))
    ids, dense, label = (np.concatenate(parts) for parts in zip(*chunks, strict=True)) if chunks else _empty(layout)
    write_binary(target, ids.reshape(-1, layout.sparse), dense.reshape(-1, layout.dense), label)
    return len(label)


def _empty(layout: SlotLayout) -> Arrays:
    return np.zeros((0, layout.sparse), np.int64), np.zeros((0, layout.dense), np.float32), np.zeros(0, np.float32)


__all__ = [
    "MAGIC",
    "SlotLayout",
    "convert",
    "count_records",
    "is_binary",
    "line_error",
    "parse_text",
    "read_chunks",
    "write_binary",
    "write_text",
]
