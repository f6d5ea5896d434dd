"""Collective data parallelism: every worker holds the whole model; gradients are averaged.

Sync only. One :class:`~fleet.collective.grad_sync.GradSync` per job is shared by every
optimizer wrapped here and every model given to ``distributed_model``, so the order of
collectives is one agreed order however many optimizers share a backward. Options:
gradient buckets (bucket_mb), fp16/bf16 gradient compression, gradient accumulation over
micro-batches, and local SGD (average parameters every k steps instead of gradients every
step). ``fleet.join()`` handles loops that end unevenly.
"""

from __future__ import annotations

import atexit
import sys
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fleet.collective import lockstep, sharded_rows, sparse_grads, table_wise, transports
from fleet.collective.all_to_all import SharedMemoryAllToAll
from fleet.collective.broadcast import (
    average_tensors,
    broadcast_optimizer_state,
    broadcast_tensors,
    check_same_shapes,
)
from fleet.collective.grad_sync import GradSync
from fleet.collective.join import Join
from fleet.errors import FleetError, PeerError
from fleet.sparse import backends as tables
from fleet.strategies.base import REDUCE_OPS, Strategy, check_reduce
from fleet.training.optimizer import WrappedOptimizer
from fleet.training.owners import model_buffers, names_of

if TYPE_CHECKING:
    from fleet.strategy import DistributedStrategy

EXIT_TIMEOUT_S = 30.0  # how long a finishing process waits for its peers to agree that the job is over


