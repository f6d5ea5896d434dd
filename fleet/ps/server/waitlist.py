"""Requests a server answers later: sync pulls, creates waiting for the creator, barriers, all-reduces.

The server loop never blocks, so a request that cannot be answered yet is
parked here with a deadline. The loop asks for the ones that became ready
after each state change (a version advanced, a table was created, a worker
arrived or stopped) and for the ones whose deadline passed, which get an
error reply saying what they waited for.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

from fleet.ps.protocol.wire import Message


@dataclass(slots=True)
class Parked:
    """A request answered later: the peer's routing id, the request, its deadline and arrival."""

    ident: bytes
    msg: Message
    deadline: float
    since: float


class Waitlist:
    """Parked requests by kind; every method is O(parked requests of that kind)."""

    def __init__(self) -> None:
        self.pulls: dict[int, list[Parked]] = defaultdict(list)  # table -> pulls waiting for a version
        self.creates: dict[int, list[Parked]] = defaultdict(list)  # table -> creates waiting for its creator
        self.barrier: dict[int, Parked] = {}  # worker -> its BARRIER
        self.reduce: dict[int, Parked] = {}  # worker -> its ALL_REDUCE (server 0)

    def __iter__(self) -> Iterator[Parked]:
        for waiting in self.pulls.values():
            yield from waiting
        for waiting in self.creates.values():
            yield from waiting
        yield from self.barrier.values()
        yield from self.reduce.values()

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def empty(self) -> bool:
        """Whether nothing is parked (cheap: the server loop asks on every turn)."""
        return not (self.barrier or self.reduce or any(self.pulls.values()) or any(self.creates.values()))

    def next_deadline(self, default: float) -> float:
        if self.empty():
            return default
        return min((p.deadline for p in self), default=default)

    def ready_pulls(self, table: int, version: int) -> list[Parked]:
        """Remove and return the pulls of ``table`` satisfied by ``version``."""
        waiting = self.pulls.get(table)
        if not waiting:
            return []
        ready = [p for p in waiting if p.msg.arg <= version]
        if ready:
            self.pulls[table] = [p for p in waiting if p.msg.arg > version]
        return ready

    def take_creates(self, table: int) -> list[Parked]:
        return self.creates.pop(table, [])

    def release_barrier(self, active: int) -> list[Parked]:
        """Everyone at the barrier, once every active worker is there (else nobody)."""
        if not self.barrier or len(self.barrier) < active:
            return []
        released = list(self.barrier.values())
        self.barrier.clear()
        return released

    def release_reduce(self, active: set[int]) -> list[Parked]:
        """Every parked ALL_REDUCE, once every active worker sent one (else nothing)."""
        if not self.reduce or not active <= set(self.reduce):
            return []
        released = list(self.reduce.values())
        self.reduce.clear()
        return released

    def expired_reduce(self, now: float) -> list[Parked]:
        """Remove and return the ALL_REDUCE requests past their deadline."""
        return [self.reduce.pop(w) for w, parked in list(self.reduce.items()) if parked.deadline <= now]

    def expired(self, now: float) -> tuple[list[tuple[int, Parked]], list[tuple[int, Parked]], list[Parked]]:
        """Remove and return (pulls by table, creates by table, barrier entries) past their deadline."""
        out: tuple[list[tuple[int, Parked]], list[tuple[int, Parked]], list[Parked]] = ([], [], [])
        for kind, by_table in ((0, self.pulls), (1, self.creates)):
            for table, waiting in by_table.items():
                if any(p.deadline <= now for p in waiting):
                    out[kind].extend((table, p) for p in waiting if p.deadline <= now)  # type: ignore[attr-defined]
                    by_table[table] = [p for p in waiting if p.deadline > now]
        for worker, parked in list(self.barrier.items()):
            if parked.deadline <= now:
                out[2].append(self.barrier.pop(worker))
        return out

    def clear(self) -> list[Parked]:
        everything = list(self)
        self.pulls.clear()
        self.creates.clear()
        self.barrier.clear()
        self.reduce.clear()
        return everything
