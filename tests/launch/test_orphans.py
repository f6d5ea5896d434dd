"""fleetrun ends what a job leaves behind outside its process groups (fleet.launch.orphans): a process a
worker started with setsid() dies with the job instead of outliving it with the job's secret."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fleet.launch import orphans
from fleet.runtime.job_files import process_alive

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"

pytestmark = [  # every test here starts processes
    pytest.mark.multiprocess,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_CHILD_SUBREAPER is Linux's"),
]


def wait_dead(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not process_alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_children_reads_proc_and_finds_a_child() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in orphans.children()
    finally:
        child.kill()
        child.wait()
    assert child.pid not in orphans.children()


@pytest.mark.timeout(60)
def test_a_setsid_grandchild_is_adopted_and_ended() -> None:
    """In a process of its own (the subreaper setting is per process): a child starts a setsid grandchild and
    exits; the grandchild becomes ours and is ended when the block ends."""
    program = textwrap.dedent(
        """
        import subprocess, sys, time
        from fleet.launch import orphans

        with orphans.adopted(grace_s=1.0) as ended:
            child = subprocess.run(
                [sys.executable, "-c",
                 "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; "
                 "time.sleep(120)'], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
                 "print(p.pid)"],
                capture_output=True, text=True, check=True,
            )
            grandchild = int(child.stdout)
            time.sleep(0.2)
            assert grandchild in orphans.children(), "the orphan was not adopted"
        print(grandchild, ended)
        """
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    grandchild, ended = done.stdout.split(maxsplit=1)
    assert ended.strip() == f"[{grandchild}]"
    assert wait_dead(int(grandchild), 5)


@pytest.mark.timeout(120)
def test_fleetrun_ends_a_process_a_worker_started_with_setsid(tmp_path: Path) -> None:
    pids = tmp_path / "pid"
    cmd = [sys.executable, "-m", "fleet.launch", "--workers", "2", "--log-dir", str(tmp_path / "logs")]
    done = subprocess.run(
        [*cmd, str(SCRIPTS / "setsid_child.py"), str(pids)], capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    left = [int((tmp_path / f"pid.{w}").read_text()) for w in range(2)]
    for pid in left:
        assert wait_dead(pid), f"pid {pid}, started with setsid by a worker, outlived fleetrun"
    assert "ended 2 process(es) the job left running outside its process groups" in done.stderr, done.stderr
