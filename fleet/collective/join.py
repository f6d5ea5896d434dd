"""``with fleet.join():``: uneven data in collective mode (DDP's ``Join``, in fleet's form).

Without it, a worker whose loop ends before the others' makes them fail (within one step,
naming it: see :mod:`fleet.collective.lockstep`). Inside it, a worker whose loop has ended
waits at the end of the block and shadows the collectives of the workers still training:
it learns from their headers what comes next (a gradient round, a buffer broadcast, a
SparseEmbedding row exchange, a local-SGD average, a barrier) and takes part contributing
nothing, so averages are over the workers that still have data (the single-process
gradient of the union of the batches of that step). When every worker has finished,
every worker takes the parameters, buffers and optimizer state (learning rates included)
of the lowest-ranked worker that trained last, so all leave the block identical.
"""

from __future__ import annotations

import gc
from typing import Any, Protocol

from fleet.collective import lockstep
from fleet.collective.grad_sync import GradSync
from fleet.errors import PeerError


class Shadowing(Protocol):
    """What a finished worker needs from the strategy it trains with (the collective strategy)."""

    def sync(self) -> GradSync:
        """The job's gradient synchroniser, whose lockstep and layout the shadow follows."""
        ...

    def shadow(self, leader: lockstep.Header, agreement: lockstep.Agreement) -> None:
        """Take part, contributing nothing, in the collective the workers still training announced."""
        ...

    def adopt_state(self, source: int) -> None:
        """Take worker ``source``'s parameters, buffers and optimizer state."""
        ...


class Join:
    """The context manager ``fleet.join()`` returns in collective mode."""

    def __init__(self, strategy: Shadowing):
        self.strategy = strategy

    def __enter__(self) -> Join:
        return self

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> bool:
        if kind is None:
            self.shadow()
        return False

    def shadow(self) -> None:
        strategy = self.strategy
        sync = strategy.sync()
        lock = sync.lockstep
        if lock is None:
            return
        with lock.joining():
            while True:
                layout = sync.refresh()
                agreement = lock.exchange(lockstep.JOINED, a=layout.fingerprint)
                active = [agreement.headers[r] for r in agreement.active]
                if not active:
                    break
                kinds = {h.kind for h in active}
                leader = agreement.leader()
                if len(kinds) > 1 or leader.kind not in SHADOWED:
                    raise PeerError(
                        f"{_who(active)} about to {leader.says()} while worker {lock.rank} waits inside fleet.join() "
                        "with its loop finished; inside fleet.join() the others may only train (forward, backward, "
                        "optimizer steps) or wait in fleet.barrier_worker()."
                    )
                if leader.kind == lockstep.ROUND and agreement.fingerprints_differ():
                    gc.collect()  # as the workers still training do (GradSync._agree), then compare again
                    layout = sync.refresh()
                    agreement = lock.exchange(lockstep.JOINED, a=layout.fingerprint)
                    if agreement.fingerprints_differ():
                        raise PeerError(sync.explain_layout(agreement))
                strategy.shadow(leader, agreement)
        # Every worker saw the same last headers: whoever took the most steps trained last.
        steps = [h.steps for h in agreement.headers]
        lock.adopt_steps(max(steps))
        if min(steps) != max(steps):
            strategy.adopt_state(steps.index(max(steps)))


# TABLE_PULL too: the strategy's shadow says why a sharded table cannot be shadowed (its rows live on every worker)
SHADOWED = (
    lockstep.ROUND,
    lockstep.BUFFERS,
    lockstep.SPARSE_ROWS,
    lockstep.AVERAGE,
    lockstep.BARRIER,
    lockstep.TABLE_PULL,
)


def _who(headers: list[lockstep.Header]) -> str:
    ranks = [h.rank for h in headers]
    return ("worker " if len(ranks) == 1 else "workers ") + ", ".join(str(r) for r in ranks)
