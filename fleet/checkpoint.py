"""Checkpoints of a parameter-server job: ``fleet.save_persistables`` / ``fleet.load_persistables``.

Layout under ``dirname``: ``ps-server-<i>/table-<id>.pt`` (each server's shards: values,
optimizer state, version; written by the servers themselves) and ``worker-0.pt``
(worker 0's optimizer-side state: the wrapped optimizers' own ``state_dict``, which
geo mode trains locally). Both calls are collective over the workers: in sync mode
every worker calls them at the same step boundary, and the barriers around the
server call make the checkpoint consistent (no push of a later step is in it).
"""

from __future__ import annotations

import os

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
        torch.save(state, os.path.join(dirname, WORKER_FILE))
    impl.barrier()  # nobody pushes the next step before the shards are written


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
