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

HEARTBEAT_S = 1.0


class WorkerLiveness:
    def __init__(self, dead_after_s: float):
        self.dead_after_s = dead_after_s
        self._last_seen: dict[int, float] = {}
        self.gone: set[int] = set()
        self.ever_gone: set[int] = set()
        self._next_check = 0.0

    def due(self, now: float) -> bool:
        """Whether to look for silent workers now: twice a heartbeat, not on every request."""
        if now < self._next_check:
            return False
        self._next_check = now + HEARTBEAT_S / 2
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
