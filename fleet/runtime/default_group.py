"""torch.distributed's default process group when the user's script made it, not fleet.

fleetrun gives every worker torchrun's variables (``WORLD_SIZE``, ``RANK``, ...), so a script
with its own distributed mode (``if int(os.environ.get("WORLD_SIZE", 1)) > 1:
dist.init_process_group(...)``, as Facebook's DLRM has) switches it on inside a fleet job. Both
orders must end in a clear answer rather than a hang or a failure far away:

- the script called ``init_process_group`` **before** ``fleet.init()``: the strategy finds the
  group (:func:`found`) and adopts it where it fits the job, or refuses it, naming what to remove;
- **after** ``fleet.init()``: where fleet made the default group, torch refuses the second one
  with its own "twice" error, which fleet's exception hook explains (:func:`explain_twice`);
  where fleet holds none (a parameter-server worker), the strategy finds the group at its next
  call (``fleet.distributed_optimizer``, ``optimizer.step()``).

The default group is process-global state in torch; this module only remembers which one fleet
made, so that it is never mistaken for the user's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from fleet.errors import UserProcessGroupError

DOCS = "docs/migrating-from-ddp.md, section 'Scripts that call init_process_group'"
TWICE = "trying to initialize the default process group twice"
"""The text of torch's error when a second default process group is initialised."""

_fleets: Any = None  # the default group fleet made (compared by identity), None when fleet made none
_fleets_job = ""  # the job fleet made it for, in words ("this collective job (mode='collective', worker 0 of 2)")


@dataclass(frozen=True)
class FoundGroup:
    """A default process group that fleet did not make."""

    world_size: int
    rank: int
    backend: str

    def describe(self) -> str:
        return f"a default process group of world size {self.world_size} (this process has rank {self.rank}, backend {self.backend})"


def found() -> FoundGroup | None:
    """The default process group if one is initialised and fleet did not make it; None otherwise."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    if _fleets is not None and dist.group.WORLD is _fleets:
        return None
    return FoundGroup(dist.get_world_size(), dist.get_rank(), str(dist.get_backend()))


def made_by_fleet(job: str) -> None:
    """fleet has just initialised the default group for ``job`` (in words, for explanations)."""
    global _fleets, _fleets_job
    _fleets, _fleets_job = dist.group.WORLD, job


def forget() -> None:
    """fleet let go of the default group it made (or never made one)."""
    global _fleets, _fleets_job
    _fleets, _fleets_job = None, ""


def refuse(group: FoundGroup, job: str, when: str, why: str, remove: str) -> UserProcessGroupError:
    """The error for a default group ``job`` cannot use: what was called, what was found, why, what to remove."""
    return UserProcessGroupError(
        f"torch.distributed.init_process_group was called {when} in {job}: fleet found {group.describe()}. "
        f"{why} {remove} See {DOCS}."
    )


def check_matches(group: FoundGroup, job: str, worker_index: int, worker_num: int) -> None:
    """A group made before fleet.init() that fleet can use must have the job's workers as its ranks."""
    if group.world_size == worker_num and group.rank == worker_index:
        return
    raise refuse(
        group,
        job,
        "before fleet.init()",
        f"fleet would run its collectives over it, but this job has {worker_num} worker(s) and this process is "
        f"worker {worker_index}, so its ranks are not the job's workers.",
        "Remove the init_process_group call: fleet.init() makes the workers' process group itself (or make the "
        "group with world_size=fleet's worker count and rank=the worker index, e.g. from torchrun's WORLD_SIZE "
        "and RANK, which fleetrun sets for every worker).",
    )


def explain_twice(error: BaseException) -> str | None:
    """What to tell a user whose init_process_group met the default group fleet made (None: not that case)."""
    if not isinstance(error, ValueError | RuntimeError) or TWICE not in str(error):
        return None
    if _fleets is None or not dist.is_available() or not dist.is_initialized() or dist.group.WORLD is not _fleets:
        return None
    return (
        f"torch.distributed.init_process_group was called after fleet.init(), which had already made the default "
        f"process group of {_fleets_job}. Remove the call: fleet.init() replaces it (or call it before "
        f"fleet.init(), which then uses that group when its world size and rank are the job's). See {DOCS}."
    )
