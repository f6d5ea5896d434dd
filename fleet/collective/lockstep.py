"""Lockstep: before each collective it issues while training, every worker says what it is about to do.

gloo and NCCL pair collectives by the order in which processes issue them, not by what they
are. Two workers that issue different collectives (one is in backward while the other left
its loop early; one froze a layer and the other did not, so their gradient buckets differ)
pair the wrong tensors: a raw gloo abort, a wait until the timeout, or, when the sizes
happen to match, silently mixed data. So before each collective of a training step (a
gradient round, a buffer broadcast, a SparseEmbedding row exchange, a local-SGD average)
and at ``barrier_worker``/``stop_worker`` and a ``fleet.metrics`` reduction, every worker all-gathers a small fixed-size
header: what it is about to do, a fingerprint of its operands, its step count. Headers are
the same size whatever they say, so this exchange always pairs; if the workers disagree,
every one of them raises at once, naming who does what, instead of pairing the wrong data.
The exchange costs one small all-gather (tens of microseconds on loopback) and is itself a
barrier, so ``barrier_worker`` needs nothing more.

Joining (``fleet.join()``, DDP's ``Join`` in fleet's form): a worker whose loop has ended
announces ``JOINED`` instead and, for as long as some worker still trains, learns from the
others' headers which collective comes next and shadows it (contributing nothing). The
workers still training see who is active in every header, so averages divide by the
workers that contributed.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fleet.collective import patience, shm
from fleet.errors import PeerError

ROUND = 1  # gradient round (backward): payload a = layout fingerprint
BUFFERS = 2  # buffer broadcast before a forward of a distributed_model: a = model index
SPARSE_ROWS = 3  # fleet.nn.SparseEmbedding local-table exchange: a = table, b = dim, c = lr bits
AVERAGE = 4  # local SGD parameter average: a = the wrapped optimizer's index
BARRIER = 5
FINISH = 6  # fleet.stop_worker(), or the process exits
JOINED = 7  # this worker's loop ended inside fleet.join(); it shadows the others
PARAMS = 8  # parameters broadcast after add_param_group: a = number of new parameters
REDUCE = 9  # fleet.metrics: all-reduce a float64 vector: a = its length, b = the op's index in REDUCE_OPS
SHARD_FORWARD = 10  # mode="sharding": FSDP2 gathers a module's parameters: a = the module's index
SHARD_BACKWARD = 11  # mode="sharding": a backward after sharded forwards: a = 1 backward, 2 torch.autograd.grad
SHARD_REDUCE = 12  # mode="sharding": FSDP2 reduce-scatters a module's gradients: a = its index, b = which it has
SHARD_STEP = 13  # mode="sharding": an optimizer step: b = which parameters carry a gradient set by hand
TABLE_PULL = 14  # a table sharded across the workers: rows fetched from their owners (forward): a = table, b = dim

TRAINING = (ROUND, BUFFERS, SPARSE_ROWS, AVERAGE, PARAMS, TABLE_PULL)
ENDED = (BARRIER, FINISH, JOINED)

WHAT = {
    ROUND: "all-reduce gradients (backward)",
    BUFFERS: "broadcast model buffers (forward of a distributed_model)",
    SPARSE_ROWS: "exchange fleet.nn.SparseEmbedding rows (optimizer step)",
    AVERAGE: "average parameters (local SGD)",
    BARRIER: "wait in fleet.barrier_worker()",
    FINISH: "stop (fleet.stop_worker() or the end of the script)",
    JOINED: "wait inside fleet.join() with its loop finished",
    PARAMS: "broadcast parameters added with add_param_group",
    REDUCE: "all-reduce a global metric (compute() of a fleet.metrics metric)",
    SHARD_FORWARD: "run the forward of a sharded module",
    SHARD_BACKWARD: "run backward",
    SHARD_REDUCE: "reduce-scatter a sharded module's gradients (backward)",
    SHARD_STEP: "step the optimizer",
    TABLE_PULL: "pull the rows of a fleet.nn.SparseEmbedding sharded across the workers (forward)",
}

REDUCE_OPS = ("sum", "max", "min")  # REDUCE's b, by index: fleet.strategies.base.REDUCE_OPS (tested equal)
_FIELDS = 6  # kind, a, b, c, steps, carried (a value the collective announced takes along: Agreement.carried)
UNEVEN_ADVICE = (
    "The workers ran different numbers of steps (uneven data?). Wrap the training loop in `with fleet.join():` "
    "so that finished workers shadow the others' collectives, or give every worker the same number of batches "
    "(fleet.distributed_loader does)."
)


def float_bits(value: float) -> int:
    """A float carried in an int64 header field, exactly."""
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(bits)))[0]


@dataclass
class Header:
    rank: int
    kind: int
    a: int
    b: int
    c: int
    steps: int

    def says(self) -> str:
        return WHAT.get(self.kind, f"do an unknown collective ({self.kind})")


@dataclass
class Agreement:
    """What every worker announced for this collective."""

    headers: list[Header]
    carried: list[int] = field(default_factory=list)
    """Each worker's value carried with its header (``carry`` of :meth:`Lockstep.start`), by rank: a
    collective whose own meeting is this one (a sharded table's first all-to-all through shared memory)."""

    @property
    def active(self) -> list[int]:
        """Ranks still training (not shadowing inside fleet.join())."""
        return [h.rank for h in self.headers if h.kind != JOINED]

    @property
    def source(self) -> int:
        """The rank whose values a broadcast takes: the lowest one still training."""
        active = self.active
        return active[0] if active else 0

    def leader(self) -> Header:
        return self.headers[self.source]

    def fingerprints_differ(self) -> bool:
        """A gradient round whose workers (shadows included) hold different layouts."""
        fingerprints = {h.a for h in self.headers if h.kind in (ROUND, JOINED)}
        return any(h.kind == ROUND for h in self.headers) and len(fingerprints) > 1


class InFlight:
    """A header exchange :meth:`Lockstep.start` began; :meth:`Lockstep.collect` waits for it."""

    def __init__(self, kind: int, wait: Callable[[float], list[list[int]] | None]):
        self.kind = kind
        self._wait = wait
        self._rows: list[list[int]] | None = None
        self.late: list[int] = []  # who had not arrived when a slice of the wait passed (where known)

    def note_late(self, ranks: list[int]) -> None:
        self.late = ranks

    def wait(self, within_s: float) -> list[list[int]] | None:
        """Every worker's header fields, by rank; None if they are not all there within ``within_s``."""
        if self._rows is None:
            self._rows = self._wait(within_s)
        return self._rows


class Lockstep:
    """Announces collectives over ``group`` (rank = this worker's rank in it).

    Its state changes only through its methods: :meth:`count_step` after an optimizer step,
    :meth:`joining` while shadowing inside ``fleet.join()``, :meth:`adopt_steps` after it,
    :meth:`finish` once at the end, :meth:`take_waited` for the step's timing.
    """

    def __init__(
        self,
        group: Any,
        timeout_s: float,
        diagnose: Callable[[], str | None] | None = None,
        channel: shm.Channel | None = None,
        silent_peers: Callable[[], list[int] | None] | None = None,
    ):
        self.group = group
        self.silent_peers = (
            silent_peers  # the heartbeats: a late peer that lives is waited for (fleet.collective.patience)
        )
        self.channel = channel  # the workers' shared memory on one host: no gloo round trip
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.diagnose = diagnose
        self._timeout = timedelta(seconds=timeout_s)
        # Optimizer steps taken (sharding: backward passes after sharded forwards), carried in every header:
        # for messages and to catch a different number of backwards.
        self._steps = 0
        self._joined = False
        self._finished = False
        self._waited_s = 0.0  # time spent in header exchanges: waiting for peers, reported as communication
        # An exchange started and not yet collected, with what its starter does with the agreement.
        self._in_flight: tuple[InFlight, Callable[[], None]] | None = None

    @property
    def joined(self) -> bool:
        """Inside fleet.join() with this worker's loop finished: it shadows the others."""
        return self._joined

    @property
    def finished(self) -> bool:
        """This worker announced that it stops (:meth:`finish`)."""
        return self._finished

    def count_step(self) -> None:
        self._steps += 1

    def adopt_steps(self, steps: int) -> None:
        """After fleet.join(): this worker continues from the step count of the worker that trained last."""
        self._steps = steps

    @contextmanager
    def joining(self) -> Iterator[None]:
        """While shadowing the others inside fleet.join(): announcements say ``JOINED``."""
        self._joined = True
        try:
            yield
        finally:
            self._joined = False

    def finish(self, within: timedelta | None = None) -> None:
        """Announce that this worker stops, once (later calls do nothing).

        ``within``: wait at most this long for the peers (a process exiting does not wait out the
        whole job timeout for a peer that is gone).
        """
        if self._finished:
            return
        self._finished = True
        if within is not None:
            self._timeout = min(self._timeout, within)
        self.announce(FINISH)

    def take_waited(self) -> float:
        """Seconds spent in header exchanges since the last call."""
        waited, self._waited_s = self._waited_s, 0.0
        return waited

    def exchange(self, kind: int, a: int = 0, b: int = 0, c: int = 0, carry: int = 0) -> Agreement:
        """All-gather the headers; raises PeerError if a peer is gone."""
        return self.collect(self.start(kind, a, b, c, carry=carry))

    def start(
        self,
        kind: int,
        a: int = 0,
        b: int = 0,
        c: int = 0,
        settle: Callable[[], None] | None = None,
        carry: int = 0,
    ) -> InFlight:
        """Send this worker's header and return without waiting; :meth:`collect` gives the agreement.

        So a gradient round's header travels while backward computes, instead of costing a round
        trip at its first gradient (through gloo, about 2 ms of W1's step). ``settle``: what the
        caller does with the agreement; it must run before any other collective of this worker,
        so an exchange started meanwhile (a buffer broadcast of a forward recomputed during
        backward) calls it first, and it must :meth:`collect` this exchange. ``carry``: a value
        every worker sees in :attr:`Agreement.carried`.
        """
        self._settle_in_flight()
        values = [kind, a, b, c, self._steps, carry]
        if self.channel is not None:
            seq = self.channel.post(values)

            def collect(within_s: float) -> list[list[int]] | None:
                try:
                    return self.channel.collect(seq, within_s)  # type: ignore[union-attr]
                except shm.ChannelLate as late:
                    flight.note_late(late.ranks)
                    return None

            flight = InFlight(kind, collect)
        else:
            mine = torch.tensor(values, dtype=torch.int64)
            gathered = torch.empty(self.world * _FIELDS, dtype=torch.int64)
            try:
                work = dist.all_gather_single(gathered, mine, group=self.group, async_op=True)
            except RuntimeError as error:
                raise self._failed(kind, error) from None

            def wait(within_s: float) -> list[list[int]] | None:
                try:
                    work.wait(timedelta(seconds=within_s))
                except RuntimeError:
                    if not work.is_completed():
                        return None  # this slice of the wait passed; the all-gather is still open
                    raise
                return gathered.view(self.world, _FIELDS).tolist()

            flight = InFlight(kind, wait)
        if settle is not None:
            self._in_flight = (flight, settle)
        return flight

    def collect(self, flight: InFlight) -> Agreement:
        """Wait for an exchange :meth:`start` began (once); raises PeerError if a peer is gone."""
        if self._in_flight is not None and self._in_flight[0] is flight:
            self._in_flight = None
        started = time.perf_counter()
        try:
            rows = patience.wait_for_peers(
                flight.wait, self._timeout.total_seconds(), self.silent_peers, lambda: flight.late
            )
        except RuntimeError as error:
            raise self._failed(flight.kind, error) from None
        except patience.Late as late:
            raise patience.deadline_error(self._what(flight.kind), late, self.silent_peers, self._diagnosis) from None
        except patience.Dead:
            raise PeerError.from_collective(self._what(flight.kind), patience.Dead(None), self._diagnosis()) from None
        finally:
            self._waited_s += time.perf_counter() - started
        return Agreement([Header(r, *row[:5]) for r, row in enumerate(rows)], [row[5] for row in rows])

    def _settle_in_flight(self) -> None:
        if self._in_flight is not None:
            _, settle = self._in_flight
            self._in_flight = None
            settle()

    def _what(self, kind: int) -> str:
        return f"agreeing on the next collective ({WHAT[kind]})"

    def _failed(self, kind: int, error: RuntimeError) -> PeerError:
        what = self._what(kind)
        if isinstance(error, shm.ChannelError):
            gone = isinstance(error, shm.PeerGone)
            return PeerError.from_collective(what, error, None if gone else self._diagnosis(), plain=gone)
        return PeerError.from_collective(what, error, self._diagnosis())

    def _diagnosis(self) -> str | None:
        return self.diagnose() if self.diagnose is not None else None

    def announce(
        self,
        kind: int,
        a: int = 0,
        b: int = 0,
        c: int = 0,
        explain: Callable[[Agreement], str] | None = None,
        carry: int = 0,
    ) -> Agreement:
        """Say what this worker does next; return the agreement, or raise if an active worker disagrees.

        ``explain``: called (on every worker, since all see the same headers) when the workers
        agree on the kind but not on the payload ``a``; it may run collectives of its own to
        find out what differs, and returns the message. ``carry``: see :meth:`start`.
        """
        agreement = self.exchange(kind, a, b, c, carry)
        self.check(agreement, kind, a, explain)
        return agreement

    def check(self, agreement: Agreement, kind: int, a: int, explain: Callable[[Agreement], str] | None) -> None:
        headers = agreement.headers
        if kind in TRAINING:
            peers = [h for h in headers if h.kind != JOINED]
            if any(h.kind != kind for h in peers):
                raise PeerError(self._kind_mismatch(agreement))
            # Shadows take part in gradient rounds with their own gradient buckets: their JOINED header
            # carries their layout fingerprint, which must match too.
            compared = headers if kind == ROUND else peers
            if any(h.a != a for h in compared):
                message = explain(agreement) if explain is not None else None
                raise PeerError(message or self._payload_mismatch(agreement))
            if kind == ROUND and len({h.steps for h in peers}) > 1:
                raise PeerError(self._steps_mismatch(agreement))
        elif kind == BARRIER:
            if any(h.kind not in (BARRIER, JOINED) for h in headers):
                raise PeerError(self._kind_mismatch(agreement))
        elif kind == REDUCE:
            if any(h.kind != kind for h in headers):
                raise PeerError(self._kind_mismatch(agreement))
            if any((h.a, h.b) != (headers[0].a, headers[0].b) for h in headers):
                raise PeerError(self._reduce_mismatch(agreement))
        elif any(h.kind != kind for h in headers):
            raise PeerError(self._kind_mismatch(agreement))

    # --- messages ---------------------------------------------------------------------

    def _kind_mismatch(self, agreement: Agreement) -> str:
        groups: dict[int, list[int]] = {}
        for h in agreement.headers:
            groups.setdefault(h.kind, []).append(h.rank)
        parts = [
            f"{workers(ranks)} about to {WHAT.get(kind, kind)} (step {_steps(agreement, ranks)})"
            for kind, ranks in groups.items()
        ]
        text = "Workers issued different collectives: " + "; ".join(parts) + "."
        ended = [h for h in agreement.headers if h.kind in ENDED]
        training = [h for h in agreement.headers if h.kind in TRAINING]
        if any(h.kind == REDUCE for h in agreement.headers):
            text += (
                " A metric's compute() is a collective: every worker calls compute() of the same fleet.metrics "
                "metrics, in the same order, at the same point of its script (for example after its loop)."
            )
        elif ended and training:
            finished = ", ".join(f"worker {h.rank} (after {h.steps} steps)" for h in ended)
            text += f" {finished} finished its training loop early while the others still train. {UNEVEN_ADVICE}"
        elif ended:
            text += " Every worker must call fleet.barrier_worker() and fleet.stop_worker() the same way."
        else:
            text += (
                " Every worker must run the same sequence of forward, backward and optimizer steps (the same "
                "models wrapped with fleet.distributed_model, the same number of backward passes per step)."
            )
        return text

    def _payload_mismatch(self, agreement: Agreement) -> str:
        groups: dict[int, list[int]] = {}
        for h in agreement.headers:
            if h.kind != JOINED:
                groups.setdefault(h.a, []).append(h.rank)
        what = agreement.leader().says()
        return (
            f"Workers disagree about the operands of the next collective ({what}): "
            + " vs ".join(workers(ranks) for ranks in groups.values())
            + ". Every worker must build the same model and train the same parameters."
        )

    def _reduce_mismatch(self, agreement: Agreement) -> str:
        groups: dict[tuple[int, int], list[int]] = {}
        for h in agreement.headers:
            groups.setdefault((h.a, h.b), []).append(h.rank)
        parts = [
            f"{workers(ranks)} reducing {n} values by {REDUCE_OPS[op] if 0 <= op < len(REDUCE_OPS) else op}"
            for (n, op), ranks in groups.items()
        ]
        return (
            "Workers disagree about the global metric they compute: " + ", ".join(parts) + ". Every worker must "
            "call compute() of the same fleet.metrics metrics (same kind, same num_thresholds), in the same order."
        )

    def _steps_mismatch(self, agreement: Agreement) -> str:
        parts = [f"worker {h.rank} is at optimizer step {h.steps}" for h in agreement.headers if h.kind != JOINED]
        return (
            "Workers are out of step: " + ", ".join(parts) + " when all-reducing gradients: one ran more "
            "backward passes before its optimizer step than the other. Every worker must run the same number of "
            f"backward passes per step. {UNEVEN_ADVICE}"
        )


def workers(ranks: list[int]) -> str:
    return ("worker " if len(ranks) == 1 else "workers ") + ", ".join(str(r) for r in ranks)


def _steps(agreement: Agreement, ranks: list[int]) -> str:
    return "/".join(sorted({str(agreement.headers[r].steps) for r in ranks}))
