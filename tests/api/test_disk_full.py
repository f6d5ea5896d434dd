"""A full disk is said as such, and never tears a checkpoint.

Each test mounts a 1 MiB tmpfs and fills it (we need root for that; without it the tests
are skipped, saying so): ``save_checkpoint``, ``save_persistables`` and fleetrun's log
directory must name the disk and the path, leave no temporary file, and keep the previous
checkpoint loadable.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_harness import clean_env, fleetrun_command
from ps_jobs import _ps_worker, one_step, run_job, snapshot

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def disk(tmp_path: Path):
    """A 1 MiB filesystem of its own (a tmpfs), unmounted afterwards."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill up here ({done.stderr.strip() or done.returncode})")
    try:
        yield mount
    finally:
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def fill(path: Path | str, leave: int = 0) -> Path:
    """Take all but ``leave`` bytes of the filesystem of ``path``."""
    filler = Path(path, "filler")
    free = shutil.disk_usage(path).free
    with open(filler, "wb") as handle:
        try:
            handle.write(b"\0" * max(0, free - leave))
            handle.flush()
        except OSError:
            pass
    return filler


def leftovers(path: Path | str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, files in os.walk(path) for f in files)


def test_save_checkpoint_on_a_full_disk_says_so_and_keeps_the_previous_one(disk: Path) -> None:
    import fleet
    import fleet.api
    from fleet.errors import DiskFullError

    fleet.api._reset_for_tests()
    try:
        fleet.init()
        model = torch.nn.Linear(4, 2)
        opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        ckpt = disk / "ckpt"
        fleet.save_checkpoint(str(ckpt), model, opt, 1)
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        before = leftovers(ckpt)
        with torch.no_grad():
            model.weight.add_(1.0)
        big = torch.nn.Linear(512, 512)  # 1 MiB of parameters: more than the disk has
        fill(disk, leave=64 << 10)
        with pytest.raises(DiskFullError, match="No space left on device") as caught:
            fleet.save_checkpoint(str(ckpt), big, torch.optim.SGD(big.parameters(), lr=0.1), 2)
        assert str(ckpt / "step-000000002") in str(caught.value), caught.value
        assert isinstance(caught.value, OSError) and caught.value.errno == 28
        assert leftovers(ckpt) == before, "a temporary file or a torn part was left behind"
        assert fleet.load_checkpoint(str(ckpt), model, opt).step == 1
        assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    finally:
        fleet.api._reset_for_tests()


def _saves_on_a_full_disk(rank: int, disk: str) -> dict:
    """Save, train, fill the disk, fail to save a delta, load the save before, save and load again."""
    import fleet
    import fleet.api
    from fleet.errors import DiskFullError

    started = _ps_worker("sgd")
    if started is None:
        return {"served": 0}
    model, opt = started
    ckpt = os.path.join(disk, "ckpt")
    out: dict = {}
    for step in range(2):
        one_step("sgd", model, opt, step, 0)
    fleet.save_persistables(ckpt)
    out["saved"] = snapshot(model)
    for step in range(2, 4):
        one_step("sgd", model, opt, step, 0)
    filler = fill(disk, leave=4096)  # room for about one of the second save's files
    try:
        fleet.save_persistables(ckpt, "delta")
    except DiskFullError as error:
        out["error"] = str(error)
    out["left"] = leftovers(ckpt)
    filler.unlink()
    fleet.load_persistables(ckpt)
    out["loaded"] = snapshot(model)
    one_step("sgd", model, opt, 4, 0)
    fleet.save_persistables(ckpt, "delta")  # after a failed save, written as a base
    out["trained"] = snapshot(model)
    one_step("sgd", model, opt, 5, 0)
    fleet.load_persistables(ckpt)
    out["reloaded"] = snapshot(model)
    out["final"] = leftovers(ckpt)
    fleet.stop_worker()
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_save_persistables_on_a_full_disk_leaves_the_previous_save_whole(disk: Path) -> None:
    (out,) = run_job(_saves_on_a_full_disk, 2, 1, {"update": "sync"}, str(disk))
    assert "No space left on device" in out.get("error", ""), out.get("error")
    assert str(disk / "ckpt") in out["error"]
    first = sorted(f for f in out["left"] if f.startswith("save-000001/"))
    assert out["left"] == ["latest", *first], out["left"]  # nothing of the failed save, no temporary file
    assert {"save-000001/worker-0.pt", "save-000001/ps-server-1/table-0.pt"} <= set(first)
    for name, want in out["saved"].items():
        assert torch.equal(out["loaded"][name], want), name
        assert torch.equal(out["reloaded"][name], out["trained"][name]), name
    assert not any(torch.equal(out["trained"][n], out["saved"][n]) for n in ("rows", "2.weight"))
    assert "save-000002/worker-0.pt" in out["final"] and "save-000001/worker-0.pt" in out["final"]


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_fleetrun_says_which_logs_a_full_log_directory_lost(disk: Path) -> None:
    logs = disk / "logs"
    logs.mkdir()
    fill(disk)
    cmd = fleetrun_command("--workers", "1", "--log-dir", str(logs), script=str(ROOT / "tests/scripts/tiny_train.py"))
    done = subprocess.run(
        cmd, env=clean_env(NO_COLOR="1", COLUMNS="200"), cwd=ROOT, capture_output=True, text=True, timeout=80
    )
    output = done.stdout + done.stderr
    assert "worker 0 of 1 checksum" in output, output[-3000:]  # the job's output still reached the console
    assert done.returncode == 0, output[-3000:]  # it trained: a lost log is no reason to rerun it
    said = output[output.index("could not write everything") :]
    assert str(logs) in said and "No space left on device" in said, said
    assert f"lines of {logs / 'worker.0.log'}" in said and "report.json" in said, said
    assert sys.executable  # (the command ran with this interpreter)
