"""Where the time goes: per-step timing on every worker (the maths of the reports: :mod:`fleet.telemetry.step_report`).

Worker side (:class:`StepMetrics`, one per process, :func:`recorder`). Every wrapped
optimizer calls ``_end_step`` once per optimizer step (see :mod:`fleet.training.optimizer`),
which calls :meth:`StepMetrics.end_step`. A step is the time between two consecutive
step boundaries, so it covers the whole training-loop iteration (data, forward,
backward, communication, update); the first boundary only starts the clock.

- communication / wait: seconds the strategy reports with :meth:`StepMetrics.add_comm`
  (collective: waiting for the gradient all-reduces at the end of backward, and local-SGD
  averaging; parameter server: waiting for pushes and pulls).
- computation: step time minus communication / wait. An injected straggler delay counts
  as computation: it is this worker's own slowness.
- samples: ``batch_size x micro-batches`` per step. The batch size is the one given to
  :func:`set_batch_size`, otherwise the ``batch_size`` of the DataLoader passed to
  ``fleet.distributed_loader`` (for items that are whole batches: each batch's first
  dimension, :mod:`fleet.data.whole_batches`); unknown (samples/s reported as null) without either.
- stale gradients dropped: :meth:`StepMetrics.add_dropped` / :meth:`StepMetrics.set_dropped`.
- gradient reductions: :meth:`StepMetrics.add_reduction`, once per exchange of a step's gradients with
  the other workers (collective: a gradient round's all-reduce; sharding: a backward's reduce-scatters;
  parameter server: a push), with its bytes, so the report shows reductions per optimizer step: one
  with gradient accumulation done right, one per micro-batch when accumulation still communicates.
- restarts: ``FLEET_RESTART_COUNT``.
- links to other hosts: bytes and link time per peer host (or parameter server) from the kernel's TCP
  counters (:mod:`fleet.telemetry.links`), read when the summary is written, never per step; from the first
  step boundary on. Absent when the worker talks to no other host.
- listeners: :meth:`StepMetrics.subscribe` calls a function at every step boundary, with the step just
  timed (``fleet.plan.probe`` reads a script's steps this way, the recorder left as it is).
- a script that never calls ``step()`` (weights updated by hand, ``p.data.add_(p.grad, alpha=-lr)``)
  is timed per backward instead: strategies that reduce gradients in backward call
  :meth:`StepMetrics.end_backward` at its end, and the summary says ``"per": "backward"``.

The hot path costs two ``perf_counter`` calls, a few additions and two ``math.log``. At most
every :data:`WRITE_EVERY_S` seconds (checked at a step boundary), and at interpreter exit,
the worker writes its summary to ``$FLEET_LOG_DIR/metrics/worker-<i>.json`` (temporary
file + ``os.replace``, so readers never see half a file). Run-long percentiles come from
a log-spaced histogram (bins 5 % wide, so p50/p95 are within 2.5 %); the straggler window
keeps the last :data:`WINDOW_STEPS` steps exactly.

This module imports neither torch nor pydantic: fleetrun (:mod:`fleet.launch.timing`)
reads the files and applies the rules of :mod:`fleet.telemetry.step_report`.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fleet.runtime import context, env
from fleet.storage.atomic import write_text_atomic
from fleet.telemetry import links, step_report
from fleet.telemetry.step_report import LogHistogram, median

WINDOW_STEPS = 20
WRITE_EVERY_S = 1.0

StepListener = Callable[[tuple[float, float, float] | None], None]
"""Told of every step boundary: the step's ``(wall, compute, comm)`` seconds, None at the first one."""


def worker_identity() -> tuple[int, int]:
    """(worker index, worker count): from ``fleet.init``'s context if any, else the launcher's variables."""
    job = context.current()
    if job is not None:
        return job.role.worker_index, job.role.worker_num
    reader = env.current()
    for index, count in (
        (env.FLEET_WORKER_INDEX, env.FLEET_WORKER_NUM),
        (env.PADDLE_TRAINER_ID, env.PADDLE_TRAINERS_NUM),
        (env.RANK, env.WORLD_SIZE),
        (env.OMPI_COMM_WORLD_RANK, env.OMPI_COMM_WORLD_SIZE),
        (env.PMI_RANK, env.PMI_SIZE),
        (env.SLURM_PROCID, env.SLURM_NTASKS),
    ):
        if reader.has(index):
            return reader.int(index, 0) or 0, reader.int(count, 1) or 1
    return 0, 1


