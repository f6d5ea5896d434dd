"""save_checkpoint / load_checkpoint under damage (issue 26, finding 5): a damaged checkpoint is an error naming
the file, never a fresh start; load_checkpoint(missing_ok=...) says what it does when nothing was saved; a save or
load interrupted at any file leaves the previous checkpoint loadable and the model as it was (one process)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import fleet
import fleet.api
from fleet.errors import FleetError
from fleet.storage import atomic, checksums
from fleet.storage.layout import LATEST, STEPS, Layout
from one_process_job import same, snapshot, step


def test_a_damaged_checkpoint_is_an_error_naming_the_file_never_a_fresh_start(tmp_path: Path, trained, capsys) -> None:
    """Finding 5: an empty `latest`, a step without meta.pt and a `latest` that is a folder gave FileNotFoundError,
    KeyError 'workers' and None (a silent fresh start)."""
    model, opt = trained
    ckpt = tmp_path / "ckpt"
    assert fleet.load_checkpoint(str(ckpt), model, opt) is None  # nothing saved yet: said, not silent
    assert "starting fresh" in capsys.readouterr().err
    with pytest.raises(FleetError, match="no checkpoint to load"):
        fleet.load_checkpoint(str(ckpt), model, opt, missing_ok=False)
    fleet.save_checkpoint(str(ckpt), model, opt, 1)
    step(model, opt)
    before = snapshot(model, opt)
    save = ckpt / "step-000000001"
    pointer = ckpt / LATEST

    def refused(match: str, named: Path) -> None:
        for missing_ok in (True, False):  # missing_ok is about nothing saved, never about damage
            with pytest.raises(FleetError, match=match) as caught:
                fleet.load_checkpoint(str(ckpt), model, opt, missing_ok=missing_ok)
            assert str(named) in str(caught.value), caught.value
            assert same(snapshot(model, opt), before)

    pointer.write_text("")
    refused("it is empty", pointer)
    pointer.unlink()
    pointer.mkdir()
    refused("not a file naming a save", pointer)
    pointer.rmdir()
    refused("the pointer was removed", pointer)  # a complete save without its pointer: not "nothing saved"
    pointer.write_text("step-000000001")
    for name, damage, match in [
        ("state.pt", "flip", "does not match its checksum"),
        ("worker-0.pt", "truncate", "truncated or changed since"),
        ("meta.pt", "remove", "meta.pt is missing"),
    ]:
        path = save / name
        data = path.read_bytes()
        if damage == "flip":
            path.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
        elif damage == "truncate":
            path.write_bytes(data[:-1])
        else:
            path.unlink()
        refused(match, path)
        path.write_bytes(data)
    os.unlink(save / checksums.CHECKSUMS)  # a save from before checksums: still loads, still checked for meta.pt
    (save / "meta.pt").unlink()
    refused("meta.pt is missing", save / "meta.pt")


class _Fail(Exception):
    pass


@contextmanager
def fail_after(module: object, name: str, k: int) -> Iterator[list[int]]:
    """``module.name`` raises on its call number ``k + 1``; the number of calls made."""
    real, calls, lock = getattr(module, name), [0], threading.Lock()

    def wrapped(*args, **kwargs):
        with lock:
            calls[0] += 1
            if calls[0] > k:
                raise _Fail(f"injected after {k} files")
        return real(*args, **kwargs)

    setattr(module, name, wrapped)
    try:
        yield calls
    finally:
        setattr(module, name, real)


def test_a_checkpoint_interrupted_at_any_file_leaves_the_previous_one_and_the_model(tmp_path: Path, trained) -> None:
    """Fault injection: an exception after k files written (every k), then after k files read (every k)."""
    model, opt = trained
    ckpt = str(tmp_path / "ckpt")
    fleet.save_checkpoint(ckpt, model, opt, 1)
    saved = snapshot(model, opt)
    step(model, opt)
    with fail_after(atomic, "write_atomic", 1 << 30) as calls:
        fleet.save_checkpoint(str(tmp_path / "count"), model, opt, 2)
    writes = calls[0]
    assert writes >= 5  # worker-0.pt, state.pt, meta.pt, checksums.json, latest
    for k in range(writes):
        with fail_after(atomic, "write_atomic", k), pytest.raises(_Fail):
            fleet.save_checkpoint(ckpt, model, opt, 2)
        assert Layout(ckpt, STEPS).resolve().number == 1, k
        assert not [p for p in Path(ckpt).rglob("*.tmp-*")], k
    trained_state = snapshot(model, opt)
    with fail_after(checksums, "read_verified", 1 << 30) as calls:
        assert fleet.load_checkpoint(ckpt, model, opt).step == 1
    reads = calls[0]
    assert reads >= 4 and same(snapshot(model, opt), saved)  # latest, meta.pt, worker-0.pt, state.pt
    step(model, opt)
    trained_state = snapshot(model, opt)
    for k in range(reads):
        with fail_after(checksums, "read_verified", k), pytest.raises(_Fail):
            fleet.load_checkpoint(ckpt, model, opt)
        assert same(snapshot(model, opt), trained_state), k
    assert fleet.load_checkpoint(ckpt, model, opt).step == 1
    assert same(snapshot(model, opt), saved)
