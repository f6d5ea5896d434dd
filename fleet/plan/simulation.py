"""A discrete-event simulation of parameter-server training: sync, sync with backup workers, async.

The closed-form model (:mod:`fleet.plan.model`) gives mean step times; this follows every
worker and every request, so it captures what means cannot: a straggler that is late in some
steps only, which gradients a backup-worker step drops, how stale an async update is, and a
server that becomes a queue. Its protocol is fleet's (:mod:`fleet.ps.modes`):

- A worker computes a step (log-normal time from the calibration, plus an injected straggler
  delay on chosen ranks), pushes its gradient (``push_s`` on the wire), and the server
  handles pushes one at a time in arrival order (``apply_s`` each: receive and sum, or apply).
- **sync**: a step closes when R - b gradients for it have arrived (b backup workers); the
  server then applies the update (``update_s``), answers the waiting workers' pulls one at a
  time (``pull_service_s`` each) and each gets the new values ``pull_s`` later. A push for a step that is already closed is stale: it is
  dropped and counted, and its worker adopts the current values at once (as fleet's pull
  with ``min_version`` returns immediately) and computes the next step from them.
- **async**: every push is applied on arrival; after pushing, a worker pulls (the pull queues
  behind the pushes before it at the server) and starts its next step with those values. The
  staleness of an update is the number of updates the server applied between the pull its
  gradient was computed from and its own application.

Time to a target loss needs how many updates each mode takes, which a timing simulation
cannot know; :class:`Convergence` states the assumption explicitly (see its docstring).
Deterministic for a given seed. Pure Python.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

from fleet.plan.lognormal import LogNormal


@dataclass(frozen=True)
class SimConfig:
    workers: int
    compute: LogNormal
    """One worker's computation per step."""
    mode: str = "sync"  # "sync" or "async"
    backup: int = 0
    push_s: float = 0.0
    """Worker -> server: latency and transfer of one push."""
    pull_s: float = 0.0
    """Server -> worker: latency and transfer of the values."""
    apply_s: float = 0.0
    """Server time per push (receive and sum in sync, apply in async), one at a time."""
    update_s: float = 0.0
    """sync: server time to apply a closed step's summed gradient."""
    pull_service_s: float = 0.0
    """Server time to answer one pull (sync: after the step closed, one worker at a time)."""
    straggler_ranks: tuple[int, ...] = ()
    straggler_delay: LogNormal | None = None
    """Extra time per step on ``straggler_ranks`` (fleet's injector sleeps it: no CPU used)."""
    steps: int = 200
    """sync: steps to close; async: updates to apply, per worker (R x steps in all)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ("sync", "async"):
            raise ValueError(f"mode must be 'sync' or 'async', got {self.mode!r}")
        if self.workers < 1 or not 0 <= self.backup < self.workers:
            raise ValueError(
                f"workers={self.workers}, backup={self.backup}: need workers >= 1 and 0 <= backup < workers"
            )
        if self.steps < 1:
            raise ValueError(f"steps={self.steps} must be at least 1")


@dataclass
class SimResult:
    config: SimConfig
    time_s: float
    """Simulated wall time until the last step closed (sync) or the last update was applied (async)."""
    versions: int
    """Updates the server applied (sync: steps)."""
    gradients: int
    """Gradients that went into an update."""
    dropped: int
    staleness: float
    """async: mean updates between an update's pull and its application (sync: 0)."""
    worker_steps: list[int] = field(default_factory=list)
    first_update_s: float = 0.0
    """When the first update was applied: the steady-state rate is measured from there on."""

    @property
    def update_s(self) -> float:
        """Wall time per server update (sync: per step), in the steady state after the first one."""
        if self.versions < 2:
            return self.time_s
        return (self.time_s - self.first_update_s) / (self.versions - 1)

    @property
    def gradients_per_update(self) -> float:
        return self.gradients / self.versions


class _Sim:
    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        # One generator per worker, so adding a worker does not change the others' draws.
        self.rngs = [random.Random(f"{cfg.seed}/{w}") for w in range(cfg.workers)]
        self.events: list[tuple[float, int, str, int, int]] = []
        self.seq = 0
        self.server_free = 0.0
        self.version = 0
        self.steps = [0] * cfg.workers
        self.dropped = 0
        self.gradients = 0
        self.now = 0.0
        self.first = 0.0  # when the first update was applied

    def at(self, t: float, kind: str, worker: int, arg: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, worker, arg))

    def serve(self, arrive: float, seconds: float) -> float:
        """The server's FIFO: work arriving at ``arrive`` finishes at the returned time."""
        self.server_free = max(self.server_free, arrive) + seconds
        return self.server_free

    def compute_s(self, worker: int) -> float:
        rng = self.rngs[worker]
        t = self.cfg.compute.sample(rng)
        if self.cfg.straggler_delay is not None and worker in self.cfg.straggler_ranks:
            t += self.cfg.straggler_delay.sample(rng)
        return t

    def start(self, worker: int, version: int) -> None:
        self.at(self.now + self.compute_s(worker), "push", worker, version)


