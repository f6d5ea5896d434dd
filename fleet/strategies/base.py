"""The interface every distributed strategy implements: its whole lifecycle in a job.

A strategy is one class (one module under ``fleet/strategies/``), registered by name
(``fleet.register_strategy``), built once per job with the validated
:class:`~fleet.strategy.DistributedStrategy` and the :class:`Runtime`. The core
(``fleet.api``, ``fleet.checkpoint``, ``fleet.nn``, ``fleet.metrics``) calls only these
methods and never branches on the mode:

==========================  ==============================================================
``join()``                  at ``fleet.init``: rendezvous, process groups, connections; on a
                            process that serves (a parameter server) it serves, then exits
``wrap_optimizer(opt)``     ``fleet.distributed_optimizer``: an optimizer with ``opt``'s surface
``wrap_model(model)``       ``fleet.distributed_model`` (optional for the user)
``table_backend(module)``   where a ``fleet.nn.SparseEmbedding``'s rows live (None: in-process)
``barrier()``               ``fleet.barrier_worker``
``all_reduce(values, op)``  ``fleet.metrics``: a small float64 vector summed (max, min) over the workers
``uneven_inputs()``         ``with fleet.join():`` for loops that end unevenly
``save_state(save, ...)``   ``fleet.save_checkpoint``: the model and optimizer, as parts of a save
``load_state(save, ...)``   ``fleet.load_checkpoint``
``save_persistables(dir)``  Paddle's parameter-server checkpoint (others say what to use)
``serve()``                 Paddle's explicit ``init_server``/``run_server`` (servers only)
``shutdown()``              ``fleet.stop_worker``
==========================  ==============================================================

See ``docs/strategies.md`` for a walk through a complete one (``sharding``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from fleet import registry
from fleet.errors import FleetError, PeerError

if TYPE_CHECKING:
    from fleet.roles import RoleInfo
    from fleet.sparse.backends import TableBackend, TableModule
    from fleet.storage.layout import Save, SaveWriter
    from fleet.strategy import DistributedStrategy

REDUCE_OPS = ("sum", "max", "min")
"""The reductions :meth:`Strategy.all_reduce` offers (element-wise over the workers)."""


class Runtime(Protocol):
    """What a strategy may ask of the running job (``fleet.api.FleetContext`` implements it)."""

    role: RoleInfo
    secret: bytes | None
    """The job's shared secret (a strategy may set it once it learned it, e.g. through the store)."""

    def process_group(self, timeout_s: float) -> Any:
        """The workers' torch.distributed group with this timeout (None for a single worker)."""

    def init_process_group(self) -> None:
        """Join the workers' torch.distributed group now (idempotent)."""

    def rendezvous_store(self) -> Any:
        """The job's authenticated rendezvous store (connected on first use)."""

    def model_for(self, params: list[torch.nn.Parameter]) -> torch.nn.Module | None:
        """The model given to distributed_model that holds these parameters, if any."""

    def diagnose_peers(self) -> str | None:
        """After a failed collective: which peer died or went silent, in words (None if unknown)."""

    def peer_probe(self) -> Callable[[], list[int] | None] | None:
        """The heartbeats' answer to "who stopped?" (ranks; None: worker 0's store is gone), for waits that
        tell a slow peer from a dead one; None when this job has no heartbeats (the script's own group)."""