class StepMetrics:
    """This worker's step timings. Strategies feed it; see the module docstring."""

    def __init__(
        self,
        log_dir: str | Path | None = None,
        *,
        rank: int | None = None,
        restarts: int = 0,
        write_every_s: float = WRITE_EVERY_S,
        clock: Any = time.perf_counter,
        count_links: bool = True,
    ):
        self.log_dir = Path(log_dir) if log_dir else None
        self.rank = rank
        self.restarts = restarts
        self.write_every_s = write_every_s
        self._clock = clock
        self.batch_size: int | None = None
        self._batch_explicit = False
        self.steps = 0
        self.samples = 0
        self.dropped_stale = 0
        self.reductions = 0  # in the timed steps (after the first boundary), like every other figure here
        self.reduced_bytes = 0
        self.all_reductions = 0  # since the process started, the first step's included
        self.total = {"step": 0.0, "compute": 0.0, "comm": 0.0}
        self.hist = {name: LogHistogram() for name in self.total}
        self.window: deque[tuple[float, float, float]] = deque(maxlen=WINDOW_STEPS)
        self._comm = 0.0
        self._last: float | None = None
        self._written = 0.0
        self._per_backward: StepMetrics | None = None  # boundaries at each backward, for scripts without step()
        self._count_links = count_links
        self._links: links.LinkCounters | None = None  # from the first boundary (step or backward) on
        self._listeners: list[StepListener] = []

    # --- what strategies and users call ------------------------------------------

    def add_comm(self, seconds: float) -> None:
        """Seconds of the current step spent communicating or waiting for peers."""
        self._comm += seconds

    def add_dropped(self, count: int = 1) -> None:
        """Stale gradients of this worker that were dropped."""
        self.dropped_stale += count

    def set_dropped(self, total: int) -> None:
        """The running total of this worker's dropped stale gradients (e.g. a client's counter)."""
        self.dropped_stale = int(total)

    def add_reduction(self, nbytes: int = 0) -> None:
        """One exchange of gradients with the other workers (an all-reduce round, a backward's reduce-scatters,
        a push to the servers), of ``nbytes`` gradient bytes."""
        self.reductions += 1
        self.reduced_bytes += int(nbytes)
        self.all_reductions += 1

    def set_batch_size(self, n: int, *, inferred: bool = False) -> None:
        if inferred and self._batch_explicit:
            return
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"fleet.telemetry.timing.set_batch_size(n) needs a positive int, got {n!r}.")
        self.batch_size, self._batch_explicit = n, self._batch_explicit or not inferred

    def subscribe(self, listener: StepListener) -> None:
        """Call ``listener`` at the end of every step boundary from now on (until :meth:`unsubscribe`): with
        the step just timed as ``(wall, compute, comm)`` seconds, or None at the first boundary, which
        only starts the clock."""
        self._listeners.append(listener)

    def unsubscribe(self, listener: StepListener) -> None:
        self._listeners = [known for known in self._listeners if known != listener]  # a bound method is made anew

    def end_step(self, micro_batches: int = 1) -> None:
        """Close the current step: called by the wrapped optimizer at every step boundary."""
        now = self._clock()
        if self._last is None:  # the first boundary starts the clock: what came before it is not a timed step
            self._last, self._comm, self._written = now, 0.0, now
            self.reductions = self.reduced_bytes = 0
            self._mark_links()
            for listener in list(self._listeners):
                listener(None)
            return
        wall = now - self._last
        comm = min(self._comm, wall)
        compute = wall - comm
        self._last, self._comm = now, 0.0
        self.steps += 1
        if self.batch_size is not None:
            self.samples += self.batch_size * micro_batches
        for name, value in (("step", wall), ("compute", compute), ("comm", comm)):
            self.total[name] += value
            self.hist[name].add(value)
        self.window.append((wall, compute, comm))
        if self.log_dir is not None and now - self._written >= self.write_every_s:
            self._written = now
            self.write()
        for listener in list(self._listeners):
            listener((wall, compute, comm))

    def end_backward(self, comm_s: float = 0.0) -> None:
        """A backward pass ended, after ``comm_s`` seconds of communication since the previous one (strategies
        call it where gradients are reduced in backward). Timed per backward only while no optimizer step
        was: a script that updates its weights by hand, never calling ``step()``, still gets its report."""
        if self._last is not None:  # a step boundary was seen: the job is timed per step
            return
        if self._per_backward is None:
            self._per_backward = StepMetrics(
                rank=self.rank, restarts=self.restarts, clock=self._clock, count_links=False
            )
            self._mark_links()
        if self.batch_size is not None:
            self._per_backward.set_batch_size(self.batch_size)
        self._per_backward.add_comm(comm_s)
        self._per_backward.end_step()
        now = self._clock()
        if self.log_dir is not None and now - self._written >= self.write_every_s:
            self._written = now
            self.write()

    @property
    def timed(self) -> bool:
        """Whether there is anything to report: an optimizer step, or else a backward pass, was timed."""
        return bool(self.steps or (self._last is None and self._per_backward is not None and self._per_backward.steps))

    def _mark_links(self) -> None:
        """Start counting the links to other hosts here: what crossed them before is not a timed step's."""
        if not self._count_links:
            return
        job = context.current()
        servers = frozenset(job.role.server_endpoints) if job is not None else frozenset()
        self._links = links.LinkCounters(servers)
        self._links.mark()

    def _link_peers(self, final: bool) -> dict[str, Any]:
        if self._links is None:
            return {}
        self._links.sample(force=final)
        return self._links.peers()

    # --- what fleetrun reads ------------------------------------------------------

    def summary(self, final: bool = False) -> dict[str, Any]:
        if self.rank is None:
            self.rank = worker_identity()[0]
        peers = self._link_peers(final)
        if self._last is None and self._per_backward is not None and self._per_backward.steps:
            by_backward = self._per_backward.summary(final)
            by_backward.update(rank=self.rank, dropped_stale=self.dropped_stale, restarts=self.restarts)
            by_backward.update(reductions=self.reductions, reduced_bytes=self.reduced_bytes)
            if peers:
                by_backward["links"] = peers
            return {**by_backward, "per": "backward"}
        window = list(self.window)
        run: dict[str, Any] = {f"{name}_s_total": round(value, 6) for name, value in self.total.items()}
        for name, hist in self.hist.items():
            run[f"{name}_p50"] = hist.percentile(50)
            run[f"{name}_p95"] = hist.percentile(95)
        out = {
            "rank": self.rank,
            "pid": os.getpid(),
            "time": time.time(),
            "final": final,
            "per": "step",
            "steps": self.steps,
            "samples": self.samples if self.batch_size is not None else None,
            "batch_size": self.batch_size,
            "dropped_stale": self.dropped_stale,
            "restarts": self.restarts,
            "reductions": self.reductions,
            "reduced_bytes": self.reduced_bytes,
            "window": {
                "steps": len(window),
                "step_p50": median(w for w, _, _ in window),
                "compute_p50": median(c for _, c, _ in window),
                "comm_p50": median(m for _, _, m in window),
            },
            "run": run,
        }
        if peers:  # only where the worker talks to other hosts: a one-host job's summary is as it was
            out["links"] = peers
        return out

    def path(self) -> Path | None:
        if self.log_dir is None:
            return None
        if self.rank is None:
            self.rank = worker_identity()[0]
        return self.log_dir / "metrics" / f"worker-{self.rank}.json"

    def write(self, final: bool = False) -> Path | None:
        """Write the summary atomically; never raises (metrics must not kill training)."""
        path = self.path()
        if path is None:
            return None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(path, json.dumps(self.summary(final)))
        except OSError as error:
            print(f"fleet.telemetry.timing: could not write {path}: {error}", file=sys.stderr)
            return None
        return path


_recorder: StepMetrics | None = None


def recorder() -> StepMetrics:
    """This process's :class:`StepMetrics`, writing under ``$FLEET_LOG_DIR`` if set."""
    global _recorder
    if _recorder is None:
        reader = env.current()
        _recorder = StepMetrics(reader.str(env.FLEET_LOG_DIR), restarts=reader.int(env.FLEET_RESTART_COUNT, 0) or 0)
        atexit.register(_final_write)
    return _recorder


def _final_write() -> None:
    if _recorder is not None and _recorder.timed:
        _recorder.write(final=True)
        reader = env.current()
        if not reader.has(env.FLEET_ROLE) and reader.flag(env.FLEET_REPORT):  # fleetrun reports after the job
            step_report.report_at_exit(_recorder, *worker_identity())


def set_batch_size(n: int) -> None:
    """Samples per step on this worker (per micro-batch with gradient accumulation), for samples/s."""
    recorder().set_batch_size(n)
