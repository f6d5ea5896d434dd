"""Damaged slot files: bounded memory, and an error naming the file, never a signal (issue 26, findings 3 and 4)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from fleet.data.slot_format import MAX_LINE_BYTES, SlotLayout, read_chunks, write_text

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "slot_fuzz.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _samples(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 2**62, (n, 26), dtype=np.int64)
    return ids, rng.standard_normal((n, 13)).astype(np.float32), (rng.random(n) > 0.5).astype(np.float32)


@pytest.mark.parametrize("seed", [0, 1])
def test_fuzzed_slot_files_stay_within_an_address_space_limit_and_fail_naming_the_file(tmp_path, seed):
    """Random truncation, random bytes, long ids, long lines, a binary file cut while read (a memory map died of
    SIGBUS there; a child, so that a signal fails this test, not pytest): in a child under
    RLIMIT_AS (its address space after imports + 512 MiB), each read ends in samples or a ValueError naming
    the file; peak RSS grows by less than 64 MiB for 1 MiB chunks."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, SCRIPT, str(tmp_path), str(seed)], capture_output=True, text=True, timeout=100, env=env
    )
    assert done.returncode == 0, f"rc {done.returncode} (negative: killed by that signal)\n{done.stderr[-3000:]}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["cases"] >= 50
    assert result["rss_growth"] < 64 << 20, result


def test_a_512_digit_id_is_an_error_naming_file_line_and_int64(tmp_path):
    path = tmp_path / "data.txt"
    write_text(path, *_samples(300))
    lines = path.read_bytes().split(b"\n")
    tokens = lines[122].split(b" ")
    tokens[14 + 2 * 3 + 1] = b"9" * 512  # sparse slot 4's id
    lines[122] = b" ".join(tokens)
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(ValueError) as err:
        list(read_chunks(str(path), SlotLayout(), chunk_bytes=16 << 10))
    message = str(err.value)
    assert f"{path}, line 123: sparse slot 4: an id of 512 digits" in message
    assert "64 bits" in message and "int64" in message


def test_a_line_over_the_limit_is_an_error_naming_file_line_and_limit(tmp_path):
    path = tmp_path / "data.txt"
    write_text(path, *_samples(50))
    with open(path, "ab") as f:
        f.write(b"1 " * (MAX_LINE_BYTES // 2 + 10))  # line 51: no newline for more than the limit
    with pytest.raises(ValueError, match=rf"{path}, line 51: longer than {MAX_LINE_BYTES} bytes"):
        list(read_chunks(str(path), SlotLayout(), chunk_bytes=64 << 10))


def test_binary_chunks_are_copies_out_of_the_reused_read_buffer(tmp_path):
    """Records are read into one reused buffer: every chunk handed out, down to one record, is its own copy."""
    from fleet.data.slot_format import write_binary

    ids, dense, label = _samples(7)
    write_binary(tmp_path / "d.bin", ids, dense, label)
    for chunk_bytes in (1, 3 * SlotLayout().record.itemsize):
        chunks = list(read_chunks(str(tmp_path / "d.bin"), SlotLayout(), chunk_bytes))
        assert np.array_equal(np.concatenate([c[0] for c in chunks]), ids)
        assert np.array_equal(np.concatenate([c[1] for c in chunks]), dense)
        assert np.array_equal(np.concatenate([c[2] for c in chunks]), label)
