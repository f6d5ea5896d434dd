"""Dense layers all-reduced beside the servers: the worker side of ``dense_placement="allreduce"``.

One :class:`AllReducedDense` per wrapped optimizer of a parameter-server job whose servers hold
only the sparse tables. Its dense parameters stay on the workers: at wrap time every worker takes
worker 0's parameters, buffers and optimizer state (through the workers' group,
:mod:`fleet.strategies.ps_workers_group`); the job's gradient synchroniser
(:class:`~fleet.collective.grad_sync.GradSync`, the same one ``mode="collective"`` uses) averages
their gradients during backward; and ``step()`` steps the user's optimizer on them locally, so
every worker's dense parameters are identical after every step whatever the update mode of the
tables. The tables' row gradients still go to the servers (sync, async or geo), pushed by the
mode's step (:mod:`fleet.ps.modes`; :class:`fleet.ps.worker.pushed_rows.PushedRows`).

Why here and not in ``fleet.ps.worker``: it is the collective engine at work inside a parameter-server
job, and the parameter server imports nothing of the collective engine (tests/api/test_layers.py); the
strategy, which composes engines, builds it and hands it to the PS optimizer as its ``dense`` part
(:class:`fleet.ps.worker.optimizer.LocalDense`).
"""

from __future__ import annotations

import time

import torch

from fleet.collective import lockstep
from fleet.collective.broadcast import broadcast_optimizer_state, broadcast_tensors, check_same_shapes
from fleet.collective.grad_sync import GradSync
from fleet.training.owners import model_buffers, names_of


class AllReducedDense:
    """The dense parameters of one wrapped optimizer, averaged over the workers by ``sync`` every step."""

    def __init__(self, sync: GradSync, optimizer: torch.optim.Optimizer):
        self.sync = sync
        self.optimizer = optimizer
        group = sync.group
        if group is not None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            check_same_shapes(params, lambda: names_of(params), group)
            buffers, buffer_names = model_buffers(params)
            check_same_shapes(buffers, lambda: buffer_names, group)
            # Worker 0's values everywhere, buffers too (a random projection, spectral_norm's u and v).
            broadcast_tensors(params + buffers, group)
            broadcast_optimizer_state(optimizer, group)
        sync.register(optimizer)
        sync.arm(True)
        self._rounds_at_step = sync.rounds

    def zero_grad(self) -> None:
        """A layer frozen or unfrozen before this backward is hooked before it starts, not during it."""
        self.sync.refresh()

    def add_params(self, params: list[torch.Tensor]) -> None:
        """Parameters of a param group added after wrapping: every worker takes worker 0's values."""
        sync = self.sync
        if sync.lockstep is not None and params:
            agreement = sync.lockstep.announce(lockstep.PARAMS, len(params))
            broadcast_tensors(params, sync.group, agreement.source)
        sync.verified(params)
        sync.refresh()

    def before_step(self) -> None:
        """Average the gradients now if no backward did since the last step (its peers' round needs one),
        or if one was replaced by hand after it (a closure's backward ran before this, so it counts)."""
        sync = self.sync
        if sync.hooked and (sync.rounds == self._rounds_at_step or sync.replaced_by_hand()):
            sync.catch_up()

    def step(self) -> float:
        """The user's optimizer steps the averaged dense parameters here; the seconds it took."""
        started = time.perf_counter()
        self.optimizer.step()
        return time.perf_counter() - started

    def after_step(self) -> float:
        """The step is over: count it (the lockstep's headers carry it); seconds waited for all-reduces."""
        self._rounds_at_step = self.sync.rounds
        self.sync.count_step()
        return self.sync.take_comm_wait()
