"""The "where the time went" table wherever the job was launched (torchrun, mpirun, srun, plain python).

fleetrun reads every worker's metrics file and prints the table after the job (:mod:`fleet.launch.timing`).
Without fleetrun nobody is left to do that, and the workers may share no directory, so the workers hand
their summaries to worker 0 through the job's rendezvous store instead: each writes its own under a
key of this report, worker 0 waits for them (at most ``wait_s``: a worker that died is left out, and
the table says how many reported) and prints the same table (:func:`fleet.telemetry.step_report.report_table`).

``fleet.report()`` does it on demand (every worker calls it), and ``fleet.init`` arranges it once at the
end of the job, when ``fleet.stop_worker()`` runs or the script exits. ``FLEET_REPORT=0`` turns it off;
under fleetrun the launcher prints instead (never twice); with ``FLEET_LOG_DIR`` set the workers' files
there are used (:func:`fleet.telemetry.step_report.report_at_exit`).
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from typing import Any

from rich.console import Console

from fleet.runtime import env
from fleet.telemetry import step_report, timing

WAIT_S = 10.0
"""How long worker 0 waits for the other workers' summaries."""


def enabled(reader: env.EnvReader | None = None) -> bool:
    """Whether this process prints the job's table itself: not under fleetrun (it prints), not switched off,
    and not when FLEET_LOG_DIR holds the workers' files (the file-based report does it)."""
    reader = reader or env.current()
    return not reader.has(env.FLEET_ROLE) and not reader.has(env.FLEET_LOG_DIR) and reader.flag(env.FLEET_REPORT)


def gather(store: Any, rank: int, count: int, label: str, wait_s: float = WAIT_S) -> dict[str, Any] | None:
    """Every worker's summary to worker 0 through ``store`` (None: one worker), under keys of ``label``;
    worker 0 returns the job's report and prints its table, the others return None."""
    rec = timing.recorder()
    mine = rec.summary(final=True) if rec.timed else None
    records: dict[int, dict[str, Any]] = {}
    if store is not None and count > 1:
        store.set(f"{label}/{rank}", json.dumps(mine).encode())
        if rank != 0:
            return None
        deadline = time.monotonic() + wait_s
        for other in range(1, count):
            key = f"{label}/{other}"
            try:
                store.wait([key], timedelta(seconds=max(deadline - time.monotonic(), 0.01)))
                record = json.loads(bytes(store.get(key)).decode())
            except Exception:  # noqa: BLE001 - a worker that died or is late is left out of the table
                continue
            if record is not None and record.get("steps"):
                records[other] = record
    elif rank != 0:
        return None
    if mine is not None and mine.get("steps"):
        records[rank] = mine
    if not records:
        return None
    report = step_report.build_report(records)
    Console(file=sys.stdout).print(step_report.report_table(report))
    if len(records) < count:
        print(f"fleet: {count - len(records)} of {count} workers timed no step or did not report", flush=True)
    return report
