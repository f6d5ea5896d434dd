"""Table work on a few threads: one lane per table, the lanes served by a small pool.

Why: the table kernels (fleet/sparse's native lookup, gather and row updates, torch's dense ops)
release the GIL, but a server that runs every table operation on its loop thread uses at most one
core, and does not receive or answer while a table works. Here the loop thread decodes and checks
requests, and hands each table operation to its table's *lane*; pool threads run the lanes.

The guarantees, and how they are kept:

* **One table, one thing at a time, in arrival order.** A lane is a FIFO run by at most one pool
  thread at a time, so a table (which is not thread-safe) sees its operations one by one, in the
  order the loop took them from its inbox: a worker's push still comes before its pull behind it,
  a sync step still closes on the push that completes it, and the per-worker turns of
  :mod:`fleet.ps.server.inbox` still decide that order.
* **The server's own state under one lock.** The waitlist, the counters, the worker sets of sync
  steps and the composite requests' bookkeeping are shared by all tables: code that touches them
  holds the server's lock (:attr:`ServerLock`), which a pool thread lets go only around a table's
  kernel (:meth:`ServerLock.outside`), where it touches nothing but its own table.
* **Everything else after the lanes.** A request that is not one table's pull or push (create,
  save, load, barrier, stop, shrink, stats, ...) waits until every lane is empty (:meth:`Lanes.drain`),
  then runs on the loop thread as before: it sees every earlier operation done, and none runs beside it.
* **Replies from one thread.** The socket is not thread-safe: a pool thread queues its replies and
  wakes the loop, which sends them (:class:`Outbox`).

``threads=0`` keeps the single-threaded server: everything on the loop thread, no lanes.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

log = logging.getLogger(__name__)

#: table operations queued in the lanes beyond which the loop stops taking requests until they shrink
MAX_QUEUED = 256
_AS_IT_IS: AbstractContextManager[None] = nullcontext()


def default_threads(cpus: int | None = None) -> int:
    """Pool threads when the strategy does not say: none on a machine of 2 cores or fewer (the loop, ZeroMQ's
    IO thread and the workers already share them), else half the cores, at most 8 (memory-bound kernels
    stop scaling well before that on one socket, and a host often runs several servers)."""
    cpus = cpus or os.cpu_count() or 1
    return 0 if cpus <= 2 else min(8, cpus // 2)


class ServerLock:
    """The lock over the server's shared state; pool threads let it go around table kernels."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._pool: set[int] = set()  # the table threads' idents

    def mark_pool_thread(self) -> None:
        self._pool.add(threading.get_ident())

    def on_pool_thread(self) -> bool:
        return threading.get_ident() in self._pool

    def outside(self) -> AbstractContextManager[None]:
        """Run the body without the lock when on a pool thread (the caller's lane owns its table)."""
        if not self._pool or threading.get_ident() not in self._pool:
            return _AS_IT_IS  # the loop thread (every request, when there are no table threads)
        return self._released()

    @contextmanager
    def _released(self) -> Iterator[None]:
        self.lock.release()
        try:
            yield
        finally:
            self.lock.acquire()


class Outbox:
    """Replies made on pool threads, for the loop thread to send; a pipe wakes the loop."""

    def __init__(self) -> None:
        self._items: deque[tuple[Any, Any]] = deque()
        self.wake_r, self._wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self._wake_w, False)

    def put(self, ident: Any, reply: Any) -> None:
        self._items.append((ident, reply))
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full: the loop is due to wake anyway

    @property
    def pending(self) -> bool:
        """Whether replies wait (a cheap look: :meth:`take` also drains the wake-up pipe)."""
        return bool(self._items)

    def take(self) -> list[tuple[Any, Any]]:
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        out = []
        while self._items:
            out.append(self._items.popleft())
        return out

    def close(self) -> None:
        for fd in (self.wake_r, self._wake_w):
            os.close(fd)


class Lanes:
    """Per-table FIFOs of operations, run by ``threads`` pool threads (see the module's docstring)."""

    def __init__(self, threads: int, lock: ServerLock, name: str = "fleet-ps-table"):
        if threads < 1:
            raise ValueError(f"threads={threads}; a pool needs at least one (0 means no lanes at all)")
        self.threads = threads
        self._lock = lock
        self._idle = threading.Condition(lock.lock)  # notified when the queued count drops
        self._lanes: dict[int, deque[Callable[[], None]]] = {}
        self._busy: set[int] = set()  # lanes queued for, or held by, a pool thread
        self._ready: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self.queued = 0
        self._workers = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for worker in self._workers:
            worker.start()

    def submit(self, table: int, task: Callable[[], None]) -> None:
        """Queue ``task`` (which takes the server lock itself) behind the table's earlier ones. Caller holds the lock."""
        self._lanes.setdefault(table, deque()).append(task)
        self.queued += 1
        if table not in self._busy:
            self._busy.add(table)
            self._ready.put(table)

    def drain(self) -> None:
        """Wait (letting the server lock go meanwhile) until every queued operation has run. Caller holds the lock."""
        self._idle.wait_for(lambda: self.queued == 0)

    def wait_below(self, limit: int = MAX_QUEUED) -> None:
        """Wait until fewer than ``limit`` operations are queued (back-pressure on the loop). Caller holds the lock."""
        self._idle.wait_for(lambda: self.queued < limit)

    def _work(self) -> None:
        self._lock.mark_pool_thread()
        while True:
            table = self._ready.get()
            if table is None:
                return
            with self._lock.lock:
                task = self._lanes[table].popleft()
                try:
                    task()
                except Exception:  # a task answers its own failures; this is a bug, and the lane must go on
                    log.exception("a table operation of table %d failed outside its handler", table)
                finally:
                    self.queued -= 1
                    if self._lanes[table]:
                        self._ready.put(table)  # behind the other tables' turns: no table starves the rest
                    else:
                        del self._lanes[table]
                        self._busy.discard(table)
                    self._idle.notify_all()

    def close(self) -> None:
        """Stop the pool threads once the queued operations have run."""
        for _ in self._workers:
            self._ready.put(None)
        for worker in self._workers:
            worker.join(10)
