"""What a kill -9 of a whole job can leave on a host (a shared-memory segment, an on-host secret file) carries
its creator in its name, and the next fleet.init() or fleetrun on the host removes it once the creator is gone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fleet.runtime import job_files

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and /dev/shm are Linux's")


def dead_owner() -> str:
    """The owner tag of a process that has ended."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    tag = job_files.owner_tag(child.pid)
    child.kill()
    child.wait()
    return tag


@pytest.mark.multiprocess  # starts a short-lived process to have a dead owner
def test_files_of_a_dead_owner_go_and_the_others_stay(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    secrets = tmp_path / "fleet" / "secrets"
    secrets.mkdir(parents=True)
    dead, alive = dead_owner(), job_files.owner_tag()
    assert not job_files.owner_alive(dead) and job_files.owner_alive(alive)
    assert not job_files.owner_alive(f"{os.getpid()}.1")  # the same pid, another start time: a reused pid
    token = "a" * 32
    left = secrets / f"{dead}-{token}.secret"
    kept = secrets / f"{alive}-{token}.secret"
    other = secrets / "notes.txt"  # not a fleet name: never touched
    shm_left = f"/dev/shm/fleet-0123456789abcdef-{dead}-{'b' * 32}-control"
    shm_kept = f"/dev/shm/fleet-0123456789abcdef-{alive}-{'b' * 32}-control"
    for path in (left, kept, other, shm_left, shm_kept):
        with open(path, "w") as f:
            f.write("x")
    try:
        # The sweep also takes whatever else this user left on the host (e.g. a killed test server's sockets
        # in /tmp): only this test's files are judged here.
        removed = set(job_files.remove_orphaned_files())
        assert {str(left), shm_left} <= removed and not removed & {str(kept), str(other), shm_kept}
        assert kept.exists() and other.exists() and os.path.exists(shm_kept)
        assert not left.exists() and not os.path.exists(shm_left)
    finally:
        for path in (shm_left, shm_kept):
            if os.path.exists(path):
                os.unlink(path)


def test_a_missing_folder_is_no_error(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "nowhere"))
    assert job_files.remove_orphaned(str(tmp_path / "nowhere")) == []


def test_a_parameter_servers_socket_nobody_listens_on_goes() -> None:
    import shutil
    import socket
    import tempfile
    from pathlib import Path

    tmp_path = Path(tempfile.mkdtemp(prefix="fo-", dir="/tmp"))  # short: a socket's path holds ~107 bytes
    try:
        _sweep_sockets(tmp_path, socket)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def _sweep_sockets(tmp_path, socket) -> None:
    folder = tmp_path / "fleet-ps-0123456789abcdef"
    folder.mkdir(mode=0o700)
    dead, live = str(folder / "dead.sock"), str(folder / "live.sock")
    dead_direct, live_direct = str(folder / "dead.direct"), str(folder / "live.direct")  # a server's direct sockets
    for path in (dead, dead_direct):
        gone = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        gone.bind(path)  # bound, never listening, then closed: what a killed server leaves
        gone.close()
    servers = []
    for path in (live, live_direct):
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen(1)
        servers.append(server)
    other = folder / "notes.txt"  # not a server's socket: never touched
    other.write_text("x")
    try:
        assert sorted(job_files.remove_dead_ps_sockets(str(tmp_path))) == sorted([dead, dead_direct])
        assert os.path.exists(live) and os.path.exists(live_direct) and other.exists()
    finally:
        for server in servers:
            server.close()
    os.unlink(live)
    os.unlink(live_direct)
    other.unlink()
    assert job_files.remove_dead_ps_sockets(str(tmp_path)) == [] and not folder.exists()  # the empty folder goes


def test_a_job_that_ends_leaves_the_sockets_of_a_running_job_with_the_same_secret() -> None:
    """The job's socket directory is named by its secret, which jobs may share (a FLEET_SECRET set for every job):
    fleetrun's end-of-job cleanup takes what no server listens on, never a running server's socket. (Before, it
    removed the whole directory, and a concurrent job's workers found 'no direct socket' at their next pull.)"""
    import socket

    secret = os.urandom(16).hex()
    folder = job_files.ps_socket_dir(secret)
    os.mkdir(folder, 0o700)
    dead, live = os.path.join(folder, "ended.sock"), os.path.join(folder, "running.direct")
    gone = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    gone.bind(dead)  # the ended job's server, killed: bound, not listening
    gone.close()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(live)
    server.listen(1)
    try:
        assert job_files.remove_ps_sockets(secret)
        assert not os.path.exists(dead) and os.path.exists(live)
    finally:
        server.close()
    assert job_files.remove_ps_sockets(secret) and not os.path.exists(folder)  # its server gone, it goes too
    assert not job_files.remove_ps_sockets(secret)


@pytest.mark.multiprocess  # starts a short-lived process to have a dead owner
def test_a_job_that_ends_leaves_the_segments_of_a_running_job_with_the_same_secret() -> None:
    """The job's shared-memory prefix is derived from its secret, which jobs may share: fleetrun's end-of-job
    cleanup takes the segments whose creator has ended, never one a running process created."""
    secret = os.urandom(16).hex()
    prefix = job_files.shm_prefix(secret)
    ended = f"/dev/shm/{prefix}-{dead_owner()}-{'c' * 32}-control"
    running = f"/dev/shm/{prefix}-{job_files.owner_tag()}-{'c' * 32}-control"
    for path in (ended, running):
        with open(path, "w") as f:
            f.write("x")
    try:
        assert job_files.remove_shm(secret) == [ended]
        assert os.path.exists(running) and not os.path.exists(ended)
    finally:
        for path in (ended, running):
            if os.path.exists(path):
                os.unlink(path)