def simulate(cfg: SimConfig) -> SimResult:
    """Run the simulation of ``cfg`` (deterministic for its seed)."""
    return _sync(cfg) if cfg.mode == "sync" else _async(cfg)


def _sync(cfg: SimConfig) -> SimResult:
    sim = _Sim(cfg)
    need = cfg.workers - cfg.backup
    counted = 0
    waiting: list[int] = []
    closing = False
    for w in range(cfg.workers):
        sim.start(w, 0)
    while sim.events and sim.version < cfg.steps:
        sim.now, _, kind, w, v = heapq.heappop(sim.events)
        if kind == "push":  # computation done: the gradient travels to the server
            sim.steps[w] += 1
            sim.at(sim.now + cfg.push_s, "arrive", w, v)
        elif kind == "arrive":
            done = sim.serve(sim.now, cfg.apply_s)
            sim.at(done, "handled", w, v)
        elif kind == "handled":
            if v != sim.version or closing:  # the step closed without it: dropped, adopt the current values
                sim.dropped += 1
                if v == sim.version:  # closed but not applied yet: the pull waits for the update
                    waiting.append(w)
                else:
                    answered = sim.serve(sim.now, cfg.pull_service_s)
                    sim.at(answered + cfg.pull_s, "resume", w, sim.version)
                continue
            counted += 1
            sim.gradients += 1
            waiting.append(w)
            if counted == need:
                closing = True
                sim.at(sim.serve(sim.now, cfg.update_s), "closed", -1, v)
        elif kind == "closed":
            sim.version = v + 1
            sim.first = sim.first if sim.version > 1 else sim.now
            closing, counted = False, 0
            for waiter in waiting:  # every worker pulls the new values; the server answers one at a time
                answered = sim.serve(sim.now, cfg.pull_service_s)
                sim.at(answered + cfg.pull_s, "resume", waiter, sim.version)
            waiting = []
        elif kind == "resume":
            sim.start(w, v)
    return SimResult(cfg, sim.now, sim.version, sim.gradients, sim.dropped, 0.0, sim.steps, sim.first)


def _async(cfg: SimConfig) -> SimResult:
    sim = _Sim(cfg)
    total = cfg.workers * cfg.steps
    read_version = [0] * cfg.workers
    stale_sum = 0
    for w in range(cfg.workers):
        sim.start(w, 0)
    while sim.events and sim.version < total:
        sim.now, _, kind, w, v = heapq.heappop(sim.events)
        if kind == "push":
            sim.steps[w] += 1
            arrive = sim.now + cfg.push_s
            sim.at(sim.serve(arrive, cfg.apply_s), "applied", w, read_version[w])
            # The pull follows the push on the same connection, so it queues behind it.
            sim.at(sim.serve(arrive, cfg.pull_service_s), "pulled", w)
        elif kind == "applied":
            stale_sum += sim.version - v
            sim.version += 1
            sim.first = sim.first if sim.version > 1 else sim.now
            sim.gradients += 1
        elif kind == "pulled":
            read_version[w] = sim.version
            sim.at(sim.now + cfg.pull_s, "resume", w)
        elif kind == "resume":
            sim.start(w, 0)
    staleness = stale_sum / max(1, sim.gradients)
    return SimResult(cfg, sim.now, sim.version, sim.gradients, 0, staleness, sim.steps, sim.first)


@dataclass(frozen=True)
class Convergence:
    """How many updates reach a target loss, in units of the fewest any batch size can (S_min).

    The assumption, stated: McCandlish et al. 2018 ("An empirical model of large-batch
    training") for batch size, plus a delay cost for staleness.

    - A synchronous update averaging n gradients of batch B: ``1 + B_noise / (n B)`` updates
      (steps fall with the batch until it reaches the gradient noise scale B_noise, with the
      learning rate tuned per batch size). Backup workers: n = R - b.
    - An async update of batch B computed on values tau updates old: ``(1 + c tau) + B_noise / B``.
      The noise-limited part is unchanged (each sample's information counts once; Lian et
      al. 2015 show linear speed-up of async SGD while tau is below sqrt(T)); the
      curvature-limited part is stretched by 1 + tau, because gradient descent with delay tau
      is only stable at a learning rate about 1/(1 + tau) of the undelayed one.

    ``noise_scale`` is B_noise / B (the critical batch in units of one worker's batch): small
    for a model early in training or with a tiny learning rate, thousands for ImageNet late in
    training (McCandlish et al.). It cannot be measured from a few seconds of timing, so
    every figure states the value it used. ``staleness_cost`` c scales the delay term,
    ``(1 + c tau)``: 1 is the stability argument above; 0 says staleness is free.
    """

    noise_scale: float
    staleness_cost: float = 1.0

    def sync_updates(self, gradients_per_update: float) -> float:
        return 1.0 + self.noise_scale / gradients_per_update

    def async_updates(self, staleness: float) -> float:
        return 1.0 + self.staleness_cost * staleness + self.noise_scale

    def time_to_loss(self, result: SimResult) -> float:
        """Wall time to the target, in units of S_min x (the time unit of the simulation)."""
        if result.config.mode == "sync":
            return self.sync_updates(result.gradients_per_update) * result.update_s
        return self.async_updates(result.staleness) * result.update_s
