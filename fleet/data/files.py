"""The job's data files: which of them this worker reads (Paddle's ``fleet.util.get_file_shard``).

The list is cut into contiguous shares, one per worker, in list order; the first
``len(files) % workers`` workers get one file more. Every file goes to exactly one worker.
With more workers than files the last workers get an empty share (Paddle allows that too;
``fleet.SlotDataset`` then refuses the list on every worker alike, since a worker without
data would leave the others waiting in the step's collective).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence

from fleet.errors import FleetError
from fleet.runtime import context
from fleet.storage.paths import is_url, store_for

PathLike = str | os.PathLike

RANK_ONLY_LAUNCHERS = ("torchrun", "mpi", "slurm")


def share_bounds(num_files: int, workers: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of every worker's share of ``num_files`` files: contiguous, sizes differ by at most one."""
    if workers < 1:
        raise ValueError(f"workers({workers}) must be at least 1")
    base, extra = divmod(num_files, workers)
    bounds, start = [], 0
    for worker in range(workers):
        stop = start + base + (1 if worker < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def split_files(files: Sequence[PathLike], workers: int) -> list[list[str]]:
    """Every worker's share of ``files`` (as strings), in worker order."""
    names = [os.fspath(f) for f in files]
    return [names[start:stop] for start, stop in share_bounds(len(names), workers)]


def worker_position() -> tuple[int, int]:
    """(worker index, worker count) of this process, without starting the job.

    After ``fleet.init`` from the job's role; before it from the launcher's environment
    (fleetrun, Paddle) or a single process (0, 1). A server has no share: (-1, workers).
    """
    from fleet.roles import detect

    job = context.current()
    role = job.role if job is not None else detect()
    if job is None and role.source in RANK_ONLY_LAUNCHERS and role.world_size > 1:
        raise FleetError(
            f"This process was started by {role.source} (rank {role.rank} of {role.world_size}): which ranks are "
            "workers is known only after fleet.init() (a parameter-server strategy makes the first ranks servers). "
            "Call fleet.init() before fleet.file_shard() or fleet.SlotDataset()."
        )
    return (role.worker_index if role.is_worker else -1), role.worker_num


def check_files(files: Sequence[PathLike], what: str = "fleet.file_shard") -> list[str]:
    """``files`` as a list of strings: a non-empty list (not one string) of existing files, local paths or
    URLs of any store (``s3://bucket/part-00000``: :mod:`fleet.storage.store`)."""
    if isinstance(files, str | bytes | os.PathLike):
        raise TypeError(
            f"{what} needs a list of files, got the single {type(files).__name__} {files!r}; "
            "for a pattern pass sorted(glob.glob(pattern))."
        )
    names = [os.fspath(f) for f in files]
    if not names:
        raise ValueError(f"{what} got an empty list of files: there is no data to read.")
    missing = _missing(names)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise FileNotFoundError(f"{what}: data file {missing[0]!r} does not exist{more}.")
    return names


def _missing(names: list[str]) -> list[str]:
    """The names that are no file: local ones checked one by one, URLs through their store (one listing of
    each folder, not one request per file: a list may hold thousands of parts)."""
    listed: dict[str, set[str]] = {}
    missing = []
    for name in names:
        if not is_url(name):
            if not os.path.isfile(name):
                missing.append(name)
            continue
        store = store_for(name)  # a scheme no store handles: an error naming the URL and what to install
        folder, base = store.split(name)
        if folder not in listed:
            listed[folder] = set(store.list(folder))
        if base not in listed[folder]:
            missing.append(name)
    return missing


def file_shard(files: Sequence[PathLike]) -> list[str]:
    """This worker's contiguous share of ``files``, Paddle's ``fleet.util.get_file_shard``.

    ``[a, b, c, d, e]`` on 2 workers: worker 0 gets ``[a, b, c]``, worker 1 ``[d, e]``.
    Works before ``fleet.init`` (the launcher's environment names the worker) and in a
    plain process (all files). With more workers than files the last workers get ``[]``
    and a warning says so. On a parameter server the share is empty.
    """
    names = check_files(files)
    index, workers = worker_position()
    if workers > len(names):
        idle = (
            f"worker {workers - 1} gets" if workers - len(names) == 1 else f"workers {len(names)} to {workers - 1} get"
        )
        warnings.warn(
            f"fleet.file_shard: {len(names)} files for {workers} workers: {idle} no file. "
            "Split the data into at least as many files as workers.",
            stacklevel=2,
        )
    if index < 0:
        return []
    return split_files(names, workers)[index]


__all__ = ["check_files", "file_shard", "share_bounds", "split_files", "worker_position"]
