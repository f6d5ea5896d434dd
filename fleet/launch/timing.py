"""fleetrun's side of "where the time goes": straggler watch while the job runs, report at its end.

Workers write ``<log dir>/metrics/worker-<i>.json`` (see :mod:`fleet.telemetry.timing`). While the
job runs, :class:`StragglerWatch` reads them every ``interval`` seconds and applies
:class:`fleet.telemetry.step_report.StragglerTracker`: a worker whose computation p50 over its last 20
steps exceeds 1.5x the median of the other workers' p50 (and by more than 5 ms) on 2
consecutive checks is reported as ``[fleetrun] straggler: worker 3 ...``.

After every process exited, :func:`final_report` aggregates the workers' last summaries
into ``<log dir>/report.json`` and a rich table (fleetrun does this, so it works in every
mode, for crashed workers too, up to their last periodic write). With several nodes each
node's fleetrun reports the workers it ran. Without fleetrun, :func:`report_at_exit` lets
worker 0 write the same report when ``FLEET_LOG_DIR`` is set. No torch here.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from rich.console import RenderableType

from fleet.telemetry import step_report


class StragglerWatch:
    """A daemon thread reporting stragglers through ``say(text)``."""

    def __init__(self, log_dir: Path, say, interval: float = 1.0, tracker: step_report.StragglerTracker | None = None):
        self.log_dir = Path(log_dir)
        self.say = say
        self.interval = interval
        self.tracker = tracker or step_report.StragglerTracker()
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
        records = {r: rec for r, rec in step_report.read_records(self.log_dir).items() if not rec.get("final")}
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


NO_REPORT = (
    "no timing report: no worker timed a step. fleet times a step from one optimizer.step() of the wrapped "
    "optimizer to the next, or, in a script that never calls step(), from one backward pass to the next where "
    "gradients are averaged in backward (mode='collective' with several workers, mode='sharding'); a "
    "parameter-server worker sends its gradients in step(), so it must call it."
)
"""What fleetrun says when :func:`final_report` finds nothing to report."""


def final_report(
    log_dir: Path, restarts: dict[int, int] | None = None, stragglers: set[int] | None = None
) -> tuple[dict[str, Any], RenderableType] | None:
    """Write ``report.json`` from the workers' metrics files; None when no worker timed a step (see
    :data:`NO_REPORT`) or a backward pass."""
    records = {r: rec for r, rec in step_report.read_records(log_dir).items() if rec.get("steps")}
    if not records:
        return None
    report = step_report.build_report(records, restarts, stragglers or ())
    step_report.write_json(Path(log_dir) / "report.json", report)
    return report, step_report.report_table(report)
