"""WrappedOptimizer: a torch.optim.Optimizer that forwards to the user's optimizer.

Strategies subclass it to add communication around ``step``. It does not call
``Optimizer.__init__``: parameter groups and state stay the wrapped optimizer's own
objects (read through properties, because ``load_state_dict`` replaces them), so
LR schedulers, ``clip_grad_norm_`` and AMP's GradScaler see exactly what they would
see without fleet.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch


class WrappedOptimizer(torch.optim.Optimizer):
    def __init__(self, optimizer: torch.optim.Optimizer):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"fleet.distributed_optimizer needs a torch.optim.Optimizer, got {type(optimizer).__name__}."
            )
        if isinstance(optimizer, WrappedOptimizer):
            raise TypeError("This optimizer is already wrapped by fleet.distributed_optimizer; wrap the original once.")
        self._inner = optimizer
        # Hook dictionaries the Optimizer base methods expect to find on the instance.
        self._optimizer_step_pre_hooks: dict[int, Any] = OrderedDict()
        self._optimizer_step_post_hooks: dict[int, Any] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: dict[int, Any] = OrderedDict()
        self._optimizer_state_dict_post_hooks: dict[int, Any] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: dict[int, Any] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: dict[int, Any] = OrderedDict()

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The user's optimizer."""
        return self._inner

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self._inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._inner.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self._inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self._inner.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self._inner.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._inner.defaults = value

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for group in self.param_groups for p in group["params"]]

    def step(self, closure=None):  # noqa: D102
        return self._inner.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self._inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._inner.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._inner.add_param_group(param_group)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._inner!r})"
