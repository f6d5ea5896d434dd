"""Collective data parallelism: every worker holds the whole model; gradients are averaged.

Sync only. Options: gradient buckets (bucket_mb), fp16/bf16 gradient compression,
gradient accumulation over micro-batches, and local SGD (average parameters every k
steps instead of gradients every step).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fleet.collective.broadcast import (
    average_tensors,
    broadcast_optimizer_state,
    broadcast_tensors,
    check_same_shapes,
)
from fleet.collective.buckets import GradientBuckets
from fleet.collective.compression import make_compressor
from fleet.optimizer import WrappedOptimizer
from fleet.strategies.base import Strategy

if TYPE_CHECKING:
    from fleet.strategy import DistributedStrategy


class CollectiveStrategy(Strategy):
    name = "collective"
    supported_updates = ("sync",)

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

    def __init__(self, config: DistributedStrategy, runtime: Any):
        super().__init__(config, runtime)
        self.optimizers: list[CollectiveOptimizer] = []

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        wrapped = CollectiveOptimizer(optimizer, self.config, self.runtime)
        self.optimizers.append(wrapped)
        return wrapped

    def shutdown(self) -> None:
        for optimizer in self.optimizers:
            if optimizer.buckets is not None:
                optimizer.buckets.remove()

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        group = self.runtime.process_group(self.config.timeout_s)
        if group is None:
            return model
        params = list(model.parameters())
        check_same_shapes(params, [n for n, _ in model.named_parameters()], group)
        broadcast_tensors(params + list(model.buffers()), group)
        if any(True for _ in model.buffers()):
            # DDP's broadcast_buffers: running statistics follow worker 0 at every forward.
            model.register_forward_pre_hook(lambda module, args: broadcast_tensors(list(module.buffers()), group))
        return model

    def barrier(self) -> None:
        group = self.runtime.process_group(self.config.timeout_s)
        if group is not None:
            dist.barrier(group=group)


class CollectiveOptimizer(WrappedOptimizer):
    """Steps the user's optimizer on gradients averaged over every worker."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: DistributedStrategy, runtime: Any):
        super().__init__(optimizer)
        self.config = config
        self.group = runtime.process_group(config.timeout_s)
        self.world_size = dist.get_world_size(self.group) if self.group is not None else 1
        self._accumulation = config.grad_accumulation_steps
        self._micro_step = 0
        self.steps = 0
        params = self.parameters()
        if self.group is not None:
            model = runtime.model_for(params)
            names = _names(params, model)
            check_same_shapes(params, names, self.group)
            broadcast_tensors(params, self.group)
            broadcast_optimizer_state(self._inner, self.group)
        self.buckets: GradientBuckets | None = None
        self._comm_seen = 0.0  # buckets.comm_wait_s already reported to the metrics
        if not config.local_sgd_steps and (self.group is not None or self._accumulation > 1):
            self.buckets = GradientBuckets(
                params,
                self.group,
                self.world_size,
                bucket_bytes=int(config.bucket_mb * (1 << 20)),
                compressor=make_compressor(config.grad_compression),
                timeout_s=config.timeout_s,
                diagnose=runtime.diagnose_peers,
            )
            self.buckets.scale = 1.0 / (self.world_size * self._accumulation)
            self._arm()

    def _arm(self) -> None:
        """Reduce gradients only on the backward that ends an accumulation window."""
        if self.buckets is not None:
            self.buckets.enabled = (self._micro_step + 1) % self._accumulation == 0

    @property
    def comm_wait_s(self) -> float:
        return self.buckets.comm_wait_s if self.buckets is not None else 0.0

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._micro_step % self._accumulation == 0:
            super().zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        if (self._micro_step + 1) % self._accumulation != 0:
            self._micro_step += 1
            self._arm()
            return None
        loss = self._inner.step(closure)
        self._micro_step += 1
        self.steps += 1
        self._arm()
        if self.config.local_sgd_steps and self.group is not None and self.steps % self.config.local_sgd_steps == 0:
            started = time.perf_counter()
            average_tensors(self.parameters(), self.group)
            self.metrics.add_comm(time.perf_counter() - started)
        waited = self.comm_wait_s
        self._end_step(comm_s=waited - self._comm_seen, micro_batches=self._accumulation)
        self._comm_seen = waited
        return loss


def _names(params: list[torch.Tensor], model: torch.nn.Module | None) -> list[str]:
    by_id = {id(p): name for name, p in model.named_parameters()} if model is not None else {}
    return [by_id.get(id(p), f"param_groups parameter {i}") for i, p in enumerate(params)]
