"""Checkpoints: ``save_checkpoint``/``load_checkpoint`` (every strategy) and Paddle's
``save_persistables``/``load_persistables`` (parameter-server jobs).

``save_checkpoint`` keeps what is the same in every mode (the step directory, a ``latest``
pointer, each worker's RNG states and data-loader positions, the user's extras) and asks
the strategy to write the model and the optimizer in its own format
(:meth:`~fleet.strategies.base.Strategy.save_state`: one ``state.pt`` when every worker holds
the whole model, a sharded ``torch.distributed.checkpoint`` directory under sharding).

Layout (:mod:`fleet.storage.layout`, kind :data:`~fleet.storage.layout.STEPS`):
``<dirname>/step-<n>/`` holds the strategy's files, ``meta.pt`` (step, extras, the number of
workers, written by worker 0) and ``worker-<i>.pt`` (each worker's RNG states and loader
positions); ``<dirname>/latest`` names the newest complete step directory. ``dirname`` is a local
path or a URL of any store (``s3://bucket/run``: :mod:`fleet.storage.store`; a URL no store can write is an
error, never a local folder). Every part goes through a :class:`~fleet.storage.layout.SaveWriter`: written
whole or not at all (locally under a temporary name, then renamed); ``latest`` moves only after every worker
has written its part, so a crash at any moment leaves
the previous checkpoint intact and readable, and a ``latest`` that names anything but a step
directory right inside ``dirname`` is refused. Every file is checked against the checksums the
save recorded before it is used, and every worker reads and checks its files before any of them
changes its model: a damaged checkpoint fails on every worker, naming the file (and the worker),
and never makes a job start fresh.
A full disk raises :class:`~fleet.errors.DiskFullError` ("No space left on device" and the path)
and leaves no temporary file behind.
"""

from __future__ import annotations

import os
import random
import sys
from typing import Any, NamedTuple

import torch

from fleet import api
from fleet.errors import DiskFullError, FleetError, PeerError
from fleet.nn import rows_state
from fleet.storage.atomic import is_disk_full, save_atomic
from fleet.storage.layout import STEPS, Layout, LayoutError, Save
from fleet.storage.paths import store_for

META = "meta.pt"


class Resumed(NamedTuple):
    step: int
    extra: dict[str, Any]


def save_persistables(dirname: str, mode: str = "base") -> None:
    """Every server writes its shards under ``dirname``; worker 0 adds its optimizer state. Call on every worker.

    Each save is a new ``dirname/save-<n>/`` and ``dirname/latest`` moves to it only when every
    part is written, so a failed save (a full disk: :class:`~fleet.errors.DiskFullError`) leaves
    the previous one loadable; the newest two saves of a directory are kept (and whatever the
    newest builds on). ``mode="delta"`` writes only the sparse rows created or changed since the
    previous save (a base or a delta) and the ids evicted since; dense tables are written whole.
    A production job saves a base daily and deltas hourly (into one directory or several);
    ``load_persistables`` of a delta loads its base and every delta up to it.
    """
    if mode not in ("base", "delta"):
        raise ValueError(f"save_persistables(mode={mode!r}): 'base' (every row) or 'delta' (rows changed since)")
    api.current_job().implementation(None).save_persistables(dirname, mode)


def load_persistables(dirname: str) -> None:
    """Restore the newest complete save under ``dirname`` (same number of servers); every worker then pulls."""
    api.current_job().implementation(None).load_persistables(dirname)


