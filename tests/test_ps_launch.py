"""Launch paths of a parameter-server job: Paddle-style variables by hand, torchrun, fleetrun's default mode."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys

import pytest

from dist_harness import clean_env as launch_env
from dist_harness import fleetrun_command, free_port

pytestmark = pytest.mark.multiprocess  # every test here starts processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "ps_train.py")


def clean_env(**extra: str) -> dict[str, str]:
    return launch_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)


def results(output: str) -> list[dict]:
    """The workers' ``RESULT {json}`` lines (after a launcher's prefix, if any), by worker index."""
    found = [json.loads(line.split("RESULT ", 1)[1]) for line in output.splitlines() if "RESULT {" in line]
    return sorted(found, key=lambda r: r["worker"])


def communicate(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    out = []
    try:
        for proc in procs:
            text, _ = proc.communicate(timeout=timeout)
            out.append((proc.returncode, text))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return out


@pytest.mark.timeout(90)
def test_paddle_style_environment_started_by_hand() -> None:
    ports = [free_port(), free_port()]
    endpoints = ",".join(f"127.0.0.1:{p}" for p in ports)
    common = {
        "PADDLE_PSERVERS_IP_PORT_LIST": endpoints,
        "PADDLE_TRAINERS_NUM": "2",
        "FLEET_SECRET": secrets.token_hex(16),
        "FLEET_STRATEGY": json.dumps({"mode": "ps", "update": "sync", "timeout_s": 30}),
    }
    envs = [clean_env(**common, TRAINING_ROLE="PSERVER", POD_IP="127.0.0.1", PADDLE_PORT=str(p)) for p in ports]
    envs += [clean_env(**common, TRAINING_ROLE="TRAINER", PADDLE_TRAINER_ID=str(r)) for r in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, SCRIPT, "4"], env=e, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for e in envs
    ]
    done = communicate(procs, timeout=75)
    for rank, (rc, text) in enumerate(done):
        assert rc == 0, f"process {rank} exited {rc}:\n{text[-3000:]}"
    assert not any("RESULT" in text for _, text in done[:2]), "a server got past fleet.init()"
    found = results("".join(text for _, text in done[2:]))
    assert [r["worker"] for r in found] == [0, 1]
    for r in found:
        assert (r["workers"], r["servers"], r["update"]) == (2, 2, "sync"), r
        assert r["endpoints"] == endpoints.split(","), r
    # sync: every worker pulls the same values each step, so both trained the same shared model
    assert all(len(r["losses"]) == 4 for r in found)


@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not installed")
def test_torchrun_first_rank_serves_and_endpoints_come_through_the_store() -> None:
    env = clean_env(FLEET_STRATEGY=json.dumps({"mode": "ps", "update": "sync", "servers": 1, "timeout_s": 30}))
    cmd = [
        "torchrun",
        "--nproc_per_node",
        "3",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        SCRIPT,
        "4",
    ]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = results(done.stdout)
    assert [r["worker"] for r in found] == [0, 1], done.stdout[-3000:]
    for r in found:
        assert (r["workers"], r["servers"], r["update"]) == (2, 1, "sync"), r
        assert len(r["endpoints"]) == 1 and r["endpoints"][0].startswith("127.0.0.1:"), r
    assert found[0]["endpoints"] == found[1]["endpoints"]


@pytest.mark.timeout(120)
def test_fleetrun_with_servers_and_no_strategy_runs_the_default_ps_update(tmp_path) -> None:
    from fleet.api import DEFAULT_PS_UPDATE

    cmd = fleetrun_command(
        "--servers", "1", "--workers", "2", "--log-dir", str(tmp_path / "logs"), script=SCRIPT, args=("6",)
    )
    done = subprocess.run(cmd, env=clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = results(done.stdout)
    assert [r["worker"] for r in found] == [0, 1], done.stdout[-3000:]
    for r in found:
        assert (r["mode"], r["update"], r["servers"]) == ("ps", DEFAULT_PS_UPDATE, 1), r


@pytest.mark.timeout(120)
def test_a_worker_whose_script_just_ends_finishes_the_job_cleanly(tmp_path) -> None:
    """No fleet.stop_worker(): the worker stops at interpreter exit, the servers exit 0, the job succeeds."""
    tiny = os.path.join(ROOT, "tests", "scripts", "tiny_ps_train.py")
    strategy = tmp_path / "sync.toml"
    strategy.write_text('mode = "ps"\nupdate = "sync"\n')
    cmd = fleetrun_command(
        "--servers", "1", "--workers", "2", "--strategy", str(strategy), "--log-dir", str(tmp_path / "logs"),
        script=tiny, args=("--no-stop",),
    )  # fmt: skip
    done = subprocess.run(cmd, env=clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=100)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "job succeeded" in output and "died or hung" not in output, output[-3000:]
    checksums = {line.rsplit(" ", 1)[-1] for line in done.stdout.splitlines() if "of 2 checksum" in line}
    assert len(checksums) == 1  # both workers trained the same (sync) parameters to the end
    report = json.loads((tmp_path / "logs" / "report.json").read_text())
    assert report, "the job wrote its timing report"
