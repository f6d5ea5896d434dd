"""The small interface every distributed strategy implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

if TYPE_CHECKING:
    from fleet.roles import RoleInfo
    from fleet.strategy import DistributedStrategy


class Runtime(Protocol):
    """What a strategy may ask of the running fleet context."""

    role: RoleInfo

    def process_group(self, timeout_s: float) -> Any:
        """The workers' torch.distributed group (None for a single worker)."""

    def model_for(self, params: list[torch.nn.Parameter]) -> torch.nn.Module | None:
        """The model given to distributed_model that holds these parameters, if any."""

    def diagnose_peers(self) -> str | None:
        """After a failed collective: which peer died or went silent, in words (None if unknown)."""


class Strategy(ABC):
    """One way of training across processes. Subclasses live one per module in fleet/strategies/.

    A strategy is built once per ``distributed_optimizer`` call with the validated
    DistributedStrategy and the runtime; it wraps the user's optimizer (and optionally model).
    """

    name: ClassVar[str] = ""
    supported_updates: ClassVar[tuple[str, ...]] = ("sync",)
    """Values of DistributedStrategy.update this strategy runs."""

    def __init__(self, config: DistributedStrategy, runtime: Runtime):
        self.config = config
        self.runtime = runtime

    @classmethod
    def check(cls, config: DistributedStrategy) -> None:
        """Reject options this strategy cannot honour; raise ValueError naming the field and the fix."""

    @abstractmethod
    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Return an optimizer with the wrapped one's surface that trains in this strategy's way."""

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def barrier(self) -> None:
        """Wait for every worker."""

    def join(self) -> AbstractContextManager:
        """``with fleet.join():`` for loops that end unevenly; nothing to do unless the strategy says so."""
        return nullcontext()

    def shutdown(self) -> None:
        """Release connections and groups; called by fleet.stop_worker."""