class CollectiveStrategy(Strategy):
    name = "collective"
    supported_updates = ("sync",)

    owned_fields = frozenset({"grad_compression", "local_sgd_steps", "grad_accumulation_steps"})

    @classmethod
    def check(cls, config: DistributedStrategy) -> None:
        if config.backup_workers:
            raise ValueError(
                f"backup_workers={config.backup_workers} needs mode='ps' with update='sync'; collective "
                "all-reduce waits for every worker by construction"
            )
        if config.servers:
            raise ValueError(f"servers={config.servers} needs mode='ps'; collective jobs have no servers")
        if config.local_sgd_steps and config.grad_accumulation_steps > 1:
            raise ValueError(
                "local_sgd_steps and grad_accumulation_steps > 1 cannot be combined; choose one way to communicate less"
            )
        super().check(config)

    def __init__(self, config: DistributedStrategy, runtime: Any):
        super().__init__(config, runtime)
        # Weakly held, like the synchroniser's registry: a dropped optimizer or model stops taking part.
        self._optimizers: list[weakref.ref] = []
        self._models: list[weakref.ref] = []
        self._sync: GradSync | None = None
        self._backends: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> its ExchangedRows
        self._setup: transports.Setup | None = None
        self._all_to_all: SharedMemoryAllToAll | None = None  # sharded tables' exchanges, CPU workers on one host

    # --- the shared synchroniser ----------------------------------------------------------

    def sync(self) -> GradSync:
        if self._sync is None:
            config = self.config
            group = self.runtime.process_group(config.timeout_s)
            wait_s = config.collective_wait_s  # a live peer is waited for this long (fleet.collective.patience)
            # The config is the transports' options: each may name a field that switches it off.
            setup = self._setup = transports.Setup(group, wait_s, compression=config.grad_compression, options=config)
            self._sync = GradSync(
                group,
                bucket_bytes=int(config.bucket_mb * (1 << 20)),
                transport=transports.choose(setup),
                timeout_s=wait_s,
                diagnose=self.runtime.diagnose_peers,
                silent_peers=self.runtime.peer_probe(),
                accumulation=config.grad_accumulation_steps,
                # Gradient rounds are needed to average over workers, or to scale accumulated micro-batches.
                hooked=not config.local_sgd_steps and (group is not None or config.grad_accumulation_steps > 1),
            )
            if group is not None:
                atexit.register(self._finish_at_exit)
        return self._sync

    @property
    def group(self) -> Any:
        return self.sync().group

    @property
    def optimizers(self) -> list[CollectiveOptimizer]:
        return [o for o in (ref() for ref in self._optimizers) if o is not None]

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        wrapped = CollectiveOptimizer(optimizer, self)
        self._optimizers.append(weakref.ref(wrapped))
        return wrapped

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        sync = self.sync()
        group = sync.group
        if group is not None:
            params = list(model.parameters())
            check_same_shapes(params, lambda: [n for n, _ in model.named_parameters()], group)
            broadcast_tensors(params + list(model.buffers()), group)
            if any(True for _ in model.buffers()):
                index = len(self._models)
                # DDP's broadcast_buffers: running statistics follow worker 0 at every forward.
                model.register_forward_pre_hook(lambda module, args: self._broadcast_buffers(index, module))
        self._models.append(weakref.ref(model))
        sync.register(model)
        return model

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        sync = self.sync()
        sync.pause()
        try:
            yield
        finally:
            sync.resume()

    def defer_reduction(self, defer: bool) -> None:
        self.sync().hold(defer)

    def _broadcast_buffers(self, index: int, model: torch.nn.Module) -> None:
        lock = self.sync().lockstep
        if lock is None or lock.joined:
            return
        agreement = lock.announce(lockstep.BUFFERS, index)
        broadcast_tensors(list(model.buffers()), self.group, agreement.source)

    def barrier(self) -> None:
        lock = self.sync().lockstep
        if lock is not None:
            lock.announce(lockstep.BARRIER)

    def all_reduce(self, values: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """fleet.metrics' reduction, announced first like every collective: a worker doing something else fails."""
        if self.runtime.role.worker_num == 1:
            return super().all_reduce(values, op)
        check_reduce(values, op)
        lock = self.sync().lockstep
        if lock is not None:
            lock.announce(lockstep.REDUCE, values.numel(), REDUCE_OPS.index(op))
        return super().all_reduce(values, op)

    def uneven_inputs(self) -> Join:
        return Join(self)

    def table_backend(self, module: tables.TableModule) -> tables.TableBackend | None:
        """Every worker keeps the module's table, each step's row gradients merged over the workers first; or,
        with ``table_placement="sharded"``, each worker its share of the rows (fleet.collective.sharded_rows)."""
        if self.runtime.role.worker_num == 1:
            return None
        backend = self._backends.get(module)
        if backend is None:
            if sharded_rows.shards(self.config.table_placement, False, module):
                backend = table_wise.sharded_backend(
                    self.config.table_placement, module, self.group, self.config.collective_wait_s,
                    "with tables sharded in collective mode",
                    lambda values: self.all_reduce(values, "sum"), self._announce_table, self.runtime.diagnose_peers,
                    self._shared_all_to_all(),
                )  # fmt: skip
            else:
                backend = tables.ExchangedRows(module.local, self._exchange_rows)
            self._backends[module] = backend
        return backend

    def _shared_all_to_all(self) -> SharedMemoryAllToAll | None:
        """The sharded tables' all-to-all through shared memory: every worker on this host, ``shared_memory`` on
        (the gradient transport probed the host already; the same answer on every worker)."""
        self.sync()
        setup = self._setup
        if self._all_to_all is None and setup is not None and setup.group is not None and setup.allows("shared_memory"):
            host = setup.local_host()
            if host is not None:
                self._all_to_all = SharedMemoryAllToAll(host, self.runtime.diagnose_peers)
        return self._all_to_all

    def _announce_table(self, what: str, module: Any, width: int, lr: float, carry: int = 0) -> list[int]:
        """Before a sharded table's exchange: every worker must be about to do the same (lockstep). ``carry``: a
        value of this worker's that every worker gets back, by rank (the shared-memory all-to-all's meeting)."""
        lock = self.sync().lockstep
        assert lock is not None
        kind = lockstep.TABLE_PULL if what in ("pull", "pool") else lockstep.SPARSE_ROWS
        index = tables.all_modules().index(module)
        if what in ("pool", "pooled step"):  # table-wise bags pooled by their holders: not a row exchange
            index = -1 - index
        agreement = lock.announce(kind, index, width, lockstep.float_bits(lr), carry=carry)
        if len(agreement.active) < self.runtime.role.worker_num:
            finished = sorted(set(range(self.runtime.role.worker_num)) - set(agreement.active))
            raise sharded_rows.refuse_join(f"worker(s) {finished} finished their loop")
        return agreement.carried

    def shutdown(self) -> None:
        sync = self._sync
        if sync is None:
            return
        lock = sync.lockstep
        try:
            if lock is not None:
                lock.finish()
        finally:
            sync.close()
            if self._all_to_all is not None:
                self._all_to_all.close()
            if lock is not None:
                atexit.unregister(self._finish_at_exit)

    def _finish_at_exit(self) -> None:
        """The script ended without fleet.stop_worker(): agree with the peers that the job is over."""
        sync = self._sync
        lock = sync.lockstep if sync is not None else None
        if lock is None or lock.finished or not dist.is_initialized() or hasattr(sys, "last_value"):
            return  # stopped already, or ending on an uncaught exception: nothing to agree on
        try:
            lock.finish(within=timedelta(seconds=EXIT_TIMEOUT_S))
        except PeerError as error:
            print(f"fleet: worker {lock.rank}: {error}", file=sys.stderr, flush=True)

    # --- collectives of a training step outside the gradient rounds --------------------------

    def _exchange_rows(self, module: Any, ids: torch.Tensor, grads: torch.Tensor, lr: float) -> tuple:
        """A fleet.nn.SparseEmbedding's row gradients, merged over the workers still training."""
        lock = self.sync().lockstep
        assert lock is not None
        index = self._position(module.placeholder)
        # grads may carry the clicks as one more column: its width is what the others must match
        agreement = lock.announce(lockstep.SPARSE_ROWS, index, grads.shape[1], lockstep.float_bits(lr))
        return sparse_grads.gather_rows(ids, grads, self.group, len(agreement.active), module.embedding_dim)

    def _position(self, param: torch.Tensor) -> int:
        return next(i for i, p in enumerate(self.sync().registered()) if p is param)

    def average_parameters(self, optimizer: CollectiveOptimizer) -> None:
        """Local SGD: every worker takes the mean of the parameters of the workers still training."""
        index = next(i for i, ref in enumerate(self._optimizers) if ref() is optimizer)
        agreement = self.sync().lockstep.announce(lockstep.AVERAGE, index)  # type: ignore[union-attr]
        average_tensors(optimizer.parameters(), self.group, len(agreement.active))

    def add_params(self, params: list[torch.Tensor]) -> None:
        """New parameters (add_param_group through the wrapper): every worker takes worker 0's values."""
        sync = self.sync()
        if sync.lockstep is not None and params:
            agreement = sync.lockstep.announce(lockstep.PARAMS, len(params))
            broadcast_tensors(params, self.group, agreement.source)
        sync.verified(params)
        sync.refresh()

    # --- fleet.join(): shadowing the others, then taking the last trainer's state -------------

    def shadow(self, leader: lockstep.Header, agreement: lockstep.Agreement) -> None:
        sync = self.sync()
        if leader.kind == lockstep.ROUND:
            sync.shadow_round(agreement)
        elif leader.kind == lockstep.BUFFERS:
            broadcast_tensors(list(self._models[leader.a]().buffers()), self.group, agreement.source)
        elif leader.kind == lockstep.TABLE_PULL or (
            leader.kind == lockstep.SPARSE_ROWS
            and any(isinstance(b, sharded_rows.ShardedRows) for b in self._backends.values())
        ):
            raise sharded_rows.refuse_join("this worker's loop ended while the others train")
        elif leader.kind == lockstep.SPARSE_ROWS:
            param = sync.registered()[leader.a]
            module = tables.module_of(param)
            empty = torch.empty(0, dtype=torch.int64), torch.empty(0, leader.b)
            ids, grads = sparse_grads.gather_rows(*empty, self.group, len(agreement.active), module.embedding_dim)
            optimizer, group = next(
                (opt, g) for opt in sync.sources if isinstance(opt, torch.optim.Optimizer)
                for g in opt.param_groups if any(p is param for p in g["params"])
            )  # fmt: skip
            lr = lockstep.bits_float(leader.c)
            module.local.apply(type(optimizer), group, ids, grads, lr, where="in collective mode")
        elif leader.kind == lockstep.AVERAGE:
            params = self._optimizers[leader.a]().parameters()
            average_tensors(params, self.group, len(agreement.active), contribute=False)

    def adopt_state(self, source: int) -> None:
        """After fleet.join(): every worker takes ``source``'s parameters, buffers and optimizer state."""
        sync = self.sync()
        models = [m for m in (ref() for ref in self._models) if m is not None]
        tensors = sync.registered() + [b for model in models for b in model.buffers()]
        broadcast_tensors(tensors, self.group, source)
        for optimizer in self.optimizers:
            broadcast_optimizer_state(optimizer.inner, self.group, source)


class CollectiveOptimizer(WrappedOptimizer):
    """Steps the user's optimizer on gradients averaged over every worker."""

    def __init__(self, optimizer: torch.optim.Optimizer, strategy: CollectiveStrategy):
        super().__init__(optimizer)
        self.config = config = strategy.config
        self.strategy = strategy
        self.sync = strategy.sync()
        self.group = self.sync.group
        self.world_size = dist.get_world_size(self.group) if self.group is not None else 1
        self._accumulation = config.grad_accumulation_steps
        self._micro_step = 0
        self.steps = 0
        params = self.parameters()
        if self.group is not None:
            check_same_shapes(params, lambda: names_of(params), self.group)
            buffers, buffer_names = model_buffers(params)
            check_same_shapes(buffers, lambda: buffer_names, self.group)
            # The models' buffers too (DDP does at construction): one drawn at random when the model was
            # built (spectral_norm's u and v, a random projection) must be worker 0's on every worker.
            broadcast_tensors(params + buffers, self.group)
            broadcast_optimizer_state(self._inner, self.group)
        self.sync.register(optimizer)
        self._rounds_at_step = self.sync.rounds
        self._backwards_at_step = self.sync.backwards
        self._arm()

    def _arm(self) -> None:
        """Reduce gradients only on the backward that ends an accumulation window."""
        self.sync.arm((self._micro_step + 1) % self._accumulation == 0)

    @property
    def comm_wait_s(self) -> float:
        return self.sync.comm_wait_s

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._micro_step % self._accumulation == 0:
            super().zero_grad(set_to_none=set_to_none)
            self.sync.refresh()  # a frozen or unfrozen layer is hooked before the backward, not during it

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        before = {id(p) for p in self.parameters()}
        self._inner.add_param_group(param_group)
        self.strategy.add_params([p for p in self.parameters() if id(p) not in before])

    def step(self, closure=None):
        backwards, self._backwards_at_step = self.sync.backwards - self._backwards_at_step, self.sync.backwards
        if self._accumulation > 1 and backwards > 1:
            raise FleetError(mismatched_accumulation(self._accumulation, backwards))
        if (self._micro_step + 1) % self._accumulation != 0:
            self._micro_step += 1
            self._arm()
            return None
        if (
            closure is None
            and self.sync.hooked
            and (self.sync.rounds == self._rounds_at_step or self.sync.replaced_by_hand())
        ):
            # No backward produced a gradient here (its peers' round still needs one), or one was set by hand.
            self.sync.catch_up()
        loss = self._inner.step(closure)
        self._rounds_at_step = self.sync.rounds
        self._micro_step += 1
        self.steps += 1
        self.sync.count_step()
        self._arm()
        comm_s = self.sync.take_comm_wait()
        if self.config.local_sgd_steps and self.group is not None and self.steps % self.config.local_sgd_steps == 0:
            started = time.perf_counter()
            self.strategy.average_parameters(self)
            comm_s += time.perf_counter() - started
        self._end_step(comm_s=comm_s, micro_batches=self._accumulation)
        return loss


def mismatched_accumulation(steps: int, backwards: int) -> str:
    """grad_accumulation_steps counts step() calls (Paddle's gradient merge); a DDP-style loop counts backwards."""
    return (
        f"DistributedStrategy(grad_accumulation_steps={steps}) counts optimizer.step() calls: one micro-batch is "
        f"one backward() and one step(), and every {steps}th step() updates the weights. This loop ran "
        f"{backwards} backward passes before this step(), the DDP way of accumulating, which this setting would "
        f"turn into {steps} x {backwards} micro-batches per update. Choose one: keep the loop and drop "
        "grad_accumulation_steps (skip the reductions of the micro-batches before the last with "
        "model.no_sync() or model.require_backward_grad_sync = False, as under DDP), or keep "
        "grad_accumulation_steps and call optimizer.step() (and zero_grad()) after every backward() "
        "(docs/collective.md, 'Gradient accumulation')."
    )
