"""Parameter-server strategy: servers hold the tables and run the optimizer; workers push and pull.

``join`` runs at ``fleet.init``: it settles the secret and the server endpoints and, on a
server process, serves until every worker stopped, then exits with status 0 (so a script
needs no server branch). On a worker, ``wrap_optimizer`` returns a
:class:`fleet.ps.worker.optimizer.PSOptimizer` over one :class:`fleet.ps.client.client.PSClient` per process,
and the ``fleet.nn.SparseEmbedding`` tables that optimizer holds are served from the
servers (:meth:`table_backend`). ``save_persistables``/``load_persistables`` checkpoint
every server's shards plus worker 0's optimizer-side state.

``dense_placement="allreduce"`` (PERSIA's hybrid): the servers hold only the sparse tables; the
workers form a process group of their own (:mod:`fleet.strategies.ps_workers_group`) and average
their dense gradients through the collective engine (:mod:`fleet.strategies.ps_dense_allreduce`).
"""

from __future__ import annotations

import atexit
import os
import sys
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from fleet.errors import FleetError, PeerError
from fleet.ps import modes
from fleet.ps.worker.persistables import WORKER_FILE
from fleet.runtime import env
from fleet.sparse import native
from fleet.storage import persist
from fleet.storage.layout import SAVES, Save, SaveWriter
from fleet.storage.paths import absolute
from fleet.strategies.base import Runtime, Strategy, check_reduce

__all__ = ["WORKER_FILE", "ParameterServerStrategy"]

if TYPE_CHECKING:
    from fleet.ps.client.client import PSClient
    from fleet.ps.server.loop import ParameterServer
    from fleet.roles import RoleInfo
    from fleet.sparse.backends import TableBackend, TableModule
    from fleet.strategies.ps_workers_group import WorkersGroup
    from fleet.strategy import DistributedStrategy


