"""Parameter-server strategy: servers hold the tables and run the optimizer; workers push and pull.

``join`` runs at ``fleet.init``: it settles the secret and the server endpoints and, on a
server process, serves until every worker stopped, then exits with status 0 (so a
script needs no server branch). On a worker, ``wrap_optimizer`` returns a
:class:`fleet.ps.worker.PSOptimizer` over one :class:`fleet.ps.client.PSClient` per process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from fleet.errors import FleetError
from fleet.strategies.base import Strategy

if TYPE_CHECKING:
    from fleet.ps.client import PSClient
    from fleet.strategy import DistributedStrategy


class ParameterServerStrategy(Strategy):
    name = "ps"
    supported_updates = ("sync", "async", "geo")

    @classmethod
    def check(cls, config: DistributedStrategy) -> None:
        if config.backup_workers and config.update != "sync":
            raise ValueError(
                f"backup_workers={config.backup_workers} applies to update='sync' only (got update={config.update!r})"
            )
        if config.grad_compression != "none":
            raise ValueError("grad_compression applies to mode='collective' only")
        if config.local_sgd_steps:
            raise ValueError(
                "local_sgd_steps applies to mode='collective'; use update='geo' for local steps in ps mode"
            )
        if config.grad_accumulation_steps > 1:
            raise ValueError("grad_accumulation_steps applies to mode='collective' only")

    def __init__(self, config: DistributedStrategy, runtime: Any):
        super().__init__(config, runtime)
        self.optimizers: list[Any] = []
        self._tables = 0

    def _new_table(self) -> int:
        """The next table id; every worker creates its tables in the same order, so the ids agree."""
        self._tables += 1
        return self._tables - 1

    def client(self) -> PSClient:
        return worker_client(self.runtime)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        from fleet.ps.worker import PSOptimizer

        role = self.runtime.role
        if not role.server_num:
            raise FleetError(
                "The strategy has mode='ps' but no parameter server was launched. Start the job with "
                "`fleetrun --servers S --workers N script.py` (or set servers=S under torchrun), "
                "or use mode='collective'."
            )
        if not role.is_worker:
            raise FleetError(f"fleet.distributed_optimizer was called on {role.name}; servers do not train.")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        wrapped = PSOptimizer(
            optimizer, self.client(), self.config, role, self._new_table, self.runtime.model_for(params)
        )
        self.optimizers.append(wrapped)
        return wrapped

    def barrier(self) -> None:
        for opt in self.optimizers:
            opt.flush()
        if self.runtime.role.server_num:
            self.client().barrier().result()

    def shutdown(self) -> None:
        client = getattr(self.runtime, "_ps_client", None)
        try:
            for opt in self.optimizers:
                opt.flush()
        finally:
            if client is not None:
                client.close()
                self.runtime._ps_client = None


def worker_client(context: Any) -> PSClient:
    """This worker's PSClient, made once per process."""
    from fleet.ps.client import PSClient
    from fleet.ps.launch_server import resolve_secret, worker_endpoints

    client = getattr(context, "_ps_client", None)
    if client is None:
        endpoints = worker_endpoints(context)
        client = PSClient(endpoints, resolve_secret(context), context.role.worker_index, context.strategy.timeout_s)
        context._ps_client = client
    return client


def join(context: Any) -> None:
    """Called by ``fleet.init`` for PS jobs: serve on a server (and exit), connect on a worker."""
    from fleet.ps.launch_server import resolve_secret, run_server

    if not context.role.server_num:
        return  # mode='ps' with no servers: wrap_optimizer explains
    resolve_secret(context)
    if context.role.is_server:
        run_server(context)
    else:
        worker_client(context)
