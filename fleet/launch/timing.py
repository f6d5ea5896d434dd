"""fleetrun's side of "where the time goes": straggler watch while the job runs, report at its end.

Workers write ``<log dir>/metrics/worker-<i>.json`` (see :mod:`fleet.metrics`). While the
job runs, :class:`StragglerWatch` reads them every ``interval`` seconds and applies
:class:`fleet.metrics.StragglerTracker`: a worker whose computation p50 over its last 20
steps exceeds 1.5x the median of the other workers' p50 (and by more than 5 ms) on 2
consecutive checks is reported as ``[fleetrun] straggler: worker 3 ...``.

After every process exited, :func:`final_report` aggregates the workers' last summaries
into ``<log dir>/report.json`` and a rich table (fleetrun does this, so it works in every
mode, for crashed workers too, up to their last periodic write). With several nodes each
node's fleetrun reports the workers it ran. Without fleetrun, :func:`report_at_exit` lets
worker 0 write the same report when ``FLEET_LOG_DIR`` is set. No torch here.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from fleet import metrics


class StragglerWatch:
    """A daemon thread reporting stragglers through ``say(text)``."""

    def __init__(self, log_dir: Path, say, interval: float = 1.0, tracker: metrics.StragglerTracker | None = None):
        self.log_dir = Path(log_dir)
        self.say = say
        self.interval = interval
        self.tracker = tracker or metrics.StragglerTracker()
        self.ever: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fleetrun-stragglers", daemon=True)

    def start(self) -> StragglerWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def check(self) -> dict[int, tuple[float, float]]:
        """One check: read the files, return (and report) new stragglers."""
        records = {r: rec for r, rec in metrics.read_records(self.log_dir).items() if not rec.get("final")}
        found = self.tracker.update(records)
        for rank, (p50, others) in sorted(found.items()):
            self.ever.add(rank)
            steps = records[rank]["window"]["steps"]
            self.say(
                f"straggler: worker {rank} computes {p50 * 1e3:.1f} ms per step (p50 of its last {steps} steps), "
                f"{p50 / others:.1f}x the other workers' median of {others * 1e3:.1f} ms"
            )
        return found

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.check()
            except Exception as error:  # never let the watch take fleetrun down
                self.say(f"straggler watch stopped: {error}")
                return


def clear_metrics(log_dir: Path) -> None:
    """Forget a previous run's metrics files and report in a reused log directory."""
    for path in [*Path(log_dir, "metrics").glob("worker-*.json"), Path(log_dir, "report.json")]:
        path.unlink(missing_ok=True)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def report_table(report: dict[str, Any]) -> RenderableType:
    table = Table(
        title="fleet: where the time went (per worker)", title_justify="left", show_edge=False, pad_edge=False
    )
    for name in (
        "worker",
        "steps",
        "step p50 ms",
        "step p95 ms",
        "compute ms",
        "comm/wait ms",
        "comm/compute",
        "samples/s",
        "stale dropped",
        "restarts",
    ):
        table.add_column(name, justify="left" if name == "worker" else "right")
    for row in report["workers"]:
        ratio = row["comm_compute_ratio"]
        rate = row["samples_per_s"]
        straggler = row["rank"] in report["stragglers"]
        table.add_row(
            Text(f"{row['rank']}" + (" (straggler)" if straggler else ""), style="yellow" if straggler else ""),
            str(row["steps"]),
            _ms(row["step_p50_s"]),
            _ms(row["step_p95_s"]),
            _ms(row["compute_s_per_step"]),
            _ms(row["comm_s_per_step"]),
            "-" if ratio is None else f"{ratio:.2f}",
            "-" if rate is None else f"{rate:,.0f}",
            str(row["dropped_stale"]),
            str(row["restarts"]),
        )
    condition = report["speedup_condition"]
    style = {True: "green", False: "bold yellow", None: ""}[condition["holds"]]
    line = Text(
        f"speedup condition T_sync < (R-1)/R x T_comp with R={condition['workers']}: {condition['verdict']}",
        style=style,
    )
    return Group(table, line)


def final_report(
    log_dir: Path, restarts: dict[int, int] | None = None, stragglers: set[int] | None = None
) -> tuple[dict[str, Any], RenderableType] | None:
    """Write ``report.json`` from the workers' metrics files; None when no worker timed a step."""
    records = {r: rec for r, rec in metrics.read_records(log_dir).items() if rec.get("steps")}
    if not records:
        return None
    report = metrics.build_report(records, restarts, stragglers or ())
    metrics.write_json(Path(log_dir) / "report.json", report)
    return report, report_table(report)


def report_at_exit(rec: metrics.StepMetrics, wait_s: float = 3.0) -> Path | None:
    """Without fleetrun (python, torchrun, mpirun...): worker 0 writes ``report.json`` at exit.

    It uses the metrics files present in ``$FLEET_LOG_DIR`` (shared by the workers when they
    run on one host or a shared file system), waits up to ``wait_s`` for the other workers'
    final files, and prints the table. Other workers do nothing.
    """
    rank, count = metrics.worker_identity()
    if rec.log_dir is None or rank != 0:
        return None
    deadline = time.monotonic() + wait_s
    while True:
        records = {r: x for r, x in metrics.read_records(rec.log_dir).items() if x.get("steps")}
        if time.monotonic() > deadline or sum(bool(x.get("final")) for x in records.values()) >= count:
            break
        time.sleep(0.1)
    path = rec.log_dir / "report.json"
    report = metrics.build_report(records)
    try:
        metrics.write_json(path, report)
    except OSError as error:
        print(f"fleet.metrics: could not write {path}: {error}", file=sys.stderr)
        return None
    Console().print(report_table(report))
    return path
