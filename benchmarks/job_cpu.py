"""The CPU of a whole benchmark job over its timed steps: user + system seconds of every process, per 1,000 samples.

A W2/W6 job is several processes: workers (or ranks), servers, a launcher (``fleet.launch``,
``torchrun`` and the peer driver above it). The figure counts all of them, over the timed steps
only (startup, imports, table allocation and warm-up are not per-sample costs and differ wildly
between systems), so it does not depend on how many cores the machine has:

- **workers** measure themselves: each worker (each rank, the one process of a one-process
  configuration) reports ``cpu_s``, its own ``time.process_time()`` (every thread of the
  process) over its timed steps, ``timed_samples`` (the samples it trained in them), ``window``
  (``time.time()`` at the first and after the last timed step) and its ``pid``
  (``peer_procs.TimedWindow`` writes these fields; ``examples/single_to_multi/train_ctr.py``
  writes them itself). That part is exact.
- **every other process of the job** (servers, launchers) cannot report: a fleet server serves
  inside ``fleet.init()`` and exits there. :func:`run_job` runs the job as a child of the driver
  and :class:`Sampler` reads ``/proc/<pid>/stat`` (utime + stime, whole thread group) of every
  process under it every :data:`EVERY_S` seconds; :func:`job_cpu` interpolates each
  non-worker process's CPU at the union of the workers' windows (the earliest start, the latest
  end) and adds the differences. A process that exits before the window closes counts up to
  its last sample. The interpolation's error is a fraction of a sample period's CPU at each end.

The job's whole CPU, startup included, is also kept (``total_cpu_s``): ``RUSAGE_CHILDREN`` of
the driver around the job, exact because every launcher here waits for its children
(``fleet.launch``, ``torchrun``, the peer drivers). The timed figure is always below it.
"""

from __future__ import annotations

import os
import resource
import subprocess
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

EVERY_S = 0.1
"""Seconds between two readings of the job's processes."""

TREE_EVERY = 5
"""Re-list the job's processes every this many readings (listing /proc costs more than reading a few stats)."""

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state is [0], ppid [1], utime [11], stime [12])."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


def descendants(root: int) -> set[int]:
    """``root`` and every process below it (by parent pid), alive now."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = _stat_fields(int(name))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(name))
    found, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process (all its threads, living and ended); None once it is gone."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] == "Z":  # a zombie's /proc entry keeps its CPU; it was counted before it died
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK


class Sampler:
    """Reads the CPU of every process under ``root`` every :data:`EVERY_S` s, in a thread, until :meth:`stop`."""

    def __init__(self, root: int, every: float = EVERY_S):
        self.root, self.every = root, every
        self.series: list[tuple[float, dict[int, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="job-cpu-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pids: set[int] = set()
        n = 0
        while True:
            if n % TREE_EVERY == 0:
                pids |= descendants(self.root)
            reading = {pid: cpu for pid in pids if (cpu := cpu_seconds(pid)) is not None}
            self.series.append((time.time(), reading))
            pids = set(reading) | {self.root}
            n += 1
            if self._stop.wait(self.every):
                return

    def stop(self) -> list[tuple[float, dict[int, float]]]:
        self._stop.set()
        self._thread.join()
        return self.series


def run_job(
    cmd: Sequence[str], timeout: float, cwd: str | None = None, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess, dict[str, Any]]:
    """Run ``cmd`` to its end, sampled: (its completed process, ``{"series", "total_cpu_s"}``).

    Raises ``subprocess.TimeoutExpired`` after ``timeout`` seconds (the job is killed first).
    """
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env)
    sampler = Sampler(proc.pid)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    finally:
        series = sampler.stop()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err), {"series": series, "total_cpu_s": total}


# --------------------------------------------------------------------------- the figure (pure)


def cpu_at(series: Sequence[tuple[float, dict[int, float]]], pid: int, when: float) -> float:
    """``pid``'s CPU seconds at time ``when``, interpolated between the readings around it.

    Before its first reading: 0 (it started later). After its last: its last reading (it ended).
    """
    points = [(t, reading[pid]) for t, reading in series if pid in reading]
    if not points or when <= points[0][0]:
        return 0.0 if not points or when < points[0][0] else points[0][1]
    for (t0, c0), (t1, c1) in zip(points, points[1:], strict=False):
        if t0 <= when <= t1:
            return c0 + (c1 - c0) * (when - t0) / (t1 - t0) if t1 > t0 else c1
    return points[-1][1]


def job_cpu(workers: Iterable[dict], series: Sequence[tuple[float, dict[int, float]]] = ()) -> dict[str, Any] | None:
    """The job's CPU over its timed steps, per 1,000 samples; None when a worker did not report its CPU.

    ``workers``: their result lines (``cpu_s``, ``timed_samples``, ``window``, ``pid``);
    ``series``: the :class:`Sampler`'s readings (empty: the workers' CPU alone, as for one process).
    """
    workers = list(workers)
    if not workers or any(w.get("cpu_s") is None or not w.get("timed_samples") for w in workers):
        return None
    own = sum(float(w["cpu_s"]) for w in workers)
    samples = sum(int(w["timed_samples"]) for w in workers)
    start = min(float(w["window"][0]) for w in workers)
    end = max(float(w["window"][1]) for w in workers)
    mine = {int(w["pid"]) for w in workers}
    others = {pid for _, reading in series for pid in reading} - mine
    per_process = {pid: cpu_at(series, pid, end) - cpu_at(series, pid, start) for pid in sorted(others)}
    other = sum(per_process.values())
    return {
        "workers_cpu_s": own,
        "others_cpu_s": other,
        "others": {str(pid): round(cpu, 3) for pid, cpu in per_process.items() if cpu > 0},
        "cpu_s": own + other,
        "timed_samples": samples,
        "cpu_per_1k": 1000.0 * (own + other) / samples,
        "window_s": end - start,
    }
