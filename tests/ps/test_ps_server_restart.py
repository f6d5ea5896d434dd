"""PS mode with --max-restarts: a dead server comes back from its last checkpoint and the workers reconnect."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dist_harness import clean_env
from fleet.ps.server import shard_io

pytestmark = pytest.mark.multiprocess  # every test here starts processes

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ps_server_crash_train.py"


def _run(tmp_path: Path, update: str, restarts: int) -> subprocess.CompletedProcess:
    strategy = tmp_path / f"{update}.toml"
    extra = "k_steps = 3\n" if update == "geo" else ""
    strategy.write_text(f'mode = "ps"\nupdate = "{update}"\ntimeout_s = 20\n{extra}')
    command = [
        sys.executable,
        "-m",
        "fleet.launch",
        "--servers",
        "2",
        "--workers",
        "2",
        "--strategy",
        str(strategy),
        "--log-dir",
        str(tmp_path / "logs"),
    ]
    if restarts:
        command += ["--max-restarts", str(restarts)]
    command += [str(SCRIPT), "50", "10", "25", str(tmp_path / "crash.flag"), str(tmp_path / "ckpt")]
    return subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=100, cwd=tmp_path)


def test_the_checkpoint_record_is_atomic_and_names_a_saved_directory(tmp_path):
    assert shard_io.last_checkpoint(str(tmp_path), 1) is None
    ckpt = tmp_path / "ckpt"
    shard_io.record_checkpoint(str(tmp_path / "logs"), 1, str(ckpt))
    assert shard_io.last_checkpoint(str(tmp_path / "logs"), 1) is None  # no shards there (yet)
    os.makedirs(shard_io.shard_dir(str(ckpt), 1))
    assert shard_io.last_checkpoint(str(tmp_path / "logs"), 1) == str(ckpt)
    assert [p.name for p in (tmp_path / "logs").iterdir()] == ["ps-server-1.checkpoint"]  # no temporary left


@pytest.mark.slow  # kills and restarts whole jobs, tens of seconds: run by .ci/run after the main suite
@pytest.mark.timeout(120)
@pytest.mark.parametrize("update", ["async", "geo", "sync"])
def test_a_restarted_server_resumes_from_its_checkpoint_and_workers_reconnect(tmp_path, update):
    done = _run(tmp_path, update, restarts=1)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "server 1 crashing" in output
    assert re.search(r"parameter server 1 restarted from the checkpoint in .*ckpt", output), output[-4000:]
    # async/geo workers resynchronise when a request of theirs was lost with the server ("is back;
    # resynchronised"); one with nothing in flight never notices: ZeroMQ delivers its next request to the
    # restarted server. Either way the job must finish and learn.
    if update == "sync":  # every worker and server roll back to the last checkpoint together
        assert output.count("every server rolled back to") == 2, output[-4000:]
    for worker in (0, 1):
        found = re.search(rf"worker {worker} done: loss ([\d.]+) -> ([\d.]+)", output)
        assert found, output[-4000:]
        first, last = map(float, found.groups())
        assert last < first / 2, (first, last)


@pytest.mark.timeout(120)
def test_without_restarts_a_dead_server_fails_the_job_naming_it(tmp_path):
    done = _run(tmp_path, "async", restarts=0)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "server 1 failed" in output, output[-4000:]
    assert "restarted from the checkpoint" not in output
