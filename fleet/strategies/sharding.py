"""Sharded data parallelism on PyTorch's FSDP2: each worker holds 1/N of the parameters, gradients and optimizer state.

Written only against :class:`~fleet.strategies.base.Strategy` (``docs/strategies.md`` walks
through it): the core knows nothing of it beyond its name in the registry.

``distributed_optimizer(opt, DistributedStrategy(mode="sharding"))`` finds the model the
optimizer's parameters belong to, makes every worker start from worker 0's values, and
shards it with ``torch.distributed.fsdp.fully_shard``: each child module holding parameters as a
unit, looking inside containers (``ModuleList``, ``ModuleDict``, ``Sequential``: their blocks are
the units, recursively; see :func:`_default_units`), or the classes named in ``shard_modules``,
then the model itself.
``fully_shard`` replaces the parameters with sharded ones, so the user's optimizer gets them
in place of the old ones, in the same param groups with the same hyper-parameters (an LR
scheduler built on it keeps working), and any state it already had is sharded the same way.

A model built on the ``meta`` device is sharded first, then each worker materialises and
initialises only its own shards (:mod:`fleet.sharding.meta_init`; ``init=`` on
``distributed_optimizer``/``distributed_model``). FSDP2's collectives are timed as the step's
communication (:mod:`fleet.sharding.comm_timing`); with CPU workers all on one host they go
through shared memory instead of gloo (:mod:`fleet.sharding.shm_collectives`; ``shared_memory=False``
keeps gloo).

Stages (``sharding_stage``), mapped onto FSDP2's ``reshard_after_forward``:

- 3 (ZeRO-3, FSDP's FULL_SHARD): a unit's parameters are gathered for its forward, freed,
  and gathered again for its backward; the least memory.
- 2 (ZeRO-2, Paddle's sharding stage 2): gathered once, whole from forward to the end of
  backward; one all-gather per step fewer, ZeRO-2's peak memory (FSDP2 frees them after
  backward rather than keeping them between steps, which costs no communication: ZeRO-2
  gathers the updated parameters after the step anyway).

In both, gradients are reduce-scattered and each worker's optimizer steps its own shard.
``mixed_precision`` is FSDP2's ``MixedPrecisionPolicy`` (compute in bf16/fp16, gradients
reduced in float32). Checkpoints go through ``torch.distributed.checkpoint``: every worker
writes its shards, and a checkpoint saved by N workers loads with M; ``fleet.nn.SparseEmbedding``
rows beside them (:mod:`fleet.sharding.table_rows`).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fleet.collective import lockstep, sharded_rows, sparse_grads, table_wise
from fleet.collective.all_to_all import SharedMemoryAllToAll
from fleet.collective.broadcast import average_tensors, broadcast_tensors, check_same_shapes
from fleet.collective.layout import ParamMap
from fleet.errors import FleetError
from fleet.nn.rows_state import rows_in_state_dict
from fleet.sharding import autograd as sharded_autograd
from fleet.sharding import comm_timing, meta_init, shm_collectives, table_rows
from fleet.sharding.order import ShardedOrder
from fleet.sparse import backends as tables
from fleet.strategies.base import Runtime, Strategy, check_reduce
from fleet.training import owners
from fleet.training.optimizer import WrappedOptimizer

if TYPE_CHECKING:
    from fleet.storage.layout import Save, SaveWriter
    from fleet.strategy import DistributedStrategy

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SHARDED = "sharded"
"""The part of a checkpoint that holds torch.distributed.checkpoint's shards (any worker count loads it)."""


