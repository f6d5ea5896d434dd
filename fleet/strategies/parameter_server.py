"""Parameter-server strategy (placeholder until the PS engine lands)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from fleet.strategies.base import Strategy

if TYPE_CHECKING:
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
            raise ValueError("local_sgd_steps applies to mode='collective'; use update='geo' for local steps in ps mode")
        if config.grad_accumulation_steps > 1:
            raise ValueError("grad_accumulation_steps applies to mode='collective' only")

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        raise NotImplementedError("the parameter-server strategy is not available yet")


def join(context: Any) -> None:
    raise NotImplementedError("the parameter-server strategy is not available yet")
