"""Processes a job left behind outside its process groups, which fleetrun adopts and ends.

Stopping a child signals its whole process group (:mod:`fleet.launch.supervisor`), which takes
data-loader workers and shell pipelines with it. A descendant that called ``setsid()`` (a
daemonising helper, a detached tool) has left that group and would outlive the job with the job's
environment, ``FLEET_SECRET`` included. So fleetrun, run from the command line, makes itself the
*subreaper* of its descendants (Linux ``PR_SET_CHILD_SUBREAPER``): a descendant whose parent dies
becomes fleetrun's child rather than init's, and when the job ends fleetrun ends every child it did
not start itself (SIGTERM, then SIGKILL after a grace period) and reaps them.

What is left: a descendant whose parent is still alive when fleetrun ends is not fleetrun's child
yet; the job's children end first, so it becomes one before the sweep, except when fleetrun itself
is killed with SIGKILL, which nothing can handle (its direct children still die with it, by
``PR_SET_PDEATHSIG``; their setsid'd descendants then belong to init).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator

from fleet.runtime.job_files import proc_stat

_PR_SET_CHILD_SUBREAPER = 36


def adopt_orphans() -> bool:
    """Become the subreaper of this process's descendants (Linux); whether that worked."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def children(parent: int | None = None) -> list[int]:
    """The pids whose parent is ``parent`` (this process by default), from /proc; [] where there is none."""
    parent = os.getpid() if parent is None else parent
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        fields = proc_stat(int(entry))
        if not fields or len(fields) < 2 or int(fields[1]) != parent:
            continue  # gone meanwhile, or another's child
        if fields[0] == "Z":
            _reap(int(entry))  # a zombie orphan: only reaping is left
        else:
            found.append(int(entry))
    return found


def _reap(pid: int) -> bool:
    """Collect ``pid``'s exit status if it has ended; whether it has."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True  # not our child (any more), or reaped already
    return done == pid


def end_orphans(started: set[int], grace_s: float = 3.0) -> list[int]:
    """End every child of this process that is not one of the ``started`` pids; return their pids.

    SIGTERM first, SIGKILL to those still alive after ``grace_s``; every one is reaped.
    """
    orphans = [pid for pid in children() if pid not in started]
    for pid in orphans:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    alive = list(orphans)
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if not _reap(pid)]
        if alive:
            time.sleep(0.05)
    for pid in alive:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if not _reap(pid)]
        if alive:
            time.sleep(0.02)
    return orphans


@contextlib.contextmanager
def adopted(grace_s: float = 3.0) -> Iterator[list[int]]:
    """Adopt orphans for the block; on exit end those left (the list yielded gets their pids)."""
    ended: list[int] = []
    if not adopt_orphans():
        yield ended
        return
    before = set(children())  # children from before the job (none for fleetrun itself)
    try:
        yield ended
    finally:
        ended.extend(end_orphans(before, grace_s))
