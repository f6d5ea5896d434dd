"""Parameter-server failures: a dead worker is named, never a hang; with restarts it rejoins."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dist_harness import clean_env, fleetrun_command, free_port

pytestmark = pytest.mark.multiprocess  # every test here starts processes

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ps_crash_train.py"


@pytest.mark.timeout(120)
def test_a_restarted_worker_rejoins_the_running_sync_job(tmp_path):
    strategy = tmp_path / "sync.toml"
    strategy.write_text('mode = "ps"\nupdate = "sync"\ntimeout_s = 30\n')
    options = ("--servers", "1", "--workers", "2", "--max-restarts", "1", "--strategy", str(strategy))
    command = fleetrun_command(*options, "--log-dir", str(tmp_path / "logs"), script=SCRIPT, args=("40", "8", "1"))
    done = subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=110)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "worker 1 joined (restart 1)" in output and "[worker 1] worker 1 done" in output, output
    assert "[worker 0] worker 0 done" in output


@pytest.mark.slow  # tens of seconds: the slow set (docs/development.md) keeps the README's suite under 10 minutes
@pytest.mark.timeout(120)
def test_a_dead_worker_is_named_and_the_server_ends_without_a_launcher(tmp_path):
    """Hand-started processes (no fleetrun to stop the job): nobody may hang."""
    # The server names a silent worker after max(3, timeout_s) s (fleet.ps.server.loop), and this test
    # waits that out twice (the victim, then the survivor it failed): 3, the floor, keeps the wait short.
    timeout_s = 3
    common = {
        "FLEET_SECRET": secrets.token_hex(16),
        "FLEET_SERVER_NUM": "1",
        "FLEET_SERVER_ENDPOINTS": f"127.0.0.1:{free_port()}",
        "FLEET_WORKER_NUM": "2",
        "FLEET_STRATEGY": json.dumps({"mode": "ps", "update": "sync", "timeout_s": timeout_s}),
    }
    roles = [{"FLEET_ROLE": "server", "FLEET_SERVER_INDEX": "0"}] + [
        {"FLEET_ROLE": "worker", "FLEET_WORKER_INDEX": str(w)} for w in range(2)
    ]
    started = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), "200", "5", "1"],
            env=clean_env(**common, **role),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for role in roles
    ]
    outputs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=46)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        outputs.append(out)
    elapsed = time.monotonic() - started
    server, survivor, victim = procs
    assert victim.returncode == 9
    assert survivor.returncode != 0 and "worker" in outputs[1] and "[1]" in outputs[1], outputs[1][-2000:]
    assert server.returncode == 1 and "worker 1 died or hung" in outputs[0], outputs[0][-2000:]
    assert elapsed < 42  # two detection periods and three interpreter starts, with room for a loaded machine


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["distributed_model", "--no-distributed-model"])
def test_workers_with_different_models_are_named_at_distributed_optimizer(tmp_path, how):
    strategy = tmp_path / "sync.toml"
    strategy.write_text('mode = "ps"\nupdate = "sync"\ntimeout_s = 20\n')
    script = Path(__file__).resolve().parents[1] / "scripts" / "ps_mismatch.py"
    options = ("--servers", "1", "--workers", "2", "--strategy", str(strategy), "--log-dir", str(tmp_path / "logs"))
    args = (how,) if how.startswith("--") else ()
    command = fleetrun_command(*options, script=script, args=args)
    done = subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=80)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "ModelMismatchError" in output and "'1.weight' has shape [3, 8] on worker 1 but [2, 8]" in output, output
    assert "Traceback" not in output
