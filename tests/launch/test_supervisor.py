"""fleetrun's supervisor against fake processes: exits, failures, restarts, port relaunches (no process starts)."""

from __future__ import annotations

import io
import itertools
import signal
from pathlib import Path

import pytest
from rich.console import Console

from fleet.launch.config import LaunchConfig
from fleet.launch.output import OutputMux
from fleet.launch.plan import JobLayout
from fleet.launch.supervisor import Supervisor
from fleet.runtime import env

_pids = itertools.count(10_000)


class FakeProcess:
    """Exits with ``code`` after ``polls`` polls (never, with None), or when signalled (status -signal)."""

    def __init__(self, code: int | None, polls: int = 2, output: str = ""):
        self.pid = next(_pids)
        self.stdout = io.BytesIO(output.encode())
        self.returncode: int | None = None
        self.signals: list[int] = []
        self._code, self._polls = code, polls

    def poll(self) -> int | None:
        self._polls -= 1
        if self.returncode is None and self._code is not None and self._polls <= 0:
            self.returncode = self._code
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = -signal.SIGKILL
        return self.returncode


class FakeSpawner:
    """Hands out the scripted incarnations of each process ("worker 0", "server 1"...), in order."""

    def __init__(self, script: dict[str, list[FakeProcess]]):
        self.script = {label: list(processes) for label, processes in script.items()}
        self.started: list[tuple[str, int]] = []  # (label, FLEET_RESTART_COUNT)

    def start(self, command: list[str], environ: dict[str, str]) -> FakeProcess:
        role = environ[env.FLEET_ROLE]
        index = environ[env.FLEET_WORKER_INDEX if role == "worker" else env.FLEET_SERVER_INDEX]
        label = f"{role} {index}"
        self.started.append((label, int(environ[env.FLEET_RESTART_COUNT])))
        return self.script[label].pop(0)

    def signal_group(self, process: FakeProcess, sig: int) -> None:
        process.signals.append(sig)
        if process.returncode is None:
            process.returncode = -sig


def _run(tmp_path: Path, spawner: FakeSpawner, **config) -> tuple[int, str, Supervisor]:
    out = io.StringIO()
    mux = OutputMux(Console(file=out, width=120, no_color=True))
    config = LaunchConfig(script=tmp_path / "train.py", stop_timeout=0.2, server_grace=0.5, **config)
    layouts = itertools.count()
    supervisor = Supervisor(
        config,
        tmp_path,
        mux,
        lambda: JobLayout(master=f"127.0.0.1:{1000 + next(layouts)}", server_endpoints=(), secret="00" * 32),
        spawner=spawner,
    )
    code = supervisor.run()
    mux.close()
    return code, out.getvalue(), supervisor


@pytest.mark.timeout(30)
def test_every_worker_exits_zero_and_the_job_succeeds(tmp_path):
    spawner = FakeSpawner({"worker 0": [FakeProcess(0, output="hello\n")], "worker 1": [FakeProcess(0, polls=4)]})
    code, out, _ = _run(tmp_path, spawner, workers=2)
    assert code == 0 and "job succeeded" in out and "[worker 0] hello" in out
    assert (tmp_path / "worker.0.log").read_text() == "hello\n"


@pytest.mark.timeout(30)
def test_a_failing_worker_stops_the_others_and_names_itself(tmp_path):
    survivor = FakeProcess(None)
    spawner = FakeSpawner({"worker 0": [survivor], "worker 1": [FakeProcess(3, output="boom\n")]})
    code, out, supervisor = _run(tmp_path, spawner, workers=2)
    assert code == 3 and supervisor.failure == "worker 1 failed (exit status 3)"
    assert survivor.signals[0] == signal.SIGTERM and "stopped (SIGTERM)" in out
    assert "last 1 lines of worker 1" in out and "[worker 1] boom" in out


@pytest.mark.timeout(30)
def test_a_collective_job_restarts_as_a_whole(tmp_path):
    spawner = FakeSpawner(
        {
            "worker 0": [FakeProcess(None), FakeProcess(0)],
            "worker 1": [FakeProcess(1), FakeProcess(0)],
        }
    )
    code, out, _ = _run(tmp_path, spawner, workers=2, max_restarts=1)
    assert code == 0 and "restarting all workers (restart 1 of 1)" in out
    assert spawner.started == [("worker 0", 0), ("worker 1", 0), ("worker 0", 1), ("worker 1", 1)]


@pytest.mark.timeout(30)
def test_a_parameter_server_job_restarts_only_the_failed_process(tmp_path):
    spawner = FakeSpawner(
        {
            "server 0": [FakeProcess(-signal.SIGKILL), FakeProcess(0, polls=6)],
            "worker 0": [FakeProcess(0, polls=4)],
        }
    )
    code, out, _ = _run(tmp_path, spawner, workers=1, servers=1, max_restarts=1)
    assert code == 0 and "server 0 failed (killed by SIGKILL (exit status 137)" in out
    assert spawner.started == [("server 0", 0), ("worker 0", 0), ("server 0", 1)]


@pytest.mark.timeout(30)
def test_a_lost_port_race_relaunches_with_fresh_ports_and_is_not_a_restart(tmp_path):
    spawner = FakeSpawner({"worker 0": [FakeProcess(env.EXIT_PORT_IN_USE), FakeProcess(0)]})
    code, out, supervisor = _run(tmp_path, spawner, workers=1)
    assert code == 0 and "relaunching the job with fresh ports (try 1 of 5, not counted as a restart)" in out
    assert spawner.started == [("worker 0", 0), ("worker 0", 0)]
    assert supervisor.layout is not None and supervisor.layout.master == "127.0.0.1:1001"  # a new layout


@pytest.mark.timeout(30)
def test_a_server_that_outlives_its_workers_is_stopped_after_the_grace_period(tmp_path):
    server = FakeProcess(None)
    spawner = FakeSpawner({"server 0": [server], "worker 0": [FakeProcess(0)]})
    code, out, _ = _run(tmp_path, spawner, workers=1, servers=1)
    assert code == 0 and "server 0 did not exit within 0.5 s after the workers finished; stopping them" in out
    assert server.signals[0] == signal.SIGTERM