class ParameterServerStrategy(Strategy):
    name = "ps"
    supported_updates = modes.names()
    uses_servers = True

    @classmethod
    def check_launch(cls, config: DistributedStrategy, role: RoleInfo) -> None:
        native.require("A parameter-server job (mode='ps')")  # its servers' tables and checks are native
        if config.backup_workers >= role.worker_num:
            raise ValueError(
                f"backup_workers={config.backup_workers} must be below the number of workers ({role.worker_num})."
            )
        restarts = env.current().int(env.FLEET_MAX_RESTARTS, 0) or 0
        if config.dense_placement == "allreduce" and restarts > 0 and role.server_num:
            raise ValueError(
                f"dense_placement='allreduce' cannot run with restarts ({env.FLEET_MAX_RESTARTS}={restarts}, "
                "fleetrun --max-restarts): a restarted worker cannot rejoin the workers' process group in the middle "
                "of the job, and a restarted server brings the tables back to their last checkpoint while the dense "
                "layers, on the workers, would stay where they are. Launch without --max-restarts (resume from "
                "fleet.save_persistables instead), or keep dense_placement='servers'."
            )

    owned_fields = frozenset({"backup_workers", "servers", "dense_placement"})

    @classmethod
    def check(cls, config: DistributedStrategy) -> None:
        modes.mode_for(config.update).check(config)
        if config.grad_compression != "none":
            raise ValueError("grad_compression applies to mode='collective' only")
        if config.local_sgd_steps:
            raise ValueError(
                "local_sgd_steps applies to mode='collective'; use update='geo' for local steps in ps mode"
            )
        if config.grad_accumulation_steps > 1:
            raise ValueError("grad_accumulation_steps applies to mode='collective' only")
        if config.dense_placement == "allreduce" and config.backup_workers:
            raise ValueError(
                f"backup_workers={config.backup_workers} cannot be combined with dense_placement='allreduce': the "
                "dense layers' all-reduce waits for every worker at every step, so a backup worker saves no time "
                "(and the dense and sparse updates of a step would average different sets of workers). Use "
                "backup_workers with dense_placement='servers', or update='async' for the tables"
            )
        super().check(config)

    def __init__(self, config: DistributedStrategy, runtime: Runtime):
        super().__init__(config, runtime)
        self._optimizers: list[weakref.ref] = []
        self._tables = 0
        self._client: PSClient | None = None
        self._server: ParameterServer | None = None
        self._endpoints: tuple[str, ...] = tuple(runtime.role.server_endpoints)
        self._persisted: str | None = None  # worker 0: the last complete save it wrote or loaded (a delta's parent)
        self._save_failed = False  # worker 0: the last save failed, so the servers' delta marks are not trusted
        self._workers: WorkersGroup | None = None  # dense_placement="allreduce": the workers' group and synchroniser

    @property
    def optimizers(self) -> list[Any]:
        return [o for o in (ref() for ref in self._optimizers) if o is not None]

    def _new_table(self) -> int:
        """The next table id; every worker creates its tables in the same order, so the ids agree."""
        self._tables += 1
        return self._tables - 1

    # --- joining and leaving ----------------------------------------------------------------

    def join(self) -> None:
        """Serve on a server (and exit the process); connect on a worker."""
        from fleet.ps.server import launch as launch_server
        from fleet.ps.worker.user_group import refuse_user_group

        if not self.runtime.role.server_num:
            return  # mode='ps' with no servers: wrap_optimizer explains
        refuse_user_group(self.config, self.runtime.role, "before fleet.init()")
        launch_server.resolve_secret(self.runtime)
        hybrid = self.config.dense_placement == "allreduce"
        if hybrid and self.runtime.role.worker_num > 1:  # one worker needs no group, nor the rendezvous
            from fleet.strategies.ps_workers_group import need_master

            need_master(self.runtime.role)
            try:
                self.runtime.rendezvous_store()  # every process, servers too: the join counts them all
            except PeerError as error:
                raise PeerError(
                    f"{error} With dense_placement='allreduce' every process of the job, servers included, joins "
                    "the rendezvous at fleet.init(): give that strategy to every process (fleetrun --strategy, "
                    "FLEET_STRATEGY, or fleet.init(strategy=...) in the script), not only to "
                    "fleet.distributed_optimizer, which the servers never call."
                ) from None
        if self.runtime.role.is_server:
            self.serve(run=True)
        else:
            self.client()
            if hybrid and self._workers is None:
                from fleet.strategies.ps_workers_group import WorkersGroup

                self._workers = WorkersGroup(self.runtime, self.config)

    def serve(self, run: bool) -> None:
        from fleet.ps.server import launch as launch_server

        if self._server is None:
            self._server = launch_server.init_server(
                self.runtime,
                self.config.timeout_s,
                self._limits(),
                self.config.ps_encryption,
                self.config.ps_ipc,
                self.config.ps_server_threads,
            )
        if run:
            launch_server.run_server(self._server, self.runtime.role.server_index)

    def client(self) -> PSClient:
        """This worker's PSClient, made once per process."""
        from fleet.ps.client.client import PSClient
        from fleet.ps.server.launch import resolve_secret

        if self._client is None:
            role = self.runtime.role
            client = PSClient(
                self.server_endpoints(),
                resolve_secret(self.runtime),
                role.worker_index,
                self.config.timeout_s,
                limits=self._limits(),
                encryption=self.config.ps_encryption,
                ipc=self.config.ps_ipc,
            )
            self._client = client
            atexit.register(self._stop_at_exit)
        return self._client

    def _limits(self) -> Any:
        """What one request to a server may carry (the strategy's max_request_ids / max_request_mb)."""
        from fleet.ps.protocol.limits import RequestLimits

        return RequestLimits.from_strategy(self.config)

    def _stop_at_exit(self) -> None:
        """The script ended without fleet.stop_worker(): stop as it would have (flush, then STOP the servers)."""
        if self._client is None or hasattr(sys, "last_value"):
            return  # stopped already, or ending on an uncaught exception: the job must fail, naming this worker
        try:
            self.shutdown()
        except Exception as error:  # noqa: BLE001 - whatever it is, the user must hear that updates may be lost
            print(
                f"fleet: worker {self.runtime.role.worker_index}: could not finish cleanly at exit "
                f"(its last updates may not have reached the servers): {error}",
                file=sys.stderr,
                flush=True,
            )
            sys.stdout.flush()
            os._exit(1)

    def server_endpoints(self) -> list[str]:
        from fleet.ps.server.launch import worker_endpoints

        if not self._endpoints and self.runtime.role.server_num:
            self._endpoints = worker_endpoints(self.runtime)
        return list(self._endpoints)

    def shutdown(self) -> None:
        try:
            for opt in self.optimizers:
                opt.flush()
        finally:
            try:
                if self._client is not None:
                    atexit.unregister(self._stop_at_exit)
                    self._client.close()
                    self._client = None
            finally:
                if self._workers is not None:
                    workers, self._workers = self._workers, None
                    workers.close()

    # --- training -------------------------------------------------------------------------------

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        from fleet.ps.worker.optimizer import PSOptimizer
        from fleet.ps.worker.user_group import refuse_user_group

        role = self.runtime.role
        if not role.server_num:
            raise FleetError(
                "The strategy has mode='ps' but no parameter server was launched. Start the job with "
                "`fleetrun --servers S --workers N script.py` (or set servers=S under torchrun), "
                "or use mode='collective'."
            )
        if not role.is_worker:
            raise FleetError(f"fleet.distributed_optimizer was called on {role.name}; servers do not train.")
        refuse_user_group(self.config, role, "after fleet.init()")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        model = self.runtime.model_for(params)
        dense = None
        if self._workers is not None:
            from fleet.strategies.ps_dense_allreduce import AllReducedDense

            dense = AllReducedDense(self._workers.sync, optimizer)
        wrapped = PSOptimizer(optimizer, self.client(), self.config, role, self._new_table, model, dense)
        self._optimizers.append(weakref.ref(wrapped))
        return wrapped

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """dense_placement="allreduce": backward passes inside keep the dense gradients local (DDP's no_sync)."""
        if self._workers is None:
            yield
            return
        self._workers.sync.pause()
        try:
            yield
        finally:
            self._workers.sync.resume()

    def uneven_inputs(self) -> Any:
        """``with fleet.join():`` Nothing to do with the dense layers on the servers (a finished worker is not waited
        for); refused with them all-reduced, where a finished worker cannot shadow the others' rounds yet."""
        if self._workers is not None and self.runtime.role.worker_num > 1:
            raise FleetError(
                "fleet.join() is not supported with dense_placement='allreduce' yet: the dense layers' all-reduce "
                "pairs every worker's step, and a finished worker cannot shadow the others' rounds here. Give every "
                "worker the same number of batches (fleet.distributed_loader does), or use dense_placement='servers' "
                "for uneven loops."
            )
        return super().uneven_inputs()

    def defer_reduction(self, defer: bool) -> None:
        if self._workers is not None:
            self._workers.sync.hold(defer)

    def table_backend(self, module: TableModule) -> TableBackend | None:
        """The servers' rows, once an optimizer holding the module was wrapped (its initial rows before)."""
        for opt in self.optimizers:
            rows = opt.rows_for(module)
            if rows is not None:
                return rows
        return None

    def inference_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The servers' values: geo workers push what they have not synced, then every worker pulls."""
        for opt in self.optimizers:
            if opt.mode.steps_locally:
                opt.geo_sync()
        self.barrier()
        for opt in self.optimizers:
            opt.refresh()
            if opt.mode.steps_locally:
                for _, _, rows in opt.sparse:
                    rows.forget()  # cached rows are fetched again: this worker goes on from the servers' values
        return model.state_dict()

    def shrink_tables(self, threshold: float | None) -> None:
        """Worker 0 shrinks every sparse table on the servers, between two barriers (so no step straddles it)."""
        self.barrier()
        if self.runtime.role.worker_index == 0:
            for opt in self.optimizers:
                for _, _, rows in opt.sparse:
                    rows.shrink(threshold)
        self.barrier()

    def barrier(self) -> None:
        for opt in self.optimizers:
            opt.flush()
        if self.runtime.role.server_num:
            self.client().barrier().result()

    def all_reduce(self, values: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """The workers have no process group here: server 0 reduces (a stopped worker is not waited for)."""
        if not self.runtime.role.server_num:
            return super().all_reduce(values, op)
        check_reduce(values, op)
        return self.client().all_reduce(values, op).result()

    # --- checkpoints ------------------------------------------------------------------------------

    def _checkpointed(self) -> list[Any]:
        optimizers = self.optimizers
        if not optimizers:
            raise FleetError(
                "save_persistables/load_persistables checkpoint a parameter-server job: call them on every worker "
                "after fleet.distributed_optimizer(...)."
            )
        return optimizers

    def save_persistables(self, dirname: str, mode: str = "base") -> None:
        """Every server writes its shards, worker 0 its optimizer state, into a new save under ``dirname``;
        ``dirname/latest`` moves to it only once all of that is written (:mod:`fleet.storage.persist`). Call on
        every worker: each raises if the save failed, and the save before it stays the one to load.

        ``mode="delta"``: sparse tables write only the rows created or changed since the previous
        save (and the ids evicted since); loading ``dirname`` replays the saves back to the base.
        """
        optimizers = self._checkpointed()
        self.barrier()  # every worker's pushes for the steps so far are applied
        failure: BaseException | None = None
        if self.runtime.role.is_first_worker:
            try:
                self._persisted = self._save_new(dirname, mode, optimizers)
                self._save_failed = False
            except Exception as error:  # every worker must hear of it before anyone pushes again
                failure, self._save_failed = error, True
        # Also the barrier after the save: nobody pushes the next step before the shards are written.
        saved = self.all_reduce(torch.tensor([0.0 if failure else 1.0], dtype=torch.float64), "min")
        if failure is not None:
            raise failure
        if saved[0] < 1:
            raise FleetError(
                f"save_persistables({dirname!r}) failed on worker 0 (its error says why); the save before it in "
                f"{dirname} is still the one load_persistables loads."
            )
        latest = persist.resolve(dirname)
        for opt in optimizers:
            opt.remember_checkpoint(absolute(latest))  # where a sync job rolls back after a server restart

    def _save_new(self, dirname: str, mode: str, optimizers: list[Any]) -> str:
        """Worker 0's part of a save: a new directory, the servers' shards, its own file, then ``latest``."""
        from fleet.ps.worker.persistables import save_servers

        delta = mode == "delta"
        if delta and self._save_failed:
            print(
                "fleet: the previous save_persistables failed, so this delta is written as a base (a delta on a "
                "save that was never completed would miss rows)",
                file=sys.stderr,
                flush=True,
            )
            delta = False
        state: dict[str, Any] = {"optimizers": [opt.inner.state_dict() for opt in optimizers]}
        if self._workers is not None:  # the dense parameters are the workers' (equal on every one): worker 0's
            state["dense_placement"] = "allreduce"
            state["dense"] = [[p.detach().clone() for p in opt.parameters()] for opt in optimizers]
        return save_servers(self.client(), dirname, state, delta, self._persisted if delta else None)

    def load_persistables(self, dirname: str) -> None:
        """Restore the newest complete save under ``dirname`` (same number of servers); every worker then pulls."""
        from fleet.ps.worker.persistables import load_servers

        optimizers = self._checkpointed()
        source = persist.resolve(dirname)
        save = Save(source, SAVES)
        if not save.has(WORKER_FILE):
            raise FleetError(
                f"{save.part(WORKER_FILE)} does not exist: {dirname!r} is not a checkpoint written by "
                "fleet.save_persistables."
            )
        state = save.load(WORKER_FILE)  # checked (checksums) on every worker before any server changes
        if not isinstance(state, dict) or not isinstance(state.get("optimizers"), list):
            raise FleetError(f"{save.part(WORKER_FILE)} does not hold worker 0's optimizer states: damaged")
        if len(state["optimizers"]) != len(optimizers):
            raise FleetError(
                f"{save.part(WORKER_FILE)} holds {len(state['optimizers'])} optimizers' states, this worker has "
                f"{len(optimizers)} wrapped optimizers: the save is of another script"
            )
        saved_placement = state.get("dense_placement", "servers")
        if saved_placement != self.config.dense_placement:
            raise FleetError(
                f"{dirname!r} was saved with dense_placement={saved_placement!r} (the dense parameters "
                f"{'on the workers' if saved_placement == 'allreduce' else 'as tables on the servers'}), but this "
                f"job has dense_placement={self.config.dense_placement!r}: load it with the placement it was saved "
                "with (then save again under the other one: its parameters are in the model on every worker)."
            )
        dense = state.get("dense")
        if dense is not None:
            _check_dense_save(save.part(WORKER_FILE), dense, optimizers)
        self.barrier()
        failure: BaseException | None = None
        if self.runtime.role.is_first_worker:
            try:
                load_servers(self.client(), source)
                self._persisted = absolute(source)
            except Exception as error:  # every worker must hear of it, not wait for tables that never load
                failure = error
        loaded = self.all_reduce(torch.tensor([0.0 if failure else 1.0], dtype=torch.float64), "min")
        if failure is not None:
            raise failure
        if loaded[0] < 1:
            raise FleetError(
                f"load_persistables({dirname!r}) failed on worker 0 (its error names the server and the file); no "
                "table changed on any parameter server."
            )
        for index, (opt, saved) in enumerate(zip(optimizers, state["optimizers"], strict=True)):
            opt.inner.load_state_dict(saved)
            if dense is not None:  # every worker read the same file: the dense parameters agree again
                with torch.no_grad():
                    for param, value in zip(opt.parameters(), dense[index], strict=True):
                        param.copy_(value)
            opt.refresh()
            opt.remember_checkpoint(absolute(source))

    def save_state(self, save: SaveWriter, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        raise FleetError(
            "In a parameter-server job the parameters and the optimizer state live on the servers: checkpoint it "
            "with fleet.save_persistables(dirname) and fleet.load_persistables(dirname), on every worker."
        )

    load_state = save_state


def _check_dense_save(where: str, dense: Any, optimizers: list[Any]) -> None:
    """A save's dense parameters (dense_placement="allreduce") must fit this script's, optimizer by optimizer."""
    for index, (values, opt) in enumerate(zip(dense, optimizers, strict=True)):
        params = opt.parameters()
        shapes = [tuple(p.shape) for p in params]
        saved = [tuple(v.shape) for v in values]
        if saved != shapes:
            raise FleetError(
                f"{where} holds dense parameters of shapes {saved} for optimizer {index}, this worker's optimizer "
                f"{index} has {shapes}: the save is of another model"
            )