class ShardingStrategy(Strategy):
    name = "sharding"
    supported_updates = ("sync",)
    reshardable_checkpoints = True

    owned_fields = frozenset({"sharding_stage", "shard_modules", "mixed_precision"})

    @classmethod
    def check(cls, config: DistributedStrategy) -> None:
        for field, allowed in (
            ("servers", 0),
            ("backup_workers", 0),
            ("local_sgd_steps", 0),
            ("grad_accumulation_steps", 1),
            ("grad_compression", "none"),
        ):
            if getattr(config, field) != allowed:
                raise ValueError(
                    f"{field}={getattr(config, field)!r} does not apply to mode='sharding' (FSDP2 reduce-scatters "
                    "every gradient; use mixed_precision to reduce what travels, mode='collective' for the rest)"
                )
        super().check(config)

    def __init__(self, config: DistributedStrategy, runtime: Runtime):
        super().__init__(config, runtime)
        self._sharded: weakref.WeakSet = weakref.WeakSet()  # the models fully_shard was applied to
        self._no_sync = 0  # no_sync() blocks entered and not left
        self._deferred = False  # require_backward_grad_sync was False at the last forward
        self._materialized: weakref.WeakSet = weakref.WeakSet()  # meta models one worker gave storage (unsharded)
        self._replaced = ParamMap()  # an old parameter (weakly) -> its sharded replacement
        self._optimizers: list[weakref.ref] = []
        self._order: ShardedOrder | None = None  # every worker runs the same sharded modules (made with the group)
        self._autograd: sharded_autograd.EntryPoints | None = None  # torch.autograd's, held until shutdown
        self._shared: shm_collectives.SharedMemoryCollectives | None = None  # CPU workers on one host
        self._all_to_all: SharedMemoryAllToAll | None = None  # sharded tables' exchanges, CPU workers on one host
        self._tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> its ShardedRows

    # --- sharding the model ----------------------------------------------------------------

    def _roots(self, params: list[torch.Tensor]) -> list[torch.nn.Module]:
        """The models that hold ``params``: the one given to distributed_model, else the outermost modules."""
        given = self.runtime.model_for(params)
        if given is not None:
            return [given]
        found = owners.modules_holding(params)
        if not found:
            raise FleetError(
                "mode='sharding' shards the model that holds the optimizer's parameters, but these parameters "
                "belong to no nn.Module. Build the optimizer from model.parameters()."
            )
        return found

    def _shard(self, model: torch.nn.Module, init: meta_init.Init | None = None) -> dict[int, torch.nn.Parameter]:
        """fully_shard ``model`` (once); return ``id(old parameter) -> its sharded replacement``.

        A model built on the meta device is sharded first, then only this worker's shards get
        storage and values (:mod:`fleet.sharding.meta_init`).
        """
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        before = dict(model.named_parameters())
        group = self.runtime.process_group(self.config.timeout_s)
        if model in self._sharded or model in self._materialized:
            return {}
        params = list(before.values())
        on_meta = meta_init.on_meta(params + list(model.buffers()))
        if init is not None and not on_meta:
            raise FleetError(
                f"init= initialises a model built on the meta device, but {type(model).__name__}'s parameters are "
                f"on {params[0].device if params else 'no device'}: they have their values already. Drop init=, "
                "or build the model under `with torch.device('meta'):`."
            )
        if group is None:  # one worker: nothing to shard, a meta model still needs storage and values
            if not on_meta:
                return {}
            meta_init.materialize(model, meta_init.target_device(), init)
            self._materialized.add(model)
            return self._replacements(before, dict(model.named_parameters()))
        check_same_shapes(params, lambda: list(before), group)
        if not on_meta:
            broadcast_tensors(params + list(model.buffers()), group)  # FSDP2 would shard each worker's own values
        device = meta_init.target_device().type if on_meta else "cuda" if params and params[0].is_cuda else "cpu"
        mesh = init_device_mesh(device, (dist.get_world_size(group),))
        # fleet.nn.SparseEmbedding's placeholder (no elements) names the table: it must stay the same object.
        placeholders = {p for p in params if tables.module_of(p) is not None}
        options: dict[str, Any] = {
            "mesh": mesh,
            "reshard_after_forward": self.config.sharding_stage == 3,
            "ignored_params": placeholders,
        }
        if self.config.mixed_precision != "none":
            dtype = DTYPES[self.config.mixed_precision]
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        units = self._units(model)
        if self._order is None:
            self._autograd = sharded_autograd.EntryPoints()
            self._order = ShardedOrder(
                group,
                self.config.timeout_s,
                self.runtime.diagnose_peers,
                self.config.shared_memory,
                entry_points=self._autograd,
            )
        root = _describe(model, len(self._order.roots))  # before fully_shard renames its class
        self._order.roots.append(root)
        inside = {id(unit): name for name, unit in model.named_modules()}
        for unit in units:
            fully_shard(unit if len(unit) > 1 else unit[0], **options)
        fully_shard(model, **options)
        shared = self._shared_collectives(device)
        for module in [unit[0] for unit in units] + [model]:  # modules sharded as one group share its collectives
            if shared is not None:
                name = f"{root}.{inside[id(module)]}" if module is not model else root
                shm_collectives.install(module, name, shared, self._order.clock)
            else:
                comm_timing.time_collectives(module, self._order.clock)
        if on_meta:
            meta_init.materialize(model, meta_init.target_device(), init)
            broadcast_tensors(list(model.buffers()), group)  # replicated, not sharded: worker 0's everywhere
        # FSDP2 picks its root at the first forward and refuses a submodule called before the model
        # ("requires running forward through the root module first"); the model is the root.
        model._get_fsdp_state()._lazy_init()
        self._autograd.track(model)  # backward(inputs=...) and autograd.grad on its parameters
        self._order.watch([(f"{root}.{inside[id(m)]}", m) for unit in units for m in unit] + [(root, model)])
        self._sharded.add(model)
        return self._replacements(before, dict(model.named_parameters()))

    def _replacements(
        self, before: dict[str, torch.nn.Parameter], after: dict[str, torch.nn.Parameter]
    ) -> dict[int, torch.nn.Parameter]:
        for name, old in before.items():
            self._replaced.set(old, after[name])
        return {id(before[name]): after[name] for name in before}

    def _units(self, model: torch.nn.Module) -> list[list[torch.nn.Module]]:
        """The submodules sharded ahead of the model, each a list: one module, or modules sharing parameters.

        Modules that share a parameter (tied weights) are sharded together, as one FSDP2 group: two
        units would shard the parameter twice and train two copies apart, and as one group a call of
        any of them gathers it. A module sharing a parameter with the model itself is left to the
        model's own unit.
        """
        names = set(self.config.shard_modules)
        if names:
            units = [m for m in model.modules() if m is not model and type(m).__name__ in names]
            if not units:
                raise FleetError(
                    f"shard_modules={sorted(names)} matches no submodule of {type(model).__name__}; its submodules "
                    f"are of the classes {sorted({type(m).__name__ for m in model.modules() if m is not model})}."
                )
        else:
            units = _default_units(model)
        groups = [([unit], _param_ids([unit])) for unit in units]
        for i in range(len(groups)):  # merge the candidates that share a parameter (few: a quadratic pass)
            for j in range(i + 1, len(groups)):
                if groups[i][1] & groups[j][1]:
                    groups[j] = (groups[i][0] + groups[j][0], groups[i][1] | groups[j][1])
                    groups[i] = ([], set())
        return [modules for modules, _ in groups if modules and not _shares_parameters(modules, model)]

    def _shared_all_to_all(self) -> SharedMemoryAllToAll | None:
        """The sharded tables' all-to-all through shared memory: CPU workers all on this host (the announcements'
        shared memory, once a model is sharded), ``shared_memory`` on."""
        host = self._order.host if self._order is not None else None
        if self._all_to_all is None and host is not None:
            self._all_to_all = SharedMemoryAllToAll(host, self.runtime.diagnose_peers)
        return self._all_to_all

    def _shared_collectives(self, device: str) -> shm_collectives.SharedMemoryCollectives | None:
        """FSDP2's collectives through shared memory: CPU workers all on this host, ``shared_memory`` on."""
        assert self._order is not None
        if device != "cpu" or self._order.host is None:
            return None  # CUDA keeps FSDP2's own (NCCL); across hosts, gloo
        if self._shared is None:
            self._shared = shm_collectives.SharedMemoryCollectives(self._order.host, self.runtime.diagnose_peers)
        return self._shared

    @property
    def order(self) -> ShardedOrder | None:
        """The announcements before FSDP2's collectives (and their clock); None until a model is sharded."""
        return self._order

    # --- the Strategy interface ------------------------------------------------------------------

    materializes_meta_models = True

    def wrap_model(self, model: torch.nn.Module, init: meta_init.Init | None = None) -> torch.nn.Module:
        self._shard(model, init)
        return model

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        self._no_sync += 1  # FSDP2's own switch: unsharded gradients accumulate until it is back on
        self._apply_gradient_sync()
        try:
            yield
        finally:
            self._no_sync -= 1
            self._apply_gradient_sync()

    def defer_reduction(self, defer: bool) -> None:
        if defer != self._deferred:  # only on a change: FSDP2's switch walks every module
            self._deferred = defer
            self._apply_gradient_sync()

    def _apply_gradient_sync(self) -> None:
        """FSDP2's switch on every sharded model: off inside no_sync() or after a forward with
        require_backward_grad_sync False."""
        on = not (self._no_sync or self._deferred)
        for model in list(self._sharded):
            model.set_requires_gradient_sync(on)

    def wrap_optimizer(
        self, optimizer: torch.optim.Optimizer, init: meta_init.Init | None = None
    ) -> torch.optim.Optimizer:
        replaced = self.sharded([p for group in optimizer.param_groups for p in group["params"]], init)
        if replaced:
            _swap_parameters(optimizer, replaced)
        wrapped = ShardingOptimizer(optimizer, self)
        self._optimizers.append(weakref.ref(wrapped))
        return wrapped

    def sharded(self, params: list[torch.Tensor], init: meta_init.Init | None = None) -> dict[int, torch.nn.Parameter]:
        """Shard the models holding ``params`` (once each); ``id(old parameter) -> its sharded replacement``."""
        if self.runtime.process_group(self.config.timeout_s) is None and init is None and not meta_init.on_meta(params):
            return {}  # one worker: nothing to shard
        _refuse_sparse_gradients(params)
        # Parameters of a model already sharded (by distributed_model, or another optimizer) were replaced.
        replaced = {id(p): self._replaced.get(p) for p in params if p in self._replaced}
        fresh = [p for p in params if id(p) not in replaced and not _is_sharded(p)]
        if fresh:
            for model in self._roots(fresh):
                replaced.update(self._shard(model, init))
        return replaced

    def table_backend(self, module: tables.TableModule) -> tables.TableBackend | None:
        """fleet.nn.SparseEmbedding tables sharded across the workers (fleet.collective.sharded_rows), or (with
        ``table_placement="replicated"``, or a ``max_rows`` cap under "auto") whole on every worker, updated with
        every worker's rows."""
        group = self.runtime.process_group(self.config.timeout_s)
        if group is None:
            return None
        if sharded_rows.shards(self.config.table_placement, True, module):
            backend = self._tables.get(module)
            if backend is None:
                backend = self._tables[module] = table_wise.sharded_backend(
                    self.config.table_placement, module, group, self.config.collective_wait_s,
                    "with tables sharded in sharding mode",
                    lambda values: self.all_reduce(values, "sum"), diagnose=self.runtime.diagnose_peers,
                    local=self._shared_all_to_all(),
                )  # fmt: skip
            return backend
        world = dist.get_world_size(group)
        return tables.ExchangedRows(
            module.local,
            lambda m, ids, grads, lr: sparse_grads.gather_rows(ids, grads, group, world, m.embedding_dim),
            where="in sharding mode",
        )

    def inference_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Whole tensors gathered from the shards (every worker takes part)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        with rows_in_state_dict(False):  # the caller exports the tables' rows itself
            return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))

    def shutdown(self) -> None:
        if self._order is not None:
            self._order.close()
        if self._autograd is not None:
            self._autograd.close()  # torch.autograd.backward and grad are torch's own again
        if self._shared is not None:
            self._shared.close()
        if self._all_to_all is not None:
            self._all_to_all.close()
        super().shutdown()

    def barrier(self) -> None:
        group = self.runtime.process_group(self.config.timeout_s)
        if group is not None:
            if self._order is not None:
                self._order.before_collective(lockstep.BARRIER)
            dist.barrier(group=group)

    def all_reduce(self, values: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self._order is not None:  # among FSDP2's collectives: announced like them
            check_reduce(values, op)
            self._order.before_collective(lockstep.REDUCE, values.numel(), lockstep.REDUCE_OPS.index(op))
        return super().all_reduce(values, op)

    def save_state(self, save: SaveWriter, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Every worker writes its shards (torch.distributed.checkpoint), in a format any worker count loads."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        # torch.distributed.checkpoint takes state-dict keys for attributes: the tables' rows go in a part of their own
        with rows_in_state_dict(False):
            model_state, optim_state = get_state_dict(model, _inner(optimizer))
        state = {"model": model_state, "optimizer": table_rows.split_placeholders(optim_state, model)[0]}
        with _one_process_quietly():
            dcp.save(
                state,
                checkpoint_id=save.directory(SHARDED),
                storage_writer=save.checkpoint_writer(SHARDED),
                no_dist=not dist.is_initialized(),
            )
        table_rows.save(save, model, self.runtime.role.worker_index)

    def load_state(self, save: Save, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        inner = _inner(optimizer)
        save.verify(SHARDED)  # torch.distributed.checkpoint reads these itself: a damaged one is named first
        with rows_in_state_dict(False):
            model_state, optim_state = get_state_dict(model, inner)
            optim_state, placeholders = table_rows.split_placeholders(optim_state, model)
            state = {"model": model_state, "optimizer": optim_state}
            with _one_process_quietly():
                dcp.load(
                    state,
                    checkpoint_id=save.part(SHARDED),
                    storage_reader=save.checkpoint_reader(SHARDED),
                    no_dist=not dist.is_initialized(),
                )
            state["optimizer"]["state"].update(placeholders)
            set_state_dict(model, inner, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        table_rows.load(save, model)  # after set_state_dict, whose initialising step may have stepped the tables


class ShardingOptimizer(WrappedOptimizer):
    """The user's optimizer over the sharded parameters; FSDP2 already reduced the gradients in backward."""

    def __init__(self, optimizer: torch.optim.Optimizer, strategy: ShardingStrategy):
        super().__init__(optimizer)
        self.strategy = strategy

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Shards the new parameters' model first (every worker starts from worker 0's values), as wrapping does."""
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        replaced = self.strategy.sharded(params)
        self._inner.add_param_group({**param_group, "params": [replaced.get(id(p), p) for p in params]})

    def step(self, closure=None):
        group = self.strategy.runtime.process_group(self.strategy.config.timeout_s)
        order = self.strategy.order
        if group is not None:
            params = self.parameters()
            _refuse_unsharded(params)
            _shard_whole_gradients(params, group, order)
        loss = self._inner.step(closure)
        # FSDP2's gathers and reduce-scatters in forward and backward, fleet's announcements before them
        self._end_step(comm_s=order.take_comm() if order is not None else 0.0)
        return loss


def _describe(model: torch.nn.Module, earlier: int) -> str:
    """A sharded model in a message: its repr when short (``Linear(in_features=8, ...)``), and which one it was."""
    text = repr(model)
    text = text if "\n" not in text and len(text) <= 80 else type(model).__name__
    return f"{text} (model {earlier + 1} sharded)" if earlier else text


def _inner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return optimizer.inner if isinstance(optimizer, WrappedOptimizer) else optimizer


def _swap_parameters(optimizer: torch.optim.Optimizer, replaced: dict[int, torch.nn.Parameter]) -> None:
    """Put the sharded parameters in place of the old ones, in the same param groups, with their state sharded."""
    from torch.distributed.tensor import distribute_tensor

    for group in optimizer.param_groups:
        group["params"] = [replaced.get(id(p), p) for p in group["params"]]
    for old_id, new in replaced.items():
        old = next((p for p in list(optimizer.state) if id(p) == old_id), None)
        if old is None:
            continue
        state = optimizer.state.pop(old)
        optimizer.state[new] = {
            key: distribute_tensor(value, new.device_mesh, new.placements)
            if torch.is_tensor(value) and value.shape == new.shape and hasattr(new, "device_mesh")
            else value  # a table's zero-size placeholder stays a plain tensor, and so does its state (Adagrad's)
            for key, value in state.items()
        }


def _is_sharded(param: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor) or tables.module_of(param) is not None


def _param_ids(modules: list[torch.nn.Module]) -> set[int]:
    return {id(p) for m in modules for p in m.parameters()}


def _shares_parameters(modules: list[torch.nn.Module], model: torch.nn.Module) -> bool:
    """Whether a parameter of ``modules`` is also held outside them (tied to the model's own, or to a
    module nested in a unit): FSDP2 would shard it twice, as two parameters trained apart, so such
    modules are left to the model's own unit, which holds both."""
    inside = {id(m) for unit in modules for m in unit.modules()}
    mine = _param_ids(modules)
    return any(id(p) in mine for m in model.modules() if id(m) not in inside for p in m.parameters(recurse=False))


def _refuse_sparse_gradients(params: list[torch.Tensor]) -> None:
    found = owners.find_owners(params)
    sparse = [found[id(p)].name for p in params if owners.is_sparse_embedding_weight(found[id(p)])]
    if sparse:
        raise FleetError(
            f"parameter {sparse[0]!r} is the weight of an nn.Embedding/EmbeddingBag with sparse=True: mode='sharding' "
            "(FSDP2) cannot reduce-scatter sparse gradients. Use sparse=False, fleet.nn.SparseEmbedding for a "
            "big table, or mode='collective', which averages sparse gradients as sparse."
        )


def _shard_whole_gradients(params: list[torch.Tensor], group: dist.ProcessGroup, order: ShardedOrder | None) -> None:
    """Average the gradients set by hand as whole tensors (from torch.autograd.grad) and keep this worker's shard.

    A backward leaves FSDP2's averaged shard in ``.grad``; ``p.grad = g`` with ``g`` from
    ``torch.autograd.grad`` leaves this worker's own gradient of the whole parameter, which one
    process would have averaged over the union of the batches. The step is announced among
    FSDP2's collectives with which parameters carry one, so the workers agree on them (a worker
    that set one where another did not is named, instead of pairing collectives wrongly) and a
    step without any costs nothing more.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    if order is None:
        return  # nothing sharded by fleet: no gradient of a sharded parameter to average
    sharded = [p for p in params if isinstance(p, DTensor)]
    whole = [p.grad is not None and not isinstance(p.grad, DTensor) for p in sharded]
    differs = order.before_step(whole)
    if differs is not None:
        name = owners.names_of([sharded[differs]])[0]
        raise FleetError(
            f"parameter {name!r}: some workers set its .grad by hand as a whole tensor (from torch.autograd.grad) "
            "and others did not, so there is no average to take. Set it the same way on every worker."
        )
    if not any(whole):
        return
    chosen = [p for p, flag in zip(sharded, whole, strict=True) if flag]
    for p in chosen:
        if p.grad.shape != p.shape:
            name = owners.names_of([p])[0]
            raise FleetError(
                f"parameter {name!r}: .grad was set to a tensor of shape {tuple(p.grad.shape)}, but the parameter's "
                f"shape is {tuple(p.shape)}."
            )
    averages = [p.grad.detach().to(p.dtype, copy=True) for p in chosen]  # the script's tensors stay as they are
    started = time.perf_counter()
    average_tensors(averages, group, dist.get_world_size(group))
    order.clock.add(time.perf_counter() - started)
    for p, average in zip(chosen, averages, strict=True):
        p.grad = distribute_tensor(average, p.device_mesh, p.placements, src_data_rank=None)


def _refuse_unsharded(params: list[torch.Tensor]) -> None:
    """A parameter the optimizer steps that fleet never sharded would train on this worker's gradient alone."""
    unsharded = [p for p in params if not _is_sharded(p)]
    if unsharded:
        name = owners.names_of(unsharded[:1])[0]
        raise FleetError(
            f"parameter {name!r} is in the optimizer but was never sharded, so its gradient is this worker's "
            "own, not the average over the workers: it was added after fleet.distributed_optimizer without "
            "going through it (optimizer.inner.add_param_group, or a module attached to a model already "
            "sharded). Add it with the wrapped optimizer's add_param_group, in a module of its own."
        )


@contextmanager
def _one_process_quietly() -> Iterator[None]:
    """torch.distributed.checkpoint warns that it "assumes the intent" of a one-process save or load even when
    told so (``no_dist=True``): fleet's one-process saves mean it, so that warning is not the user's."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"torch\.distributed is (disabled, )?unavailable or uninitialized", category=UserWarning
        )
        yield


_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)


def _default_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The units FSDP2's recipe shards when ``shard_modules`` names none: the repeated blocks.

    Each child with parameters is a unit, except a container (``ModuleList``, ``ModuleDict``,
    ``Sequential``), whose own children are looked at the same way, recursively: a transformer's
    blocks in a ``ModuleList`` (GPT-, Llama-, ViT-style) each become a unit (FSDP2 cannot shard a
    ``ModuleList``, which has no forward), and the model itself is the last unit.
    """
    units = []
    for child in model.children():
        if not any(p.numel() for p in child.parameters()):
            continue
        units.extend(_default_units(child) if isinstance(child, _CONTAINERS) else [child])
    return units
