"""Fuzz both slot formats under an address-space limit (run by tests/data/test_slot_fuzz.py).

Usage: ``python slot_fuzz.py DIR SEED``. Sets RLIMIT_AS to this process's address space after
its imports plus :data:`HEADROOM`, then reads damaged files: random truncation, random bytes,
long fields, long lines, a binary file truncated while it is read. Each read must end with
the file's samples or a ``ValueError`` naming the file; anything else (MemoryError, another
exception, a signal) fails. Prints one JSON line: the cases run and the peak RSS growth.
"""

from __future__ import annotations

import json
import os
import random
import resource
import sys

import numpy as np

from fleet.data.slot_format import (
    MAX_LINE_BYTES,
    MAX_TOKEN_BYTES,
    SlotLayout,
    read_chunks,
    write_binary,
    write_text,
)

HEADROOM = 512 << 20  # the old reader asked for 1.9 GiB for one 512-digit id in a 4 MiB file
CHUNK = 1 << 20
LAYOUT = SlotLayout(26, 13)


def vm_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def read_all(path: str) -> int:
    return sum(len(chunk[2]) for chunk in read_chunks(path, LAYOUT, CHUNK))


def expect_named_error_or_samples(path: str, case: str, must_fail: str | None = None) -> str:
    """Read ``path``: samples, or a ValueError naming it (and containing ``must_fail``, which then must happen)."""
    try:
        read_all(path)
    except ValueError as exc:
        message = str(exc)
        if path not in message:
            raise AssertionError(f"{case}: the error does not name {path}: {message}") from None
        if must_fail is not None and must_fail not in message:
            raise AssertionError(f"{case}: expected {must_fail!r} in {message!r}") from None
        return message
    if must_fail is not None:
        raise AssertionError(f"{case}: read without error, expected {must_fail!r}")
    return ""


def sample(rng: np.random.Generator, n: int):
    ids = rng.integers(0, 2**63 - 1, (n, LAYOUT.sparse), dtype=np.int64)
    return ids, rng.standard_normal((n, LAYOUT.dense)).astype(np.float32), (rng.random(n) > 0.5).astype(np.float32)


def main() -> None:
    directory, seed = sys.argv[1], int(sys.argv[2])
    rng = np.random.default_rng(seed)
    pick = random.Random(seed)
    text, binary = os.path.join(directory, "good.txt"), os.path.join(directory, "good.bin")
    write_text(text, *sample(rng, 12_000))  # about 4.5 MiB
    write_binary(binary, *sample(rng, 12_000))
    good_text, good_binary = open(text, "rb").read(), open(binary, "rb").read()
    lines = good_text.split(b"\n")[:-1]
    target = os.path.join(directory, "case")
    read_all(text)  # warm: numpy's and the reader's own allocations count as the baseline
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    limit = vm_bytes("VmSize") + HEADROOM
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    cases = 0

    def write(data: bytes) -> str:
        with open(target, "wb") as f:
            f.write(data)
        return target

    # Long fields: an id of 21, 512 and 100 000 digits, a 200-byte number, at a random line.
    for field, slot, needle in [
        (b"1" * 21, "id", "ids must fit in 64 bits"),
        (b"7" * 512, "id", "ids must fit in 64 bits"),
        (b"3" * 100_000, "id", "ids must fit in 64 bits"),
        (b"0." + b"5" * 200, "dense", f"limit of {MAX_TOKEN_BYTES}"),
    ]:
        at = pick.randrange(len(lines))
        tokens = lines[at].split(b" ")
        tokens[15 if slot == "id" else 1] = field
        bad = [*lines[:at], b" ".join(tokens), *lines[at + 1 :]]
        message = expect_named_error_or_samples(write(b"\n".join(bad) + b"\n"), f"long {slot}", f"line {at + 1}:")
        assert needle in message or "limit" in message, message
        cases += 1
    # A 1 MiB id is a line over the limit; so is a line of 2 MiB of spaces, or no newline at all.
    for tail in (b"9" * (1 << 20), b" " * (2 << 20)):
        at = pick.randrange(len(lines))
        bad = [*lines[:at], lines[at] + b" " + tail, *lines[at + 1 :]]
        message = expect_named_error_or_samples(write(b"\n".join(bad) + b"\n"), "long line", f"line {at + 1}:")
        assert str(MAX_LINE_BYTES) in message, message
        cases += 1
    expect_named_error_or_samples(write(b"1 " * (3 << 20)), "no newline", f"longer than {MAX_LINE_BYTES}")
    cases += 1
    # Random truncation and random bytes, both formats.
    for good in (good_text, good_binary):
        for _ in range(12):
            expect_named_error_or_samples(write(good[: pick.randrange(len(good) + 1)]), "truncated")
            data = bytearray(good)
            for _ in range(pick.choice((1, 10, 1000))):
                data[pick.randrange(len(data))] = pick.randrange(256)
            expect_named_error_or_samples(write(bytes(data)), "random bytes")
            cases += 2
        data = bytearray(good)
        at = pick.randrange(len(data) - 4096)
        data[at : at + 4096] = rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()
        expect_named_error_or_samples(write(bytes(data)), "random block")
        cases += 1
    # A binary file truncated while it is read: a memory map would die of SIGBUS here.
    for keep in (0, 32, 32 + 1000 * LAYOUT.record.itemsize + 7):
        path = write(good_binary)
        chunks = read_chunks(path, LAYOUT, 64 << 10)
        next(chunks)
        os.truncate(path, keep)
        try:
            for _ in chunks:
                pass
        except ValueError as exc:
            assert path in str(exc) and "changed while it was read" in str(exc), exc
        else:
            raise AssertionError(f"a binary file truncated to {keep} bytes while read gave no error")
        cases += 1
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"cases": cases, "rss_growth": peak - base_rss, "limit": limit}))


if __name__ == "__main__":
    main()
