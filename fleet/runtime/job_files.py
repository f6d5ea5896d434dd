"""Files a job's workers leave behind for the launcher (no torch here).

``<log dir>/joined/worker-<i>``: worker ``i`` called ``fleet.init()``. fleetrun's summary
names the workers of a multi-worker job that finished without it: they trained on their
own, not as one job, and would otherwise look like a success.

``/dev/shm/<prefix>-*``: the shared-memory segments of workers on one host
(:mod:`fleet.collective.shm`). Workers unlink them as soon as every worker has mapped
them; a process killed in that moment would leave one, so fleetrun removes what is left
under the job's prefix when the job ends. The prefix is derived from the job's secret,
without revealing it.
"""

from __future__ import annotations

import glob
import hashlib
import hmac
import os
import re
from pathlib import Path

from fleet.runtime import env

SHM_DIR = "/dev/shm"

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


def shm_prefix(secret_hex: str | None = None) -> str:
    """``fleet-<16 hex>``: this job's shared-memory names (a fixed ``fleet-local`` without a secret)."""
    secret_hex = secret_hex if secret_hex is not None else env.current().str(env.FLEET_SECRET)
    if not secret_hex:
        return "fleet-local"
    digest = hmac.new(secret_hex.encode(), b"fleet-shared-memory", hashlib.sha256).hexdigest()
    return f"fleet-{digest[:16]}"


def remove_shm(secret_hex: str) -> list[str]:
    """Remove whatever segments of this job are left in /dev/shm; return their paths."""
    removed = []
    for path in glob.glob(os.path.join(SHM_DIR, f"{shm_prefix(secret_hex)}-*")):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed
