"""The Fleet context: init, the distributed_* wrappers and role queries.

One context per process, created by ``fleet.init``. Module-level functions in
``fleet`` forward here so user code reads like Paddle's ``fleet.*`` calls.
"""

from __future__ import annotations

import atexit
import gc
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fleet import registry
from fleet.collective.liveness import Liveness
from fleet.data.loader import shard_loader
from fleet.errors import FleetError, StoreTamperedError
from fleet.roles import RoleInfo, RoleMaker, detect
from fleet.runtime import context, default_group, env, job_files, job_secret, netif, rendezvous
from fleet.runtime.signed_store import SignedStore
from fleet.sparse import backends as tables
from fleet.strategies.base import Strategy
from fleet.strategy import DistributedStrategy, StrategyError
from fleet.telemetry import job_summary
from fleet.training.owners import modules_holding

DEFAULT_PS_UPDATE = "async"  # Paddle's parameter-server default (a_sync=True)
DEFAULT_MODE, SERVER_MODE = "collective", "ps"  # what a job runs when nothing chose: without servers, with them
_JOINS = 0  # FleetContexts made in this process: an external store (torchrun's) outlives each of them


class FleetContext:
    """This process's view of the job (the :class:`~fleet.strategies.base.Runtime` strategies use)."""

    def __init__(self, role: RoleInfo, strategy: DistributedStrategy, secret: bytes | None):
        self.role = role
        self.strategy = strategy
        self.secret = secret
        self.models: list[torch.nn.Module] = []  # given to distributed_model (names, buffers)
        self.loaders: list[Any] = []  # distributed_loader results, whose positions checkpoints keep
        self.liveness: Liveness | None = None
        self.reported = False  # the end-of-job timing table was printed (fleet.telemetry.job_summary)
        self._store: dist.Store | None = None
        self._groups: dict[float, Any] = {}
        self._impl: Strategy | None = None
        self._wrapped = False  # an optimizer or a model was wrapped: the strategy is fixed
        self._adopted = (
            False  # the default group is the script's (made before fleet.init): fleet uses groups of its own
        )
        environ = env.current()
        self._namespace = f"fleet/{environ.str(env.FLEET_RESTART_COUNT, '0')}"
        if role.source == "torchrun" and environ.has(env.TORCHELASTIC_RESTART_COUNT):
            self._namespace += f"/attempt-{environ.str(env.TORCHELASTIC_RESTART_COUNT)}"
        global _JOINS
        _JOINS += 1  # a second fleet.init after stop_worker (every rank alike) meets under new keys
        if _JOINS > 1:
            self._namespace += f"/init-{_JOINS}"

    def take_final_report(self) -> bool:
        """Whether the end-of-job table is still to be printed; True once, then False."""
        first, self.reported = not self.reported, True
        return first

    @property
    def active_strategy(self) -> Strategy | None:
        """The strategy object, once one was built (fleet.init builds it)."""
        return self._impl

    # --- the Runtime protocol strategies use ---------------------------------

    def process_group(self, timeout_s: float) -> Any:
        """The workers' group with this timeout; None when there is one worker."""
        if self.role.worker_num == 1 or self.role.server_num:
            return None
        self.init_process_group()
        if timeout_s not in self._groups:
            # new_group is collective: every worker asks for the same timeouts in the same order. Over an
            # adopted group, fleet's own backends: the script's may lack gloo for fleet's CPU tensors.
            backend = _backend() if self._adopted else None
            self._groups[timeout_s] = dist.new_group(timeout=timedelta(seconds=timeout_s), backend=backend)
        return self._groups[timeout_s]

    def describe(self) -> str:
        """This job in words, for messages: "this collective job (mode='collective'; this process is worker 0 of 2)"."""
        mode = self.strategy.mode
        return f"this {mode} job (mode={mode!r}; this process is {self.role.name} of {self.role.worker_num} workers)"

    def init_process_group(self) -> None:
        user = default_group.found()
        if user is not None:
            # The script called init_process_group before fleet.init(): fleet runs over the same ranks when
            # they are the job's workers (no store, heartbeats or signing of fleet's then), else says what to remove.
            default_group.check_matches(user, self.describe(), self.role.worker_index, self.role.worker_num)
            self._adopted = True
            return
        if dist.is_initialized():
            return
        timeout_s = self.strategy.timeout_s
        # gloo's own deadline is the longest wait for a live peer (fleet.collective.patience cuts it in slices)
        wait_s = max(timeout_s, self.strategy.collective_wait_s)
        backend = _backend()
        store = self.rendezvous_store()
        try:
            dist.init_process_group(
                backend,
                store=dist.PrefixStore("pg", store),
                rank=self.role.worker_index,
                world_size=self.role.worker_num,
                timeout=timedelta(seconds=wait_s),
            )
        except RuntimeError as error:
            if StoreTamperedError.MARK in str(error):  # gloo read a forged value through the signed store
                raise StoreTamperedError("a value the process group exchanged does not carry a valid MAC") from None
            raise
        self._groups[timeout_s] = self._groups[wait_s] = dist.group.WORLD
        default_group.made_by_fleet(self.describe())
        key = store.key if isinstance(store, SignedStore) else None
        self.liveness = Liveness(
            self.role.master, self._namespace, self.role.rank, self.role.world_size, timeout_s, key=key
        )

    def rendezvous_store(self) -> dist.Store:
        if self._store is None:
            host, port = env.split_endpoint(self.role.master or "")
            interface = "lo" if rendezvous.is_loopback(host) else netif.interface_towards(host, port)
            if interface is not None:
                env.set_default(env.GLOO_SOCKET_IFNAME, interface)
            timeout_s = self.strategy.timeout_s
            store = rendezvous.connect(self.role, timeout_s, namespace=self._namespace)
            same_secret, forget = self.role.source == "fleetrun", None
            if self.secret is None and self.role.server_num and self.role.source in job_secret.RANK_ONLY:
                # the servers need a password the launcher did not give: share one on this host, never via the store
                self.secret, forget = job_secret.share_on_host(store, self.role, timeout_s)
                same_secret = True
            try:
                self._store = rendezvous.join(store, self.role, self.secret, timeout_s, same_secret=same_secret)
            finally:
                if forget is not None:
                    forget()  # every process proved it holds the secret (or the join failed): the file goes
        return self._store

    def model_for(self, params: list[torch.nn.Parameter]) -> torch.nn.Module | None:
        wanted = {id(p) for p in params}
        for model in self.models:
            if wanted & {id(p) for p in model.parameters()}:
                return model
        return None

    def diagnose_peers(self) -> str | None:
        return self.liveness.describe() if self.liveness is not None else None

    def peer_probe(self) -> Callable[[], list[int] | None] | None:
        return self.liveness.silent_peers if self.liveness is not None else None

    # --- the strategy ---------------------------------------------------------------

    def implementation(self, strategy: DistributedStrategy | None) -> Strategy:
        """The strategy object for this config, built (and joined) once; a job trains under one strategy."""
        if strategy is not None and strategy != self.strategy:
            if self._wrapped:
                raise FleetError(
                    f"fleet.distributed_optimizer/distributed_model already trains this job under "
                    f"{_describe(self.strategy)}; a second strategy ({_describe(strategy)}) cannot join it: every "
                    "optimizer and model of a job trains under one strategy. Pass the same DistributedStrategy "
                    "(or none) to every call."
                )
            _check_against_role(strategy, self.role)
            self.strategy = strategy
            self._impl = None
        if self._impl is None:
            self._impl = registry.get(self.strategy.mode)(self.strategy, self)
            self._impl.join()
        return self._impl

    def wrapping(self, strategy: DistributedStrategy | None) -> Strategy:
        """The strategy that wraps an optimizer or a model (after which it can no longer change)."""
        impl = self.implementation(strategy)
        self._wrapped = True
        return impl

    def stop(self) -> None:
        """fleet.stop_worker: the strategy lets go, then the group and the heartbeats."""
        if self._impl is not None:
            self._impl.shutdown()
        self.release()

    def release(self) -> None:
        """Let go of the heartbeats, the process group and the store (local: no peer is asked)."""
        if self.liveness is not None:
            self.liveness.close()
        if dist.is_initialized() and default_group.found() is None:  # the default group is fleet's
            dist.destroy_process_group()
            default_group.forget()
        elif dist.is_initialized() and self._adopted:  # fleet's groups go; the default one is the script's to destroy
            for group in self._groups.values():
                dist.destroy_process_group(group)
        # Let go of the groups and stores now, not at interpreter exit. The abort once blamed on their
        # static destruction ("terminate called without an active exception") was a daemon thread
        # still inside a store call at finalisation (docs/failures.md); liveness.close above and
        # store_calls.settle at exit prevent that one.
        self._groups.clear()
        self._store = None


def _backend() -> str:
    """The process-group backend fleet uses: gloo for CPU tensors, NCCL for CUDA ones."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def _describe(strategy: DistributedStrategy) -> str:
    fields = ", ".join(f"{k}={v!r}" for k, v in strategy.model_dump(exclude_defaults=True).items())
    return f"DistributedStrategy({fields})"


def _check_against_role(strategy: DistributedStrategy, role: RoleInfo) -> None:
    """The strategy against the launch (servers, worker count): its own rules, as StrategyError."""
    try:
        registry.get(strategy.mode).check_launch(strategy, role)
    except ValueError as error:
        raise StrategyError(str(error)) from None


def _resolve_strategy(strategy: DistributedStrategy | None) -> DistributedStrategy:
    if strategy is not None:
        if not isinstance(strategy, DistributedStrategy):
            raise TypeError(f"strategy must be a fleet.DistributedStrategy, got {type(strategy).__name__}.")
        return strategy
    return DistributedStrategy.from_env() or DistributedStrategy()


def init(
    role_maker: RoleMaker | None = None,
    strategy: DistributedStrategy | None = None,
    is_collective: bool | None = None,
) -> None:
    """Find this process's role and join the job.

    With no launcher this is worker 0 of 1 and nothing else happens. On a parameter-server
    process this serves until every worker is done, then exits the process with status 0.
    ``is_collective`` has Paddle's meaning: True for collective training, False for a
    parameter-server job; None lets the strategy and the launch decide.
    """
    config = _resolve_strategy(strategy)
    if is_collective is not None:
        config = _honour_is_collective(config, is_collective)
    servers = config.servers if registry.get(config.mode).uses_servers else 0
    role = role_maker.role_info(servers=servers) if role_maker is not None else detect(servers=servers)
    if is_collective is not None:
        config = _check_is_collective(config, is_collective, role)
    if role.server_num and strategy is None and config.mode == DEFAULT_MODE and "mode" not in config.model_fields_set:
        config = DistributedStrategy(mode=SERVER_MODE, update=DEFAULT_PS_UPDATE, timeout_s=config.timeout_s)
    _check_against_role(config, role)
    secret = job_secret.from_environment()
    existing = context.current()
    if existing is not None:
        _check_same_init(existing, role, config, strategy is not None or is_collective is not None)
        return
    job_files.remove_orphaned_files()  # what a kill -9 of an earlier job on this host left (job_files)
    job = FleetContext(role, config, secret)
    context.set_current(job)
    atexit.unregister(_freeze_gc_at_exit)  # once a process, and after _release_at_exit (atexit runs last-in first)
    atexit.register(_freeze_gc_at_exit)
    atexit.register(_release_at_exit, job)
    atexit.register(_report_at_exit, job)  # before the release: worker 0 gathers through the store
    _mark_joined(role)
    try:
        job.implementation(None)  # the strategy joins the job (a server serves here, then exits)
    except rendezvous.PortInUseError as error:
        if role.source == "fleetrun":
            print(f"fleet: {error} fleetrun will relaunch with a new port.", file=sys.stderr)
            sys.exit(env.EXIT_PORT_IN_USE)
        raise


def _honour_is_collective(config: DistributedStrategy, is_collective: bool) -> DistributedStrategy:
    """Paddle's is_collective against the strategy: the mode it implies, or an error if the strategy says otherwise."""
    serves = registry.get(config.mode).uses_servers
    if is_collective:
        if serves:
            raise StrategyError(
                f"fleet.init(is_collective=True) asks for collective training, but the strategy has mode={config.mode!r}. "
                "Use is_collective=False for a parameter-server job, or a collective strategy."
            )
        return config
    if serves:
        return config
    if "mode" in config.model_fields_set:
        raise StrategyError(
            f"fleet.init(is_collective=False) asks for a parameter-server job, but the strategy has "
            f"mode={config.mode!r}. Use is_collective=True, or a strategy with mode='ps'."
        )
    chosen = config.model_dump(exclude_unset=True)
    return DistributedStrategy(**{"update": DEFAULT_PS_UPDATE, **chosen, "mode": SERVER_MODE})


def _check_is_collective(config: DistributedStrategy, is_collective: bool, role: RoleInfo) -> DistributedStrategy:
    if is_collective and role.server_num:
        raise StrategyError(
            f"fleet.init(is_collective=True) asks for collective training, but the launch started {role.server_num} "
            "parameter server(s) (fleetrun --servers, or the launcher's server variables). Use is_collective=False "
            "for a parameter-server job, or launch without servers."
        )
    if not is_collective and not role.server_num:
        if role.worker_num > 1:
            raise StrategyError(
                f"fleet.init(is_collective=False) asks for a parameter-server job, but the launch started "
                f"{role.worker_num} workers and no parameter server. Start servers (`fleetrun --servers S --workers N`, "
                "or servers=S in the strategy under torchrun/mpirun/srun), or use is_collective=True."
            )
        # One process and no server: a local run of a parameter-server script trains on its own.
        return DistributedStrategy(timeout_s=config.timeout_s, seed=config.seed)
    return config


def _check_same_init(context: FleetContext, role: RoleInfo, config: DistributedStrategy, asked: bool) -> None:
    """A second fleet.init must ask for what the first one set up."""
    if context.role != role:
        raise FleetError(
            f"fleet.init was already called in this process as {context.role.name}; this call finds "
            f"{role.name}. Call fleet.init once (fleet.stop_worker() ends the job)."
        )
    if asked and config != context.strategy:
        raise FleetError(
            f"fleet.init was already called with {_describe(context.strategy)}; this call asks for "
            f"{_describe(config)}. A process joins one job under one strategy: call fleet.init once, or "
            "fleet.stop_worker() before starting another."
        )


def _release_at_exit(job: FleetContext) -> None:
    """A script that ends without fleet.stop_worker(): once the strategy's own exit handlers agreed
    with the peers that the job is over (atexit runs them first: they were registered later), the
    group and the store go while Python still runs (the heartbeats are stopped by store_calls.settle,
    which runs after this: a store call in flight at finalisation aborts a finished process)."""
    if context.current() is job and not hasattr(sys, "last_value"):
        job.release()


def _report_at_exit(job: FleetContext) -> None:
    """The end of a job run without fleetrun (the script exits without fleet.stop_worker()): worker 0 prints
    "where the time went" (:mod:`fleet.telemetry.job_summary`)."""
    if context.current() is job and not hasattr(sys, "last_value"):
        _final_report(job)


def _final_report(job: FleetContext) -> None:
    if not job.role.is_worker or not job_summary.enabled() or not job.take_final_report():
        return
    report(label="final")


def report(label: str | None = None) -> dict[str, Any] | None:
    """Worker 0 prints the job's "where the time went" table now and returns the report (other workers:
    None). Call it on every worker. fleet does it once at the end of a job not run by fleetrun
    (``FLEET_REPORT=0`` turns that off); under fleetrun the launcher prints it after the job."""
    global _REPORTS
    job = current_job()
    if label is None:
        _REPORTS += 1
        label = str(_REPORTS)
    role = job.role
    try:
        store = job.rendezvous_store() if role.worker_num > 1 and role.master else None
        return job_summary.gather(store, role.worker_index, role.worker_num, f"fleet-report/{label}")
    except Exception as error:  # noqa: BLE001 - a report must never fail the job
        print(f"fleet: no timing report: {error}", file=sys.stderr)
        return None


_REPORTS = 0  # fleet.api.report() calls in this process: every worker counts alike, so their keys pair


def _freeze_gc_at_exit() -> None:
    """The last of fleet's exit handlers, once the job released its group, store and sockets: the
    interpreter's final garbage collections then skip torch's million import-time objects, which
    took 0.8-1 s of CPU at every worker's and server's exit (0.2 s frozen). Only objects kept
    alive by a reference cycle at exit lose their finalizer, which Python never promised to run."""
    gc.freeze()


def _mark_joined(role: RoleInfo) -> None:
    """Tell fleetrun that this worker called fleet.init (its summary names workers that never did)."""
    log_dir = env.current().str(env.FLEET_LOG_DIR)
    if log_dir and role.is_worker:
        job_files.mark_joined(log_dir, role.worker_index)


def current_job() -> FleetContext:
    """This process's job; a plain process that never called fleet.init joins as worker 0 of 1."""
    if context.current() is None:
        init()
    job = context.current()
    assert job is not None
    return job


def distributed_optimizer(
    optimizer: torch.optim.Optimizer,
    strategy: DistributedStrategy | None = None,
    *,
    init: Callable[[torch.nn.Module], None] | None = None,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so ``step()`` trains across the job. ``isinstance(result, torch.optim.Optimizer)`` holds.

    A model built on the meta device (``mode="sharding"`` only) gets storage for this worker's shards
    and values from its modules' ``reset_parameters()``, then ``init`` (called on every module, as
    ``model.apply(init)`` calls it); docs/strategies.md.
    """
    _check_initialised(optimizer)
    impl = current_job().wrapping(strategy)
    params = [p for group in getattr(optimizer, "param_groups", None) or [] for p in group["params"]]
    if _meta_model(impl, params, init):
        wrapped = impl.wrap_optimizer(optimizer, init=init)  # type: ignore[call-arg]
    else:
        wrapped = impl.wrap_optimizer(optimizer)
    # DDP programs set require_backward_grad_sync on the model: here it is the model the optimizer trains
    for model in modules_holding([p for group in wrapped.param_groups for p in group["params"]]):
        _with_grad_sync_flag(model)
    return wrapped


def _meta_model(impl: Strategy, params: list[torch.Tensor], init: Any) -> bool:
    """Whether the model is built on the meta device (or ``init`` is given): refused where the strategy keeps
    whole models, which need storage for every parameter on every worker."""
    meta = [p for p in params if p.is_meta]
    if not meta and init is None:
        return False
    if not impl.materializes_meta_models:
        from fleet.training.owners import names_of

        what = (
            f"parameter {names_of(meta[:1])[0]!r} is on the meta device (built without storage)"
            if meta
            else "init= initialises a model built on the meta device"
        )
        raise FleetError(
            f"{what}, but mode={impl.config.mode!r} keeps the whole model on every worker, so every worker would "
            "have to allocate all of it anyway. Build the model on a real device (cpu, cuda), or use "
            "mode='sharding', which gives each worker storage for its own shards only."
        )
    return True


def _check_initialised(optimizer: Any) -> None:
    """A lazy module's parameter has no shape until its first forward: there is nothing to start every worker from."""
    groups = getattr(optimizer, "param_groups", None) or []
    lazy = [p for group in groups for p in group["params"] if torch.nn.parameter.is_lazy(p)]
    if lazy:
        from fleet.training.owners import names_of

        raise FleetError(
            f"parameter {names_of(lazy[:1])[0]!r} is not initialised yet (a lazy module such as nn.LazyLinear "
            "gets its shape at its first forward pass): run one forward pass on a batch before "
            "fleet.distributed_optimizer, so that every worker can start from worker 0's values."
        )


def distributed_model(
    model: torch.nn.Module,
    strategy: DistributedStrategy | None = None,
    *,
    init: Callable[[torch.nn.Module], None] | None = None,
) -> torch.nn.Module:
    """Broadcast worker 0's parameters and buffers and keep buffers in step (DDP semantics). Optional.

    ``init``: as in :func:`distributed_optimizer`, for a model built on the meta device.
    """
    job = current_job()
    job.models.append(model)
    impl = job.wrapping(strategy)
    if _meta_model(impl, list(model.parameters()) + list(model.buffers()), init):
        return _with_ddp_habits(impl.wrap_model(model, init=init))  # type: ignore[call-arg]
    return _with_ddp_habits(impl.wrap_model(model))


def _with_ddp_habits(model: torch.nn.Module) -> torch.nn.Module:
    """``model.module`` and ``model.no_sync()``, as on a DDP-wrapped model, unless the model has its own.

    These are writes to the user's model, on purpose: DDP's users reach its surface by attribute, and the
    model is returned as itself (its state_dict has no ``module.`` prefix), so ``.module`` is the model
    too, set past nn.Module's __setattr__ so that it is no submodule (no cycle, no new keys). The other
    two go through the model's own __setattr__ (a plain attribute for a function or a bool).
    """
    if "module" not in model._modules and not hasattr(model, "module"):
        object.__setattr__(model, "module", model)
    if not hasattr(model, "no_sync"):
        model.no_sync = context.no_sync
    return _with_grad_sync_flag(model)


def _with_grad_sync_flag(model: torch.nn.Module) -> torch.nn.Module:
    """DDP's ``model.require_backward_grad_sync`` (True; False skips the reduction of the backward after the
    next forward, as in DDP), once per model, unless the model has an attribute of that name itself."""
    if context.GRAD_SYNC_FLAG not in model.__dict__ and not hasattr(model, context.GRAD_SYNC_FLAG):
        setattr(model, context.GRAD_SYNC_FLAG, True)
        model.register_forward_pre_hook(context.read_grad_sync_flag)
    return model


def distributed_loader(loader: Any, *, split_batches: bool | None = None) -> Any:
    """This worker's shard of ``loader``; call ``set_epoch(epoch)`` on it to reshuffle each epoch.

    A loader whose items are whole batches (``batch_size=None``, or 1 with a ``collate_fn`` that
    returns a mini-batch) is split: each worker keeps its equal slice of every batch, so the global
    batch stays the item (:mod:`fleet.data.whole_batches`; docs/data.md).

    ``split_batches=True`` (accelerate's name) takes every item of any loader as one step's global
    batch: worker r of W keeps samples ``[r*B/W, (r+1)*B/W)`` of each (``torch.tensor_split``'s shares
    when W does not divide B; ``loader.share_weight`` weighs the loss then), and one process checks
    that each batch can be split. ``split_batches=False`` deals whole-batch items out as they are.
    """
    job = current_job()
    sharded = shard_loader(
        loader, job.role.worker_num, job.role.worker_index, seed=job.strategy.seed, split_batches=split_batches
    )
    job.loaders.append(sharded)
    return sharded


def role_info() -> RoleInfo:
    return current_job().role


def worker_index() -> int:
    return current_job().role.worker_index


def local_rank() -> int:
    """This process's index on its machine (torchrun's LOCAL_RANK): workers 0..W-1, then servers.

    The number to pick this process's GPU with: ``torch.cuda.set_device(fleet.local_rank())``.
    """
    return current_job().role.local_rank


def worker_num() -> int:
    return current_job().role.worker_num


def server_index() -> int:
    return current_job().role.server_index


def server_num() -> int:
    return current_job().role.server_num


def server_endpoints() -> list[str]:
    return current_job().implementation(None).server_endpoints()


def is_worker() -> bool:
    return current_job().role.is_worker


def is_server() -> bool:
    return current_job().role.is_server


def is_first_worker() -> bool:
    return current_job().role.is_first_worker


def barrier_worker() -> None:
    """Wait until every worker reaches this call."""
    current_job().implementation(None).barrier()


def shrink(threshold: float | None = None) -> None:
    """Evict sparse-table rows past their ``ttl_steps`` and, with ``threshold``, rows whose score is below it.

    Paddle's ``fleet.shrink``: call it on every worker (like ``save_persistables``). The score is a
    row's decayed ``0.1 * (shows - clicks) + clicks`` (``fleet.nn.SparseEmbedding.record_clicks``).
    """
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, int | float)):
        raise TypeError(f"fleet.shrink(threshold): a number or None, got {threshold!r}")
    strategy = context.strategy()
    if strategy is None:
        tables.shrink_all(threshold)
    else:
        strategy.shrink_tables(threshold)


def join() -> Any:
    """``with fleet.join(): <training loop>``: workers whose loop ends first wait for the others.

    Collective mode: a finished worker shadows the others' collectives until every loop has
    ended (averages then count only the workers that still have data), and all leave the block
    with the last trainer's parameters and optimizer state. Without it, a worker whose loop ends
    early makes the others fail with a PeerError naming it. Elsewhere it does nothing.
    """
    return current_job().implementation(None).uneven_inputs()


def stop_worker() -> None:
    """This worker is done: release connections (and let parameter servers finish)."""
    job = context.current()
    if job is None:
        return
    try:
        _final_report(job)  # the end of the job: worker 0 prints where the time went (not under fleetrun)
        job.stop()
    finally:
        context.set_current(None)


def init_server(dirname: str | None = None) -> None:
    """Paddle's explicit form: bind this server process (``fleet.init`` already serves on servers)."""
    if dirname is not None:
        raise FleetError("init_server(dirname) is not supported; call fleet.load_persistables(dirname) on worker 0.")
    current_job().implementation(None).serve(run=False)


def run_server() -> None:
    """Paddle's explicit form: serve until every worker stopped, then exit the process with status 0."""
    current_job().implementation(None).serve(run=True)


def _reset_for_tests() -> None:
    """Forget the context without talking to peers (tests reuse one interpreter)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    default_group.forget()
    context.set_current(None)
