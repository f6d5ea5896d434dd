"""Checkpoints: ``save_persistables``/``load_persistables`` (parameter server) and
``save_checkpoint``/``load_checkpoint`` (collective and single process).

Parameter server:

Layout under ``dirname``: ``ps-server-<i>/table-<id>.pt`` (each server's shards: values,
optimizer state, version; written by the servers themselves) and ``worker-0.pt``
(worker 0's optimizer-side state: the wrapped optimizers' own ``state_dict``, which
geo mode trains locally). Both calls are collective over the workers: in sync mode
every worker calls them at the same step boundary, and the barriers around the
server call make the checkpoint consistent (no push of a later step is in it).
"""

from __future__ import annotations

import os
import random
import shutil
from typing import Any, NamedTuple

import torch

from fleet import api
from fleet.errors import FleetError

WORKER_FILE = "worker-0.pt"


def _ps_strategy():
    from fleet.strategies.parameter_server import ParameterServerStrategy

    context = api._require()
    impl = context._impl
    if not isinstance(impl, ParameterServerStrategy) or not impl.optimizers:
        raise FleetError(
            "save_persistables/load_persistables checkpoint a parameter-server job: call them on every worker "
            "after fleet.distributed_optimizer(...) with mode='ps'. In collective mode save "
            "model.state_dict() and optimizer.state_dict() on worker 0 with torch.save."
        )
    return context, impl


def save_persistables(dirname: str) -> None:
    """Every server writes its shards under ``dirname``; worker 0 adds its optimizer state. Call on every worker."""
    context, impl = _ps_strategy()
    impl.barrier()  # every worker's pushes for the steps so far are applied
    if context.role.is_first_worker:
        os.makedirs(dirname, exist_ok=True)
        impl.client().save(dirname).result()
        state = {"optimizers": [opt.inner.state_dict() for opt in impl.optimizers]}
        _atomic_save(state, os.path.join(dirname, WORKER_FILE))
    impl.barrier()  # nobody pushes the next step before the shards are written
    for opt in impl.optimizers:
        opt.last_checkpoint = os.path.abspath(dirname)  # where a sync job rolls back after a server restart


def load_persistables(dirname: str) -> None:
    """Restore a checkpoint saved with the same number of servers; every worker then pulls the values."""
    context, impl = _ps_strategy()
    path = os.path.join(dirname, WORKER_FILE)
    if not os.path.isfile(path):
        raise FleetError(f"{path} does not exist: {dirname!r} is not a checkpoint written by fleet.save_persistables.")
    impl.barrier()
    if context.role.is_first_worker:
        impl.client().load(dirname).result()
    impl.barrier()
    state = torch.load(path, weights_only=True)
    for opt, saved in zip(impl.optimizers, state["optimizers"], strict=True):
        opt.inner.load_state_dict(saved)
        opt.refresh()


# --- collective (and single-process) checkpoints -----------------------------------------------
#
# Layout: <dirname>/step-<n>/state.pt (model, optimizer, step, extras: written by worker 0),
# <dirname>/step-<n>/worker-<i>.pt (each worker's RNG states and loader positions), and
# <dirname>/latest naming the newest complete step directory. Every file is written under a
# temporary name and renamed; ``latest`` moves only after every worker has written its part,
# so a crash at any moment leaves the previous checkpoint intact and readable.

LATEST = "latest"
KEEP = 2  # complete checkpoints kept; older step directories are removed


class Resumed(NamedTuple):
    step: int
    extra: dict[str, Any]


def _atomic_save(obj: Any, path: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


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
    context = api._require()
    rank = context.role.worker_index
    name = f"step-{step:09d}"
    stepdir = os.path.join(dirname, name)
    os.makedirs(stepdir, exist_ok=True)
    own = {"rng": _rng_state(), "loaders": [loader.state_dict() for loader in context._loaders]}
    _atomic_save(own, os.path.join(stepdir, f"worker-{rank}.pt"))
    if rank == 0:
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "step": int(step),
            "extra": extra,
            "workers": context.role.worker_num,
        }
        _atomic_save(state, os.path.join(stepdir, "state.pt"))
    context.implementation(None).barrier()  # every worker's part is on disk before `latest` moves
    if rank == 0:
        tmp = os.path.join(dirname, f"{LATEST}.tmp-{os.getpid()}")
        with open(tmp, "w") as handle:
            handle.write(name)
        os.replace(tmp, os.path.join(dirname, LATEST))
        for old in sorted(d for d in os.listdir(dirname) if d.startswith("step-") and d != name)[: -(KEEP - 1) or None]:
            shutil.rmtree(os.path.join(dirname, old), ignore_errors=True)


def load_checkpoint(dirname: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Resumed | None:
    """Restore the newest complete checkpoint under ``dirname``; None when there is none yet."""
    context = api._require()
    latest = os.path.join(dirname, LATEST)
    if not os.path.isfile(latest):
        return None
    with open(latest) as handle:
        stepdir = os.path.join(dirname, handle.read().strip())
    state = torch.load(os.path.join(stepdir, "state.pt"), weights_only=True)
    if state["workers"] != context.role.worker_num:
        raise FleetError(
            f"{stepdir} was written by {state['workers']} workers but this job has {context.role.worker_num}; "
            "resume with the same number of workers."
        )
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    own = torch.load(os.path.join(stepdir, f"worker-{context.role.worker_index}.pt"), weights_only=True)
    _set_rng_state(own["rng"])
    for loader, position in zip(context._loaders, own["loaders"], strict=False):
        loader.load_state_dict(position)
    return Resumed(state["step"], state["extra"])