def save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj, path)`` once per job: worker 0 writes, every worker waits. Call on every worker.

    Worker 0 writes under a temporary name and renames it over ``path``, so no reader ever sees
    half a file; every worker returns only once the file is there, so ``torch.load(path)`` right
    after works on every worker of this machine (or of every machine sharing the filesystem); they
    wait up to the strategy's ``timeout_s``, as in every collective. A failed write raises on every worker: worker 0 its own error, the others a
    :class:`~fleet.errors.FleetError` naming worker 0. In one process it is ``torch.save`` made atomic.

    Every worker must hold the whole ``obj``: a sharded model's ``state_dict()`` (``mode="sharding"``)
    holds only this worker's shards and is refused; save it with :func:`save_checkpoint` or
    :func:`~fleet.export_for_inference`.
    """
    if not isinstance(path, str | os.PathLike):
        raise TypeError(
            f"fleet.save(obj, path): path must be a file name (str or os.PathLike), got {type(path).__name__}; "
            "for a file object, call torch.save on worker 0 yourself."
        )
    path = os.fspath(path)
    store_for(path)  # a URL no store can write is refused on every worker, never written as a local folder
    sharded = _first_shard(obj)
    if sharded is not None:
        raise FleetError(
            f"fleet.save({path!r}): {sharded} is a shard (a DTensor: this worker holds only part of it), so "
            "worker 0's file would miss the other workers' parts. Save a sharded model with "
            "fleet.save_checkpoint(dirname, model, optimizer, step), or fleet.export_for_inference(dirname, model) "
            "for whole tensors."
        )
    job = api.current_job()
    strategy = job.implementation(None)
    failure: BaseException | None = None
    if job.role.worker_index == 0:
        try:
            save_atomic(obj, path)
        except Exception as error:  # noqa: BLE001 - every worker hears of it, then this one raises it
            failure = error
    _agree(strategy, job, failure, f"fleet.save into {path}")  # doubles as the barrier: the file is there
    if failure is not None:
        raise failure


def _first_shard(obj: Any, where: str = "obj", depth: int = 0) -> str | None:
    """Where in ``obj`` (modules, dicts, lists, tuples) a DTensor sits, e.g. ``obj['fc.weight']``; None if nowhere."""
    tensor_module = sys.modules.get("torch.distributed.tensor")  # never imported: no DTensor can exist
    if tensor_module is None or depth > 20:
        return None
    if isinstance(obj, torch.Tensor):
        return where if isinstance(obj, tensor_module.DTensor) else None
    if isinstance(obj, torch.nn.Module):  # torch.save(model): its parameters and buffers
        items = obj.state_dict().items()
    elif isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, list | tuple):
        items = enumerate(obj)
    else:
        return None
    for key, value in items:
        found = _first_shard(value, f"{where}[{key!r}]", depth + 1)
        if found is not None:
            return found
    return None


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    dirname: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, **extra: Any
) -> None:
    """Save model, optimizer, ``step``, data-loader positions, RNG states and ``extra``. Call on every worker.

    ``extra`` values must be tensors, numbers, strings, lists, tuples or dicts of them
    (they are loaded with ``torch.load(weights_only=True)``).
    """
    job = api.current_job()
    strategy = job.implementation(None)
    rank = job.role.worker_index
    save = Layout(dirname, STEPS).writer(step).prepare()
    try:
        save.write(
            f"worker-{rank}.pt", {"rng": _rng_state(), "loaders": [loader.state_dict() for loader in job.loaders]}
        )
        try:
            with rows_state.rows_in_state_dict(True):  # a table's rows are checkpointed even if it opted out
                strategy.save_state(save, model, optimizer)
        except Exception as error:
            if not isinstance(error, DiskFullError) and _disk_full(error):  # e.g. torch.distributed.checkpoint's
                raise DiskFullError(save.path, "saving the model and optimizer under", _first_line(error)) from error
            raise
        if rank == 0:
            save.write(META, {"step": int(step), "extra": extra, "workers": job.role.worker_num})
    except Exception as error:
        # What this save wrote goes (on a full disk it holds the space); `latest` still names the last good one.
        save.abort(whole=save.fresh and job.role.worker_num == 1)
        _agree(strategy, job, error, f"save_checkpoint into {save.path}")
        raise
    _agree(strategy, job, None, f"save_checkpoint into {save.path}")  # every part is on disk before `latest` moves
    if rank == 0:
        save.commit()


def _disk_full(error: BaseException) -> bool:
    """A full disk anywhere under ``error`` (its causes; a checkpoint writer's message)."""
    seen: BaseException | None = error
    while seen is not None:
        if is_disk_full(seen) or "No space left on device" in str(seen) or "[Errno 28]" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def load_checkpoint(
    dirname: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, missing_ok: bool = True
) -> Resumed | None:
    """Restore the newest complete checkpoint under ``dirname``. Call on every worker.

    Nothing saved there yet (no ``latest``): None, and worker 0 says the job starts fresh; with
    ``missing_ok=False`` that is an error instead. A checkpoint that is there but damaged (a
    pointer naming no save of this directory, a missing or changed file, one that is not
    fleet's format) is always an error naming the file, on every worker, before any worker
    changed its model.
    """
    job = api.current_job()
    strategy = job.implementation(None)
    layout = Layout(dirname, STEPS)
    save = layout.resolve()
    if save is None:
        return _nothing_saved(layout, job, missing_ok)
    own = f"worker-{job.role.worker_index}.pt"
    failure: BaseException | None = None
    try:
        meta = _meta(save)
        saved, workers = int(meta["workers"]), job.role.worker_num
        if saved != workers and not strategy.reshardable_checkpoints:
            raise FleetError(
                f"{save.path} was written by {saved} workers but this job has {workers}; resume with the same "
                f"number of workers (mode={job.strategy.mode!r} checkpoints do not reshard; mode='sharding' ones do)."
            )
        # a worker the saving job did not have: the epoch and progress of worker 0
        state = _worker_state(save, own if save.has(own) else "worker-0.pt")
    except Exception as error:  # noqa: BLE001 - every worker hears of it before anyone changes its model
        failure = error
    _agree(strategy, job, failure, f"load_checkpoint from {save.path}")
    if failure is not None:
        raise failure
    strategy.load_state(save, model, optimizer)
    if save.has(own):
        _set_rng_state(state["rng"])
    for loader, position in zip(job.loaders, state["loaders"], strict=False):
        if saved != workers:  # the same share of the epoch, cut into this job's shards
            position = {**position, "position": int(position["position"]) * saved // workers}
        loader.load_state_dict(position)
    return Resumed(int(meta["step"]), meta["extra"])


def _nothing_saved(layout: Layout, job: Any, missing_ok: bool) -> None:
    """``load_checkpoint`` with no ``latest``: starting fresh (said), unless a complete save is there or
    the caller wants one."""
    orphaned = layout.unpointed()
    if orphaned is not None:
        raise orphaned
    if not missing_ok:
        raise LayoutError(f"no checkpoint to load under {layout.dirname}: {layout.pointer} does not exist")
    if job.role.worker_index == 0:
        print(f"fleet: no checkpoint in {layout.dirname} yet (no {layout.pointer}): starting fresh", file=sys.stderr)
    return None


def _meta(save: Save) -> dict[str, Any]:
    """``meta.pt`` (or, from before it, ``state.pt``), checked: a damaged one is an error naming it."""
    name = META if save.has(META) else "state.pt"
    meta = save.load(name) if save.has(name) else None
    if name != META and not (isinstance(meta, dict) and "workers" in meta):
        raise LayoutError(
            f"{save.part(META)} is missing: {save.path} is not a complete checkpoint written by fleet.save_checkpoint"
        )
    if (
        not isinstance(meta, dict)
        or not isinstance(meta.get("step"), int)
        or not isinstance(meta.get("workers"), int)
        or meta["workers"] < 1
        or not isinstance(meta.get("extra"), dict)
    ):
        keys = sorted(meta) if isinstance(meta, dict) else type(meta).__name__
        raise LayoutError(
            f"{save.part(name)} is not a checkpoint's meta.pt (step, workers, extra; it holds {keys}): damaged, "
            "or not written by fleet.save_checkpoint"
        )
    return meta


def _worker_state(save: Save, name: str) -> dict[str, Any]:
    """A worker's RNG states and loader positions (``worker-<i>.pt``), checked."""
    if not save.has(name):
        raise LayoutError(f"{save.part(name)} is missing: the checkpoint {save.path} is incomplete")
    state = save.load(name)
    if (
        not isinstance(state, dict)
        or not isinstance(state.get("rng"), dict)
        or not isinstance(state.get("loaders"), list)
    ):
        raise LayoutError(f"{save.part(name)} does not hold a worker's RNG states and loader positions: damaged")
    return state


def _agree(strategy: Any, job: Any, failure: BaseException | None, what: str) -> None:
    """Every worker learns which workers failed ``what`` (one small all-reduce, under the strategy's timeout_s).

    The workers that failed raise their own error (it names the file); the others raise one naming them,
    instead of waiting in the next collective until the timeout.
    """
    workers = job.role.worker_num
    if workers == 1:
        return
    flags = torch.zeros(workers, dtype=torch.float64)
    flags[job.role.worker_index] = 1.0 if failure is not None else 0.0
    try:
        failed = [i for i, flag in enumerate(strategy.all_reduce(flags, "sum").tolist()) if flag]
    except PeerError as error:  # a worker died or hangs (in its own reads or writes): named, with the save
        raise PeerError(f"{what}: waiting for every worker to finish its files failed: {error}") from error
    if failed and failure is None:
        names = ", ".join(f"worker {i}" for i in failed)
        raise FleetError(f"{what} failed on {names} (its error names the file); nothing was changed here")
