"""Launch paths of a parameter-server job: Paddle-style variables by hand, torchrun, fleetrun's default mode."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time

import pytest

from dist_harness import clean_env as launch_env
from dist_harness import fleetrun_command, free_port

pytestmark = pytest.mark.multiprocess  # every test here starts processes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


@pytest.mark.slow  # tens of seconds: the slow set (docs/development.md) keeps the README's suite under 10 minutes
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
def test_torchrun_first_rank_serves_and_endpoints_come_through_the_store(tmp_path) -> None:
    """Also: nothing in torchrun's store (which anyone reaching its port reads) logs in to the server."""
    port = free_port()
    hold, private = tmp_path / "release", tmp_path / "run"
    private.mkdir(mode=0o700)
    env = clean_env(
        FLEET_STRATEGY=json.dumps({"mode": "ps", "update": "sync", "servers": 1, "timeout_s": 30}),
        HOLD_UNTIL_FILE=str(hold),
        XDG_RUNTIME_DIR=str(private),  # where rank 0 hands the secret over
    )
    cmd = ["torchrun", "--nproc_per_node", "3", "--master_addr", "127.0.0.1", "--master_port", str(port), SCRIPT, "4"]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        values, endpoint = outsider_reads_the_store(port, timeout=60)
        candidates = passwords_in(values)
        logged_in = [c for c in candidates if not refused(endpoint, c)]  # while the server serves
        hold.touch()
        stdout, stderr = proc.communicate(timeout=90)
    finally:
        hold.touch()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    found = results(stdout)
    assert [r["worker"] for r in found] == [0, 1], stdout[-3000:]
    for r in found:
        assert (r["workers"], r["servers"], r["update"]) == (2, 1, "sync"), r
        assert len(r["endpoints"]) == 1 and r["endpoints"][0].startswith("127.0.0.1:"), r
    assert found[0]["endpoints"] == found[1]["endpoints"] == [endpoint]
    assert len(values) > 5 and candidates
    assert not logged_in, f"values read from torchrun's store logged in to the server: {logged_in}"
    assert not list((private / "fleet" / "secrets").iterdir()), "the handed-over secret file was not deleted"


def outsider_reads_the_store(port: int, timeout: float) -> tuple[dict[str, bytes], str]:
    """Every key and value of the store at ``port``, once the server published its endpoint; and that endpoint."""
    from datetime import timedelta

    import torch.distributed as dist

    from fleet.runtime.signed_store import TAG_BYTES

    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=timeout))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        keys = [k for k in store.list_keys() if k.endswith("/ps/endpoint/0")]
        if keys:
            values = {k: bytes(store.get(k)) for k in store.list_keys()}
            return values, values[keys[0]][:-TAG_BYTES].decode()
        time.sleep(0.05)
    raise AssertionError("the server never published its endpoint")


def passwords_in(values: dict[str, bytes]) -> set[bytes]:
    """Whatever in the values could be a password: each whole, without a MAC, each part, hex-decoded."""
    from fleet.runtime.signed_store import TAG_BYTES

    found: set[bytes] = set()
    for value in values.values():
        pieces = {value, value[:-TAG_BYTES]}
        for text in (value.decode("latin-1"), value[:-TAG_BYTES].decode("latin-1")):
            pieces.update(part.encode("latin-1") for part in re.split(r"[:/,\s]", text) if part)
        for piece in list(pieces):
            try:
                pieces.add(bytes.fromhex(piece.decode("latin-1")))
            except ValueError:
                pass
        found.update(p for p in pieces if 1 <= len(p) <= 255)
    return found


def refused(endpoint: str, password: bytes) -> bool:
    """Whether the server explicitly refuses ``password`` at the handshake (a timeout is no refusal)."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.plain_username, sock.plain_password = b"outsider", password
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sock.connect(f"tcp://{endpoint}")
    try:
        while monitor.poll(10_000):
            event = recv_monitor_message(monitor)["event"]
            if event in (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_SUCCEEDED):
                return event == zmq.EVENT_HANDSHAKE_FAILED_AUTH
        return False
    finally:
        sock.disable_monitor()
        monitor.close()
        sock.close()


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
