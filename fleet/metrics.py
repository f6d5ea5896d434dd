"""Where the time goes: per-step timing on every worker, straggler rule, end-of-run report math.

Worker side (:class:`StepMetrics`, one per process, :func:`recorder`). Every wrapped
optimizer calls ``_end_step`` once per optimizer step (see :mod:`fleet.optimizer`),
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
  ``fleet.distributed_loader``; unknown (samples/s reported as null) without either.
- stale gradients dropped: :meth:`StepMetrics.add_dropped` / :meth:`StepMetrics.set_dropped`.
- restarts: ``FLEET_RESTART_COUNT``.

The hot path costs two ``perf_counter`` calls, a few additions and two ``math.log``. At most
every :data:`WRITE_EVERY_S` seconds (checked at a step boundary), and at interpreter exit,
the worker writes its summary to ``$FLEET_LOG_DIR/metrics/worker-<i>.json`` (temporary
file + ``os.replace``, so readers never see half a file). Run-long percentiles come from
a log-spaced histogram (bins 5 % wide, so p50/p95 are within 2.5 %); the straggler window
keeps the last :data:`WINDOW_STEPS` steps exactly.

This module imports neither torch nor pydantic: fleetrun (:mod:`fleet.launch.timing`)
reads the files with :func:`read_records` and applies :class:`StragglerTracker` and
:func:`build_report`.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import sys
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fleet import context, env
from fleet.atomic import write_text_atomic

WINDOW_STEPS = 20
WRITE_EVERY_S = 1.0
_BIN = math.log(1.05)
_FLOOR_S = 1e-6


class LogHistogram:
    """Counts of positive durations in bins 5 % wide; percentiles within 2.5 %."""

    def __init__(self, counts: dict[int, int] | None = None):
        self.counts: dict[int, int] = dict(counts or {})
        self.n = sum(self.counts.values())

    def add(self, seconds: float) -> None:
        index = int(math.log(max(seconds, _FLOOR_S) / _FLOOR_S) / _BIN)
        self.counts[index] = self.counts.get(index, 0) + 1
        self.n += 1

    def percentile(self, q: float) -> float | None:
        if not self.n:
            return None
        rank, seen = q / 100.0 * self.n, 0
        for index in sorted(self.counts):
            seen += self.counts[index]
            if seen >= rank:
                return _FLOOR_S * math.exp((index + 0.5) * _BIN)
        return None


def _percentile(values: Iterable[float], q: float) -> float | None:
    ordered = sorted(values)
    if not ordered:
        return None
    position = (len(ordered) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def median(values: Iterable[float]) -> float | None:
    return _percentile(values, 50)


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
        self.total = {"step": 0.0, "compute": 0.0, "comm": 0.0}
        self.hist = {name: LogHistogram() for name in self.total}
        self.window: deque[tuple[float, float, float]] = deque(maxlen=WINDOW_STEPS)
        self._comm = 0.0
        self._last: float | None = None
        self._written = 0.0

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

    def set_batch_size(self, n: int, *, inferred: bool = False) -> None:
        if inferred and self._batch_explicit:
            return
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"fleet.metrics.set_batch_size(n) needs a positive int, got {n!r}.")
        self.batch_size, self._batch_explicit = n, self._batch_explicit or not inferred

    def end_step(self, micro_batches: int = 1) -> None:
        """Close the current step: called by the wrapped optimizer at every step boundary."""
        now = self._clock()
        if self._last is None:
            self._last, self._comm, self._written = now, 0.0, now
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

    # --- what fleetrun reads ------------------------------------------------------

    def summary(self, final: bool = False) -> dict[str, Any]:
        if self.rank is None:
            self.rank = worker_identity()[0]
        window = list(self.window)
        run: dict[str, Any] = {f"{name}_s_total": round(value, 6) for name, value in self.total.items()}
        for name, hist in self.hist.items():
            run[f"{name}_p50"] = hist.percentile(50)
            run[f"{name}_p95"] = hist.percentile(95)
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "time": time.time(),
            "final": final,
            "steps": self.steps,
            "samples": self.samples if self.batch_size is not None else None,
            "batch_size": self.batch_size,
            "dropped_stale": self.dropped_stale,
            "restarts": self.restarts,
            "window": {
                "steps": len(window),
                "step_p50": median(w for w, _, _ in window),
                "compute_p50": median(c for _, c, _ in window),
                "comm_p50": median(m for _, _, m in window),
            },
            "run": run,
        }

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
            print(f"fleet.metrics: could not write {path}: {error}", file=sys.stderr)
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
    if _recorder is not None and _recorder.steps:
        _recorder.write(final=True)
        if not env.current().has(env.FLEET_ROLE):  # fleetrun reports itself after every worker exited
            from fleet.launch.timing import report_at_exit

            report_at_exit(_recorder)


def set_batch_size(n: int) -> None:
    """Samples per step on this worker (per micro-batch with gradient accumulation), for samples/s."""
    recorder().set_batch_size(n)


# --- straggler rule (pure) -----------------------------------------------------------

STRAGGLER_RATIO = 1.5
STRAGGLER_MIN_GAP_S = 0.005
STRAGGLER_CHECKS = 2
STRAGGLER_MIN_STEPS = 5


def find_stragglers(
    compute_p50: dict[int, float], ratio: float = STRAGGLER_RATIO, min_gap_s: float = STRAGGLER_MIN_GAP_S
) -> dict[int, tuple[float, float]]:
    """Workers whose computation p50 exceeds ``ratio`` x the median of the other workers' p50.

    The rule compares *computation* (step time minus communication/wait), not wall step
    time: in sync training every worker waits for the slowest one, so wall step times
    are equal and only the straggler's own work stands out. ``min_gap_s`` keeps
    micro-second noise on tiny steps from counting. Returns {rank: (p50, others' median)}.
    """
    found = {}
    for rank, value in compute_p50.items():
        others = median(v for r, v in compute_p50.items() if r != rank)
        if others is not None and value > ratio * others and value - others > min_gap_s:
            found[rank] = (value, others)
    return found


class StragglerTracker:
    """Applies :func:`find_stragglers` to successive checks; a rank is reported after
    ``checks`` consecutive flagged checks, once per episode (again after it recovered)."""

    def __init__(
        self,
        ratio: float = STRAGGLER_RATIO,
        min_gap_s: float = STRAGGLER_MIN_GAP_S,
        checks: int = STRAGGLER_CHECKS,
        min_steps: int = STRAGGLER_MIN_STEPS,
    ):
        self.ratio, self.min_gap_s, self.checks, self.min_steps = ratio, min_gap_s, checks, min_steps
        self.streak: dict[int, int] = {}
        self.reported: set[int] = set()

    def update(self, records: dict[int, dict[str, Any]]) -> dict[int, tuple[float, float]]:
        """Feed the workers' current summaries; return the ranks to report now."""
        p50 = {
            rank: r["window"]["compute_p50"]
            for rank, r in records.items()
            if r["window"]["steps"] >= self.min_steps and r["window"]["compute_p50"] is not None
        }
        flagged = find_stragglers(p50, self.ratio, self.min_gap_s) if len(p50) >= 2 else {}
        new = {}
        for rank in list(self.streak) + list(flagged):
            if rank not in flagged:
                self.streak.pop(rank, None)
                self.reported.discard(rank)
                continue
            self.streak[rank] = self.streak.get(rank, 0) + 1
            if self.streak[rank] >= self.checks and rank not in self.reported:
                self.reported.add(rank)
                new[rank] = flagged[rank]
        return new


# --- end-of-run report (pure) ----------------------------------------------------------


def speedup_condition(t_sync: float, t_comp: float, workers: int) -> dict[str, Any]:
    """Check T_sync < (R-1)/R x T_comp for R data-parallel workers.

    T_comp is the computation per step and T_sync the communication / wait per step, both
    averaged over steps and workers. Read T_comp as the time one process needs for the
    work a step does, and R workers share it: they take T_comp/R + T_sync, which beats
    the single process exactly when T_sync < (R-1)/R x T_comp. With T_comp measured per
    worker on its own share (fleet's numbers, weak scaling) the same inequality says the
    parallel efficiency T_comp/(T_comp+T_sync) exceeds R/(2R-1) (2/3 for two workers, 1/2
    for many): the workers deliver at least about half their ideal R-fold throughput.
    With one worker there is nothing to check (verdict "n/a").
    """
    bound = (workers - 1) / workers * t_comp if workers > 0 else 0.0
    step = t_comp + t_sync
    out = {
        "workers": workers,
        "t_sync_s": t_sync,
        "t_comp_s": t_comp,
        "bound_s": bound,
        "holds": None if workers < 2 else t_sync < bound,
        "efficiency": t_comp / step if step > 0 else None,
    }
    if workers < 2:
        out["verdict"] = "n/a: one worker, no data parallelism"
    elif out["holds"]:
        out["verdict"] = f"holds: T_sync {t_sync * 1e3:.1f} ms < {bound * 1e3:.1f} ms = (R-1)/R x T_comp; scaling pays"
    else:
        out["verdict"] = (
            f"fails: T_sync {t_sync * 1e3:.1f} ms >= {bound * 1e3:.1f} ms = (R-1)/R x T_comp; communication "
            "dominates (larger batches, fewer or faster links, gradient compression or local SGD help)"
        )
    return out


def worker_row(record: dict[str, Any], restarts: int | None = None) -> dict[str, Any]:
    """One worker's line of the report from its metrics file."""
    run, steps = record["run"], record["steps"]
    step_s = run["step_s_total"]
    comp, comm = run["compute_s_total"], run["comm_s_total"]
    samples = record.get("samples")
    return {
        "rank": record["rank"],
        "steps": steps,
        "step_p50_s": run["step_p50"],
        "step_p95_s": run["step_p95"],
        "compute_s_per_step": comp / steps if steps else None,
        "comm_s_per_step": comm / steps if steps else None,
        "comm_compute_ratio": comm / comp if comp > 0 else None,
        "samples_per_s": samples / step_s if samples is not None and step_s > 0 else None,
        "dropped_stale": record.get("dropped_stale", 0),
        "restarts": record.get("restarts", 0) if restarts is None else restarts,
    }


def build_report(
    records: dict[int, dict[str, Any]], restarts: dict[int, int] | None = None, stragglers: Iterable[int] = ()
) -> dict[str, Any]:
    """The job's report from each worker's last summary (``restarts`` from the launcher wins)."""
    restarts = restarts or {}
    rows = [worker_row(records[r], restarts.get(r)) for r in sorted(records)]
    steps = sum(records[r]["steps"] for r in records)
    comp = sum(records[r]["run"]["compute_s_total"] for r in records)
    comm = sum(records[r]["run"]["comm_s_total"] for r in records)
    rates = [row["samples_per_s"] for row in rows if row["samples_per_s"] is not None]
    workers = len(records)
    return {
        "workers": rows,
        "total_samples_per_s": sum(rates) if rates else None,
        "stragglers": sorted(set(stragglers)),
        "speedup_condition": speedup_condition(comm / steps if steps else 0.0, comp / steps if steps else 0.0, workers),
    }


def read_records(log_dir: str | Path) -> dict[int, dict[str, Any]]:
    """Every worker's latest summary under ``log_dir/metrics``; unreadable files are skipped."""
    records = {}
    for path in sorted(Path(log_dir, "metrics").glob("worker-*.json")):
        try:
            record = json.loads(path.read_text())
            records[int(record["rank"])] = record
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return records


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (temporary file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(data, indent=2))
