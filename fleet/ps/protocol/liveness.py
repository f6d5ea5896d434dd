"""Which workers are still there, seen from a parameter server.

Every worker's client sends a HELLO heartbeat about once a second from a thread of its
own, so a live worker is never silent, however long it computes. A worker that has
joined (sent anything) and then stays silent for ``dead_after_s`` with no request
parked on the server is *gone*: killed, its host lost, or frozen. What follows depends
on the job:

- ``rejoin`` (fleetrun restarts failed processes): sync steps stop waiting for a gone
  worker; when its restarted process speaks again it is back, pulls the current
  parameters and pushes at the current version.
- otherwise: steps keep waiting for it, so the other workers' requests fail at their
  deadline with an error naming the missing worker, and the server ends (non-zero)
  once every worker has stopped or gone.
"""

from __future__ import annotations

from collections.abc import Callable

HEARTBEAT_S = 1.0


class WorkerLiveness:
    def __init__(self, dead_after_s: float):
        self.dead_after_s = dead_after_s
        self._last_seen: dict[int, float] = {}
        self.gone: set[int] = set()
        self.ever_gone: set[int] = set()
        #: when :meth:`due` next answers True (the server loop compares with it on every round: no call)
        self.next_check = 0.0

    def due(self, now: float) -> bool:
        """Whether to look for silent workers now: twice a heartbeat, not on every request."""
        if now < self.next_check:
            return False
        self.next_check = now + HEARTBEAT_S / 2
        return True

    def seen(self, worker: int, now: float) -> bool:
        """Record a message; True when the worker was gone and is back."""
        self._last_seen[worker] = now
        if worker in self.gone:
            self.gone.discard(worker)
            return True
        return False

    def forget(self, worker: int) -> None:
        """The worker said STOP: its silence from now on is expected."""
        self._last_seen.pop(worker, None)
        self.gone.discard(worker)

    def check(self, now: float, busy: set[int]) -> list[int]:
        """Workers that just went silent; ``busy`` ones have a request parked here and are alive."""
        newly = [
            worker
            for worker, seen in self._last_seen.items()
            if worker not in self.gone and worker not in busy and now - seen > self.dead_after_s
        ]
        self.gone.update(newly)
        self.ever_gone.update(newly)
        return newly


class Workers:
    """The workers one server serves: who said STOP, who went silent (:class:`WorkerLiveness`), and so who a sync
    step, a barrier and an all-reduce wait for, and when the server is done."""

    def __init__(self, num_workers: int, rejoin: bool, dead_after_s: float):
        self.num_workers = num_workers
        self.rejoin = rejoin
        self.stopped: set[int] = set()
        self.liveness = WorkerLiveness(dead_after_s)

    @property
    def active(self) -> set[int]:
        """Workers a sync step waits for: not stopped, and not gone when restarts may bring them back."""
        gone = self.liveness.gone if self.rejoin else set()
        return set(range(self.num_workers)) - self.stopped - gone

    @property
    def finished_gone(self) -> set[int]:
        """Gone workers the server no longer waits for before it ends (none while restarts may come)."""
        return set() if self.rejoin else self.liveness.gone

    def done(self) -> bool:
        """Every worker stopped, or is gone for good: the server may end."""
        gone = self.finished_gone
        if len(self.stopped) + len(gone) < self.num_workers:
            return False  # the usual answer, asked on every round of the server loop: no union built for it
        return len(self.stopped | gone) >= self.num_workers

    def seen(self, worker: int, now: float) -> bool:
        """Record a request of ``worker``; True when it was gone and is back."""
        return worker not in self.stopped and self.liveness.seen(worker, now)

    def stop(self, worker: int) -> None:
        """``worker`` said STOP: it is done, and its silence from now on is expected."""
        self.stopped.add(worker)
        self.liveness.forget(worker)

    def newly_gone(self, now: float, busy: Callable[[], set[int]]) -> list[int]:
        """Workers that just went silent (checked twice a heartbeat; ``busy()``: those with a request parked)."""
        if not self.liveness.due(now):
            return []
        return self.liveness.check(now, busy())
