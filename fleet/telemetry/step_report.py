"""The maths of fleet's timing reports, shared by the workers and fleetrun (no torch here).

Percentiles from a log-spaced histogram (:class:`LogHistogram`: bins 5 % wide, so p50/p95
are within 2.5 %), the straggler rule (:func:`find_stragglers`, :class:`StragglerTracker`),
the data-parallel speedup condition, the end-of-run report built from every worker's
metrics file (:func:`build_report`) and its table (:func:`report_table`, readable at 80
columns). The worker side (:mod:`fleet.telemetry.timing`) writes the files; fleetrun
(:mod:`fleet.launch.timing`) and, without fleetrun, worker 0 at exit (:func:`report_at_exit`)
read them. Neither side imports the other.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from fleet.storage.atomic import write_text_atomic
from fleet.telemetry import link_report

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
        "step_s_per_step": step_s / steps if steps else None,  # the mean: compute + comm per step add up to it
        "step_p50_s": run["step_p50"],
        "step_p95_s": run["step_p95"],
        "compute_s_per_step": comp / steps if steps else None,
        "comm_s_per_step": comm / steps if steps else None,
        "comm_compute_ratio": comm / comp if comp > 0 else None,
        "samples_per_s": samples / step_s if samples is not None and step_s > 0 else None,
        "dropped_stale": record.get("dropped_stale", 0),
        "restarts": record.get("restarts", 0) if restarts is None else restarts,
        # gradient exchanges with the other workers per optimizer step, and their bytes (fleet.telemetry.timing)
        "reductions": record.get("reductions", 0),
        "reductions_per_step": record.get("reductions", 0) / steps if steps else None,
        "reduced_bytes_per_step": record.get("reduced_bytes", 0) / steps if steps else None,
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
    report = {
        # "backward": no worker called optimizer.step() (weights updated by hand); a "step" is then a backward pass
        "per": "backward" if any(records[r].get("per") == "backward" for r in records) else "step",
        "workers": rows,
        "total_samples_per_s": sum(rates) if rates else None,
        "stragglers": sorted(set(stragglers)),
        "speedup_condition": speedup_condition(comm / steps if steps else 0.0, comp / steps if steps else 0.0, workers),
    }
    links = link_report.link_summary(records)
    if links is not None:  # the workers talked to other hosts: per peer, and the slow link named (link_report)
        report["links"] = links
    return report


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


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def _per_step(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}" if value < 1000 else f"{value:.0f}"


LEGEND = (
    "mean ms per step: step = compute + comm (communication and waiting for peers); p95: 95th "
    "percentile of the step; red: gradient reductions per step (all-reduces, reduce-scatter rounds or "
    "pushes); MB: their megabytes per step; samp/s: samples per second; drop: stale gradients dropped; "
    "rst: restarts"
)


def report_table(report: dict[str, Any]) -> RenderableType:
    """The per-worker table, readable at 80 columns (a log file, a CI console): short headers, a legend."""
    # no column rules: eleven columns fit 80 characters only with two spaces between them
    table = Table(
        title="fleet: where the time went",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        padding=(0, 1, 0, 0),
    )
    for name in ("worker", "steps", "step", "compute", "comm", "p95", "red", "MB", "samp/s", "drop", "rst"):
        table.add_column(name, justify="left" if name == "worker" else "right", no_wrap=True)
    for row in report["workers"]:
        rate = row["samples_per_s"]
        straggler = row["rank"] in report["stragglers"]
        table.add_row(
            Text(f"{row['rank']}" + (" slow" if straggler else ""), style="yellow" if straggler else ""),
            str(row["steps"]),
            _ms(row.get("step_s_per_step")),
            _ms(row["compute_s_per_step"]),
            _ms(row["comm_s_per_step"]),
            _ms(row["step_p95_s"]),
            _per_step(row.get("reductions_per_step")),
            _per_step(None if row.get("reduced_bytes_per_step") is None else row["reduced_bytes_per_step"] / 1e6),
            "-" if rate is None else f"{rate:,.0f}",
            str(row["dropped_stale"]),
            str(row["restarts"]),
        )
    condition = report["speedup_condition"]
    style = {True: "green", False: "bold yellow", None: ""}[condition["holds"]]
    legend = Text(LEGEND + ("; slow: reported as a straggler" if report["stragglers"] else ""), style="dim")
    if report.get("per") == "backward":
        legend.append(
            "; timed per backward pass, from one backward's end to the next: the script never called "
            "optimizer.step() (it updates the weights itself)"
        )
    line = Text(
        f"speedup condition T_sync < (R-1)/R x T_comp with R={condition['workers']}: {condition['verdict']}",
        style=style,
    )
    message = (report.get("links") or {}).get("message")
    if message is None:
        return Group(table, legend, line)
    return Group(table, legend, line, Text(message, style="bold yellow"))


def report_at_exit(rec: Any, rank: int, count: int, wait_s: float = 3.0) -> Path | None:
    """Without fleetrun (python, torchrun, mpirun...): worker 0 writes ``report.json`` at exit.

    It uses the metrics files present in ``$FLEET_LOG_DIR`` (shared by the workers when they
    run on one host or a shared file system), waits up to ``wait_s`` for the other workers'
    final files, and prints the table. Other workers do nothing.
    """
    if rec.log_dir is None or rank != 0:
        return None
    deadline = time.monotonic() + wait_s
    while True:
        records = {r: x for r, x in read_records(rec.log_dir).items() if x.get("steps")}
        if time.monotonic() > deadline or sum(bool(x.get("final")) for x in records.values()) >= count:
            break
        time.sleep(0.1)
    path = rec.log_dir / "report.json"
    report = build_report(records)
    try:
        write_json(path, report)
    except OSError as error:
        print(f"fleet.telemetry.timing: could not write {path}: {error}", file=sys.stderr)
        return None
    Console().print(report_table(report))
    return path
