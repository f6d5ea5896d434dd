"""Which peer died: heartbeats through the rendezvous store.

A collective that fails only says a connection broke or a wait timed out. Every
worker bumps a counter in the store once a second from a daemon thread; when a
collective fails, the survivor samples the counters twice and names the workers
whose counter stood still (dead, or stopped: a SIGSTOPped process's thread stops
too). If the store itself is gone, its host (worker 0) is the one that died.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

from fleet import env

HEARTBEAT_S = 1.0


class Liveness:
    def __init__(self, master: str, namespace: str, rank: int, world_size: int, timeout_s: float):
        host, port = env.split_endpoint(master)
        self._store = dist.PrefixStore(
            f"{namespace}/hb",
            dist.TCPStore(
                host, port, world_size, False, timeout=timedelta(seconds=min(timeout_s, 10)), wait_for_workers=False
            ),
        )
        self.rank = rank
        self.world_size = world_size
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._beat()
        self._thread = threading.Thread(target=self._run, name="fleet-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        with self._lock:
            self._store.add(str(self.rank), 1)

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - the store host is gone; collectives will report it
                return

    def _counters(self) -> list[int]:
        with self._lock:
            return [self._store.add(str(r), 0) for r in range(self.world_size)]

    def silent_peers(self) -> list[int] | None:
        """Ranks whose heartbeat stopped; None when the store (hosted by worker 0) is unreachable."""
        try:
            before = self._counters()
            time.sleep(2.5 * HEARTBEAT_S)
            after = self._counters()
        except Exception:  # noqa: BLE001 - any store failure means its host is gone
            return None
        return [r for r in range(self.world_size) if r != self.rank and before[r] == after[r]]

    def describe(self) -> str:
        silent = self.silent_peers()
        if silent is None:
            return "worker 0 (which hosts the rendezvous store) is unreachable: it died or its host went away"
        if not silent:
            return "every worker's heartbeat is still alive: a worker may be stuck in a long computation or issuing different collectives"
        names = ", ".join(f"worker {r}" for r in silent)
        return f"{names} stopped answering (heartbeat silent): it died or was stopped"

    def close(self) -> None:
        self._stop.set()
