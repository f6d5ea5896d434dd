"""Files a worker leaves in fleetrun's log directory, for the launcher to read (no torch here).

``<log dir>/joined/worker-<i>``: worker ``i`` called ``fleet.init()``. fleetrun's summary
names the workers of a multi-worker job that finished without it: they trained on their
own, not as one job, and would otherwise look like a success.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

JOINED = "joined"
_NAME = re.compile(r"^worker-(\d+)$")


def mark_joined(log_dir: str | Path, worker_index: int) -> None:
    path = Path(log_dir, JOINED, f"worker-{worker_index}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(str(os.getpid()))
    except OSError:
        pass  # only the summary's note depends on it


def joined_workers(log_dir: str | Path) -> set[int]:
    try:
        names = os.listdir(Path(log_dir, JOINED))
    except OSError:
        return set()
    return {int(m.group(1)) for m in map(_NAME.match, names) if m}


def clear_joined(log_dir: str | Path) -> None:
    for index in joined_workers(log_dir):
        Path(log_dir, JOINED, f"worker-{index}").unlink(missing_ok=True)