class Strategy(ABC):
    name: ClassVar[str] = ""
    supported_updates: ClassVar[tuple[str, ...]] = ("sync",)
    """Values of DistributedStrategy.update this strategy runs."""
    reshardable_checkpoints: ClassVar[bool] = False
    """Whether a checkpoint saved with N workers loads with M (save_state/load_state reshard)."""
    materializes_meta_models: ClassVar[bool] = False
    """Whether a model built on the meta device may be wrapped: then ``wrap_optimizer`` and
    ``wrap_model`` take ``init`` (a function called on every module, or None) and give the model
    storage and values themselves; otherwise ``fleet`` refuses such a model before wrapping."""

    def __init__(self, config: DistributedStrategy, runtime: Runtime):
        self.config = config
        self.runtime = runtime

    owned_fields: ClassVar[frozenset[str]] = frozenset()
    """DistributedStrategy fields that only this strategy reads: under any other mode they must
    keep their defaults (the generic :meth:`check` refuses them, naming this strategy's mode)."""

    @classmethod
    def check(cls, config: DistributedStrategy) -> None:
        """Reject options this strategy cannot honour; raise ValueError naming the field and the fix.

        The default refuses a field that another registered strategy owns (``owned_fields``) when
        it differs from its default; a strategy adds its own rules and then calls this one.
        """
        fields = type(config).model_fields
        for other in registry.strategy_classes():
            if other is cls or other.name == cls.name:
                continue
            for field in sorted(other.owned_fields - cls.owned_fields):
                if getattr(config, field) != fields[field].get_default(call_default_factory=True):
                    raise ValueError(
                        f"{field} applies to mode={other.name!r} only (this strategy has mode={config.mode!r})"
                    )

    uses_servers: ClassVar[bool] = False
    """Whether the strategy runs with parameter-server processes in the launch."""

    @classmethod
    def check_launch(cls, config: DistributedStrategy, role: RoleInfo) -> None:
        """Reject a launch this strategy cannot run (ValueError, naming what to change)."""
        if role.server_num and not cls.uses_servers:
            raise ValueError(
                f"The launch started {role.server_num} parameter server(s), but the strategy has "
                f"mode={config.mode!r}. Use mode='ps' (or launch without servers)."
            )

    # --- joining and leaving ----------------------------------------------------------------

    def join(self) -> None:
        """At fleet.init (and when a new strategy replaces one before anything was wrapped)."""
        if self.runtime.role.worker_num > 1:
            self.runtime.init_process_group()

    def shutdown(self) -> None:
        """Release connections and groups; called by fleet.stop_worker."""

    # --- training -------------------------------------------------------------------------------

    @abstractmethod
    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Return an optimizer with the wrapped one's surface that trains in this strategy's way."""

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def table_backend(self, module: TableModule) -> TableBackend | None:
        """Where ``module``'s rows live under this strategy; None: the module's own in-process table."""
        return None

    def barrier(self) -> None:
        """Wait for every worker."""

    def inference_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """``fleet.export_for_inference``: the model's dense state as whole tensors (every worker calls it)."""
        return model.state_dict()

    def shrink_tables(self, threshold: float | None) -> None:
        """``fleet.shrink``: every sparse table evicts expired rows (and rows scoring below ``threshold``).

        The default shrinks each table module's backend in this process (a local table, or this
        worker's replica, which every worker shrinks alike); strategies whose tables live elsewhere
        shrink them there once.
        """
        from fleet.sparse import backends as tables

        tables.shrink_all(threshold)

    def all_reduce(self, values: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """``values`` (a 1-D float64 CPU tensor) reduced element-wise over every worker: ``op`` in REDUCE_OPS.

        ``fleet.metrics``' one collective: every worker calls it with a vector of the same length.
        The default goes through the workers' process group (``values`` itself for one worker);
        a strategy whose workers have no such group (parameter servers) reduces another way.
        """
        check_reduce(values, op)
        group = self.runtime.process_group(self.config.timeout_s)
        if group is None:
            if self.runtime.role.worker_num > 1:
                raise FleetError(
                    f"{type(self).__name__} has no process group over its {self.runtime.role.worker_num} workers; "
                    "it must implement all_reduce (fleet.metrics) another way."
                )
            return values
        import torch.distributed as dist

        out = values.clone()
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        try:
            work = dist.all_reduce(out, op=ops[op], group=group, async_op=True)
            work.wait(timedelta(seconds=self.config.timeout_s))
        except RuntimeError as error:
            what = f"all-reducing a global metric ({op} of {values.numel()} values, fleet.metrics)"
            raise PeerError.from_collective(what, error, self.runtime.diagnose_peers()) from None
        return out

    def uneven_inputs(self) -> AbstractContextManager:
        """``with fleet.join():`` for loops that end unevenly; nothing to do unless the strategy says so."""
        return nullcontext()

    def no_sync(self) -> AbstractContextManager:
        """DDP's ``no_sync()``: backward passes inside only accumulate local gradients; the first one
        after it reduces everything accumulated. Nothing to do where backward does not communicate."""
        return nullcontext()

    def defer_reduction(self, defer: bool) -> None:
        """DDP's ``require_backward_grad_sync`` (False: ``defer``), read at each forward of a model fleet
        wrapped: whether the next backward keeps its gradients local, to be reduced with a later backward's.
        Nothing to do where backward does not communicate (a parameter server pushes at ``step()``)."""

    def server_endpoints(self) -> list[str]:
        return list(self.runtime.role.server_endpoints)

    # --- checkpoints ------------------------------------------------------------------------------

    def save_state(self, save: SaveWriter, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Write the model's and the optimizer's state as parts of ``save`` (every worker calls it).

        The default suits strategies whose workers hold the whole model: worker 0 writes it. Every
        worker takes the model's state dict: reading a ``fleet.nn.SparseEmbedding``'s rows puts them
        in id order, which breaks ties between equal eviction scores, so the replicas stay alike.
        """
        state = model.state_dict()
        if self.runtime.role.worker_index == 0:
            save.write("state.pt", {"model": state, "optimizer": optimizer.state_dict()})

    def load_state(self, save: Save, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        state = save.load("state.pt")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    def save_persistables(self, dirname: str, mode: str = "base") -> None:
        raise FleetError(
            f"save_persistables/load_persistables checkpoint a parameter-server job (mode='ps'); this job has "
            f"mode={self.config.mode!r}: use fleet.save_checkpoint(dirname, model, optimizer, step) and "
            "fleet.load_checkpoint(dirname, model, optimizer), on every worker."
        )

    def load_persistables(self, dirname: str) -> None:
        self.save_persistables(dirname)

    def serve(self, run: bool) -> None:
        """Paddle's explicit server calls: bind (``run=False``), or serve until done and exit."""
        raise FleetError(
            f"fleet.init_server()/run_server() run a parameter server; this job has mode={self.config.mode!r} "
            "and no server process."
        )


def check_reduce(values: torch.Tensor, op: str) -> None:
    """What :meth:`Strategy.all_reduce` takes: a 1-D float64 CPU tensor and one of REDUCE_OPS."""
    if op not in REDUCE_OPS:
        raise ValueError(f"all_reduce op={op!r}; expected one of {', '.join(REDUCE_OPS)}")
    if not isinstance(values, torch.Tensor) or values.dtype != torch.float64 or values.dim() != 1:
        got = (
            f"{values.dtype} tensor of shape {list(values.shape)}"
            if isinstance(values, torch.Tensor)
            else type(values).__name__
        )
        raise ValueError(f"all_reduce takes a 1-D float64 tensor; got a {got}")
    if values.device.type != "cpu":
        raise ValueError(f"all_reduce takes a CPU tensor (the reduction goes through gloo); got one on {values.device}")
