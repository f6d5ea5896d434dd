"""Start the job's processes on this node, watch them, restart or stop them.

Rules, in the order the supervision loop applies them:

- A signal to fleetrun (SIGINT, SIGTERM, SIGHUP) stops every child and
  fleetrun exits 128+signal. A second signal skips the grace period.
- A child exiting with :data:`fleet.runtime.env.EXIT_PORT_IN_USE` lost a race for the
  port it was given: the job is stopped and relaunched with fresh ports, a
  bounded number of times, not counted as a restart.
- Any other non-zero exit (or death by signal) is a failure. With restarts
  left, a parameter-server job (servers > 0) restarts just that process, same
  role and rank; a collective job restarts every worker. ``FLEET_RESTART_COUNT``
  tells the new processes how often that happened.
- A failure with no restarts left stops the other processes and ends the job
  with the failed process's status, after a block naming it with its last lines.
- When every worker has exited 0 the job succeeded; servers get
  ``server_grace`` seconds to exit by themselves, then are stopped.
- A full log directory costs log lines and ``report.json``, never the job: the
  children's output is still read and shown, and the end of the summary names
  every file that lost lines or was not written. fleetrun's exit status stays the
  job's (a job that trained is not one to rerun because its logs were cut).

Every child is the leader of its own process group (``start_new_session``);
stopping sends SIGTERM to the group, then SIGKILL after ``stop_timeout``, so
grandchildren (data loader workers, shell pipelines) go too. On Linux every child
also asks the kernel to kill it when fleetrun dies (PR_SET_PDEATHSIG), so even a
SIGKILLed fleetrun leaves no orphan behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from fleet.launch.config import LaunchConfig
from fleet.launch.output import LostWrites, OutputMux, ProcessOutput, style_for
from fleet.launch.plan import SERVER, WORKER, JobLayout, ProcessSpec, child_env, local_specs
from fleet.launch.report import Row, describe, exit_code, failure_block, summary_table
from fleet.launch.timing import NO_REPORT, StragglerWatch, clear_metrics, final_report
from fleet.runtime import env
from fleet.runtime.job_files import clear_joined, joined_workers, remove_ps_sockets, remove_shm

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL me when fleetrun dies, however it dies (Linux only)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


MAX_PORT_RELAUNCHES = 5
POLL_S = 0.05
FULL_BELOW = 64 << 10  # bytes free under which the log directory counts as full
OUTPUT_JOIN_S = 2.0
_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Spawner:
    """How the supervisor starts and signals its processes (tests hand it fake processes)."""

    def start(self, command: list[str], environ: Mapping[str, str]) -> subprocess.Popen:
        return subprocess.Popen(
            command,
            env=environ,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            preexec_fn=_die_with_parent,
        )

    def signal_group(self, process: subprocess.Popen, sig: int) -> None:
        """``sig`` to the process and everything it started (its own session and group)."""
        try:
            os.killpg(process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


@dataclass
class Slot:
    """One process of the job and its current incarnation."""

    spec: ProcessSpec
    style: str
    log_path: Path
    restarts: int = 0
    popen: subprocess.Popen | None = None
    output: ProcessOutput | None = None
    started: float = 0.0
    ended: float | None = None
    returncode: int | None = None
    stopped: bool = False

    @property
    def label(self) -> str:
        return self.spec.label

    @property
    def running(self) -> bool:
        return self.popen is not None and self.returncode is None

    def run_time(self) -> float:
        end = self.ended if self.ended is not None else time.monotonic()
        return max(0.0, end - self.started) if self.popen is not None else 0.0


class Supervisor:
    """Runs one node's share of a job to its end; :meth:`run` returns fleetrun's exit status."""

    def __init__(
        self,
        config: LaunchConfig,
        log_dir: Path,
        mux: OutputMux,
        layouts: Callable[[], JobLayout],
        *,
        base_env: Mapping[str, str] | None = None,
        port_relaunch: bool = True,
        others_done: Callable[[], bool] | None = None,
        on_workers_done: Callable[[], None] | None = None,
        spawner: Spawner | None = None,
    ):
        self.config = config
        self.log_dir = log_dir
        self.mux = mux
        self._layouts = layouts
        self._base_env = base_env
        self._port_relaunch = port_relaunch
        self._others_done = others_done or (lambda: True)
        self._on_workers_done = on_workers_done or (lambda: None)
        self.spawner = spawner or Spawner()
        self.failure: str | None = None  # "worker 1 failed (exit status 1)" once the job failed here
        specs = local_specs(config)
        self.slots = [
            Slot(spec, style_for(i), log_dir / f"{spec.role}.{spec.rank}.log") for i, spec in enumerate(specs)
        ]
        self.mux.set_label_width(max((len(s.label) for s in self.slots), default=0))
        self.layout: JobLayout | None = None
        self._signum: int | None = None
        self._force = False
        self.stop_requested = threading.Event()  # set by other threads (e.g. a multi-node peer failed)
        self.stop_reason = ""
        self.stop_code = 1
        self.lost = LostWrites()  # what could not be written into the log directory (a full disk)
        self.stragglers: StragglerWatch | None = None

    # --- public -------------------------------------------------------------------

    def run(self) -> int:
        previous = self._install_signal_handlers()
        code = 1
        try:
            self.layout = self._layouts()
            clear_metrics(self.log_dir)
            clear_joined(self.log_dir)
            self.stragglers = StragglerWatch(self.log_dir, lambda text: self.mux.message(text, style="bold yellow"))
            self._start_all(restart_count=0)
            self.stragglers.start()
            code = self._supervise()
        finally:
            if self.stragglers is not None:
                self.stragglers.stop()
            self._stop([s for s in self.slots if s.running])
            self._reap_groups()
            self._restore_signal_handlers(previous)
            self._summary(code)
        return code

    @property
    def signalled(self) -> bool:
        """Whether a signal (SIGINT, SIGTERM, SIGHUP) to fleetrun stopped the job."""
        return self._signum is not None

    def request_stop(self, reason: str, code: int = 1) -> None:
        """Ask the loop (from any thread) to stop the job and exit with ``code``."""
        self.stop_reason = reason
        self.stop_code = code
        self.stop_requested.set()

    # --- the loop ---------------------------------------------------------------------

    def _supervise(self) -> int:
        config = self.config
        job_restarts = 0
        port_relaunches = 0
        workers_finished, said_waiting = False, False
        grace_from: float | None = None  # when the servers' grace period began
        while True:
            if self._signum is not None:
                alive = sum(s.running for s in self.slots)
                self.mux.message(
                    f"received {_signame(self._signum)}; stopping {alive} process(es)", style="bold yellow"
                )
                self._stop([s for s in self.slots if s.running])
                return 128 + self._signum
            if self.stop_requested.is_set():
                self.mux.message(f"{self.stop_reason}; stopping this node's processes", style="bold red")
                self._stop([s for s in self.slots if s.running])
                return self.stop_code

            relaunched = False
            for slot in self._poll():
                rc = slot.returncode
                assert rc is not None
                if rc == 0:
                    continue
                if rc == env.EXIT_PORT_IN_USE:
                    if self._port_relaunch and port_relaunches < MAX_PORT_RELAUNCHES:
                        port_relaunches += 1
                        self.mux.message(
                            f"{slot.label} could not bind its port (exit status {rc}); relaunching the job with "
                            f"fresh ports (try {port_relaunches} of {MAX_PORT_RELAUNCHES}, not counted as a restart)",
                            style="bold yellow",
                        )
                        self._relaunch_all(restart_count=job_restarts if not config.is_ps else None)
                        relaunched, workers_finished, grace_from = True, False, None
                        break
                    self.mux.message(
                        f"{slot.label} exited with status {rc}: it could not bind the port fleetrun gave it"
                        + (
                            f", {port_relaunches} relaunches with fresh ports did not help"
                            if self._port_relaunch
                            else ""
                        ),
                        style="bold red",
                    )
                late_server = slot.spec.role == SERVER and grace_from is not None
                if config.is_ps and slot.restarts < config.max_restarts and not late_server:
                    self.mux.message(
                        f"{slot.label} failed ({describe(rc)}, log {slot.log_path}); restarting it "
                        f"(restart {slot.restarts + 1} of {config.max_restarts})",
                        style="bold yellow",
                    )
                    self._join_output(slot)
                    self._start(slot, restart_count=slot.restarts + 1)
                    continue
                if not config.is_ps and job_restarts < config.max_restarts:
                    job_restarts += 1
                    self.mux.message(
                        f"{slot.label} failed ({describe(rc)}, log {slot.log_path}); restarting all workers "
                        f"(restart {job_restarts} of {config.max_restarts})",
                        style="bold yellow",
                    )
                    self._relaunch_all(restart_count=job_restarts)
                    relaunched, workers_finished, grace_from = True, False, None
                    break
                return self._fail(slot)
            if relaunched:
                continue

            workers = [s for s in self.slots if s.spec.role == WORKER]
            if all(s.returncode == 0 for s in workers):
                if not workers_finished:
                    workers_finished = True
                    self._on_workers_done()
                servers = [s for s in self.slots if s.running]
                if not servers:
                    done = f"all {len(workers)} worker(s) on this node finished" if workers else "the servers finished"
                    self.mux.message(done, style="bold green")
                    return 0
                now = time.monotonic()
                if grace_from is None:
                    if self._others_done():
                        grace_from = now
                        self.mux.message(
                            f"all {len(workers) if workers else 'the'} worker(s) finished; waiting up to "
                            f"{config.server_grace:g} s for {len(servers)} server(s) to exit"
                        )
                    elif not said_waiting:
                        said_waiting = True
                        here = f"all {len(workers)} worker(s) on this node finished" if workers else "no workers here"
                        self.mux.message(f"{here}; the servers keep serving until the other nodes' workers finish")
                elif now - grace_from > config.server_grace:
                    names = ", ".join(s.label for s in servers)
                    self.mux.message(
                        f"{names} did not exit within {config.server_grace:g} s after the workers finished; "
                        "stopping them",
                        style="bold yellow",
                    )
                    self._stop(servers)
                    return 0
            time.sleep(POLL_S)

    def _fail(self, slot: Slot) -> int:
        rc = slot.returncode
        assert rc is not None
        others = [s for s in self.slots if s.running]
        self.mux.message(
            f"{slot.label} failed ({describe(rc)})" + ("; stopping the other processes" if others else ""),
            style="bold red",
        )
        self._stop(others)
        self.failure = f"{slot.label} failed ({describe(rc)})"
        self._join_output(slot)
        self.mux.render(
            failure_block(slot.label, rc, slot.output.tail() if slot.output else [], slot.style, str(slot.log_path))
        )
        return exit_code(rc)

    # --- processes -------------------------------------------------------------------

    def _start_all(self, restart_count: int | None) -> None:
        for slot in self.slots:
            if self._signum is not None or self.stop_requested.is_set():
                return
            self._start(slot, restart_count=slot.restarts if restart_count is None else restart_count)

    def _relaunch_all(self, restart_count: int | None) -> None:
        self._stop([s for s in self.slots if s.running])
        for slot in self.slots:
            self._join_output(slot)
        self.layout = self._layouts()
        self._start_all(restart_count)

    def _start(self, slot: Slot, restart_count: int) -> None:
        assert self.layout is not None
        config = self.config
        environ = child_env(
            slot.spec, config, self.layout, restart_count=restart_count, log_dir=str(self.log_dir), base=self._base_env
        )
        command = [sys.executable, "-u", str(config.script), *config.script_args]
        try:
            with open(slot.log_path, "ab") as log:
                if slot.popen is not None:
                    log.write(
                        f"----- fleetrun: {slot.label} starts again ({env.FLEET_RESTART_COUNT}={restart_count}) -----\n".encode()
                    )
        except OSError as error:  # a full log directory costs log lines, not the job
            self.lost.line(slot.log_path, error)
        slot.restarts = restart_count
        slot.returncode, slot.ended, slot.stopped = None, None, False
        slot.started = time.monotonic()
        slot.popen = self.spawner.start(command, environ)
        assert slot.popen.stdout is not None
        slot.output = ProcessOutput(
            self.mux, slot.label, slot.style, slot.log_path, slot.popen.stdout, lost=self.lost
        ).start()

    def _poll(self) -> list[Slot]:
        """Record exits; return the slots that exited by themselves since the last poll."""
        exited = []
        for slot in self.slots:
            if slot.running:
                assert slot.popen is not None
                rc = slot.popen.poll()
                if rc is not None:
                    slot.returncode, slot.ended = rc, time.monotonic()
                    if not slot.stopped:
                        exited.append(slot)
        return exited

    def _stop(self, slots: list[Slot]) -> None:
        """SIGTERM each process group, SIGKILL what is left after ``stop_timeout``."""
        targets = [s for s in slots if s.running]
        if not targets:
            return
        for slot in targets:
            slot.stopped = True
            self._kill_group(slot, signal.SIGTERM)
        deadline = time.monotonic() + self.config.stop_timeout
        while any(s.running for s in targets) and time.monotonic() < deadline and not self._force:
            self._poll()
            time.sleep(POLL_S)
        for slot in targets:
            self._kill_group(slot, signal.SIGKILL)  # the leader if still there, and any grandchildren
            if slot.running:
                assert slot.popen is not None
                slot.returncode = slot.popen.wait()
                slot.ended = time.monotonic()
        for slot in targets:
            self._join_output(slot)

    def _reap_groups(self) -> None:
        """Kill what is left in the groups of processes that exited by themselves (orphaned grandchildren)."""
        for slot in self.slots:
            if slot.popen is not None:
                self._kill_group(slot, signal.SIGKILL)
            self._join_output(slot)

    def _kill_group(self, slot: Slot, sig: int) -> None:
        if slot.popen is not None:
            self.spawner.signal_group(slot.popen, sig)

    def _join_output(self, slot: Slot) -> None:
        if slot.output is not None:
            slot.output.join(OUTPUT_JOIN_S)

    # --- signals and the end ------------------------------------------------------------

    def _on_signal(self, signum: int, frame: object) -> None:
        if self._signum is None:
            self._signum = signum
        else:
            self._force = True

    def _install_signal_handlers(self) -> dict:
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {sig: signal.signal(sig, self._on_signal) for sig in _HANDLED_SIGNALS}

    def _restore_signal_handlers(self, previous: dict) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def _summary(self, code: int) -> None:
        rows = [
            Row(s.spec.role, s.spec.rank, s.returncode, s.stopped, s.run_time(), s.restarts)
            for s in sorted(self.slots, key=lambda s: (s.spec.role != WORKER, s.spec.rank))
        ]
        verdict = "succeeded" if code == 0 else f"failed (exit status {code})"
        self.mux.render(summary_table(rows, f"fleetrun: job {verdict}"))
        self._note_workers_without_init()
        if self.layout is not None:
            remove_shm(self.layout.secret)
            remove_ps_sockets(self.layout.secret)  # what a killed server left (fleet.ps.protocol.local)
        restarts = {s.spec.rank: s.restarts for s in self.slots if s.spec.role == WORKER}
        stragglers = self.stragglers.ever if self.stragglers is not None else set()
        report = self.log_dir / "report.json"
        try:
            timing = final_report(self.log_dir, restarts, stragglers)
        except OSError as error:
            self.lost.file(report, error)
            timing = None
        if timing is not None:
            self.mux.render(timing[1])
            self.mux.message(f"timing report in {report}")
        elif _full(self.log_dir):  # the workers' timing files could not be written either
            self.lost.file(report, "the workers' timing files could not be written: No space left on device")
        elif code == 0:
            self.mux.message(NO_REPORT)
        self.mux.message(f"logs in {self.log_dir}")
        if self.lost:
            self.mux.message(
                f"fleetrun could not write everything into its log directory {self.log_dir}; lost: "
                + "; ".join(self.lost.describe())
                + ". The job's result does not depend on them: fleetrun's exit status is the job's "
                f"({code}). Free space there (or pass --log-dir elsewhere) to keep the logs of the next run.",
                style="bold yellow",
            )

    def _note_workers_without_init(self) -> None:
        workers = [s for s in self.slots if s.spec.role == WORKER]
        if self.config.world_workers < 2 or self.lost or _full(self.log_dir):
            return  # (on a full disk the workers' "joined" marks may be missing: no claim from them)
        joined = joined_workers(self.log_dir)
        missing = [s.spec.rank for s in workers if s.returncode == 0 and s.spec.rank not in joined]
        if missing:
            names = ", ".join(f"worker {rank}" for rank in missing)
            self.mux.message(
                f"{names} finished without calling fleet.init(): they trained on their own, not as one job. "
                "Add fleet.init() and fleet.distributed_optimizer(...) to the script.",
                style="bold yellow",
            )


def _full(path: Path) -> bool:
    """Whether the filesystem of ``path`` has no room left (a worker's small file would not fit)."""
    try:
        return shutil.disk_usage(path).free < FULL_BELOW
    except OSError:
        return False


def _signame(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
