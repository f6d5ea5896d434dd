"""Slow is not dead: how long a worker waits for its peers to reach the next collective.

A peer that has not reached the next collective is either busy (rank-0-only evaluation or
saving, a long first compilation) or gone. The heartbeats (:mod:`fleet.collective.liveness`)
tell the two apart, so the wait is cut in slices of :data:`PROBE_S`: after each slice the
waiter samples the heartbeats, names a peer silent in two looks in a row (dead or stopped: the
heartbeats' bound, about ``PROBE_S + 2 * liveness.WATCH_S``; one look is not enough, since a live
peer's heartbeat can stand still for one on a starved machine), and otherwise goes on waiting for a live one
until the wait's whole deadline (``DistributedStrategy.collective_wait_s``). Only then does it
give up, saying that the peer is alive and late, and how to wait longer.

Without heartbeats (the script's own process group) the wait is one slice of the whole deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from fleet.errors import PeerError

PROBE_S = 5.0
"""Seconds a collective waits before it first asks the heartbeats whether the late peers live, and between asks."""

RAISE_TIMEOUT = "raise timeout_s (strategy field, or FLEET_TIMEOUT_S)"


class Late(Exception):
    """The wait's deadline passed while the peers named in ``ranks`` (empty: unknown) were alive."""

    def __init__(self, ranks: list[int], waited_s: float):
        super().__init__(f"waited {waited_s:g} s")
        self.ranks = ranks
        self.waited_s = waited_s


def wait_for_peers(
    attempt: Callable[[float], object | None],
    timeout_s: float,
    silent_peers: Callable[[], list[int] | None] | None,
    late_ranks: Callable[[], list[int]] = list,
) -> object:
    """``attempt(seconds)`` until it returns something other than None (None: its slice passed without the peers).

    ``silent_peers``: ranks whose heartbeat stopped (None: the store, hosted by worker 0, is gone); None, or
    ranks in two answers in a row, raises :class:`Dead`. :class:`Late` when ``timeout_s`` passed (``late_ranks()``:
    who had not arrived, where the transport knows).
    """
    started = time.monotonic()
    while True:
        left = timeout_s - (time.monotonic() - started)
        slice_s = min(left, PROBE_S) if silent_peers is not None else left
        result = attempt(max(slice_s, 1e-3))
        if result is not None:
            return result
        waited = time.monotonic() - started
        if waited >= timeout_s or silent_peers is None:
            raise Late(late_ranks(), waited)
        silent = silent_peers()
        if silent:
            # Confirm with a second look: on a starved machine a live peer's heartbeat can stand still for one
            # window, and a peer judged dead here makes this worker give up and exit -- which its peer, alive,
            # then reports as a death (issue 34). A dead or stopped peer stays silent in both.
            silent = silent_peers()
            if silent == []:
                continue
        if silent is None or silent:
            raise Dead(silent)


class Dead(Exception):
    """A heartbeat stopped while waiting (``ranks``; None: the store's host, worker 0, is unreachable)."""

    def __init__(self, ranks: list[int] | None):
        super().__init__("a peer's heartbeat stopped")
        self.ranks = ranks


def late_message(what: str, ranks: list[int], waited_s: float) -> PeerError:
    """The PeerError for a wait whose deadline passed while the heartbeats said every peer lives."""
    who = ", ".join(f"worker {r}" for r in ranks) if ranks else "a worker"
    verb = "are" if len(ranks) > 1 else "is"
    have = "have" if len(ranks) > 1 else "has"
    return PeerError(
        f"{what} failed: {who} {verb} alive but {have} not reached the next collective for {waited_s:.0f} s: "
        f"rank-0-only evaluation or saving? {RAISE_TIMEOUT}"
    )


def deadline_error(
    what: str, late: Late, silent_peers: Callable[[], list[int] | None] | None, diagnose: Callable[[], str | None]
) -> PeerError:
    """The wait's deadline passed: alive and late if every heartbeat still beats, else the heartbeats' diagnosis."""
    if silent_peers is not None and silent_peers() == []:
        return late_message(what, late.ranks, late.waited_s)
    names = ", ".join(f"worker {r}" for r in late.ranks) or "a worker"
    return PeerError.from_collective(
        what, RuntimeError(f"{names} did not arrive within {late.waited_s:g} s"), diagnose()
    )
