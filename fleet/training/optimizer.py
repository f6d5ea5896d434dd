"""WrappedOptimizer: a torch.optim.Optimizer that forwards to the user's optimizer.

Strategies subclass it to add communication around ``step``. It does not call
``Optimizer.__init__``: parameter groups and state stay the wrapped optimizer's own
objects (read through properties, because ``load_state_dict`` replaces them), so
LR schedulers, ``clip_grad_norm_`` and AMP's GradScaler see exactly what they would
see without fleet.

Step boundary hooks (timing and injection, for every strategy): a subclass that
overrides ``step`` calls ``self._end_step(comm_s=..., micro_batches=...)`` once per
real optimizer step, after the update, and may report communication / waiting as it
happens with ``self.metrics.add_comm(seconds)`` and dropped stale gradients with
``self.metrics.add_dropped(n)`` or ``self.metrics.set_dropped(total)``. See
:mod:`fleet.telemetry.timing` and :mod:`fleet.runtime.inject`.

Hooks registered on the wrapper (``register_step_pre_hook``/``post_hook``, the state-dict and
load-state-dict hooks) run around the wrapper's ``step``, ``state_dict`` and
``load_state_dict``, whichever strategy overrides them, as torch runs them around an
optimizer's own: an EMA kept by a step post-hook updates after every real step, also where
the servers step and the user's optimizer never does.
"""

from __future__ import annotations

import functools
import weakref
from collections import OrderedDict
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from fleet.runtime import context, inject
from fleet.telemetry import timing

_HOOKED: weakref.WeakSet = weakref.WeakSet()  # the methods below made: never wrapped twice


def _outermost(method: Callable) -> Callable:
    """Run ``method`` with its hooks only in the outermost call (a subclass may call super's)."""
    name = method.__name__

    def decorate(hooked: Callable) -> Callable:
        @functools.wraps(method)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not self._enter_hooked(name):
                return method(self, *args, **kwargs)
            try:
                return hooked(self, *args, **kwargs)
            finally:
                self._leave_hooked(name)

        _HOOKED.add(call)
        return call

    return decorate


def _with_step_hooks(step: Callable) -> Callable:
    @_outermost(step)
    def hooked(self: Any, *args: Any, **kwargs: Any) -> Any:
        for pre_hook in list(self._optimizer_step_pre_hooks.values()):
            result = pre_hook(self, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(f"a step pre-hook must return None or (new_args, new_kwargs), got {result!r}")
                args, kwargs = result
        out = step(self, *args, **kwargs)
        for post_hook in list(self._optimizer_step_post_hooks.values()):
            post_hook(self, args, kwargs)
        return out

    return hooked


def _with_state_dict_hooks(state_dict: Callable) -> Callable:
    @_outermost(state_dict)
    def hooked(self: Any) -> Any:
        for pre_hook in list(self._optimizer_state_dict_pre_hooks.values()):
            pre_hook(self)
        out = state_dict(self)
        for post_hook in list(self._optimizer_state_dict_post_hooks.values()):
            result = post_hook(self, out)
            out = out if result is None else result
        return out

    return hooked


def _with_load_state_dict_hooks(load_state_dict: Callable) -> Callable:
    @_outermost(load_state_dict)
    def hooked(self: Any, state_dict: dict[str, Any]) -> None:
        if self._optimizer_load_state_dict_pre_hooks:
            state_dict = state_dict.copy()  # as torch: a hook may change the top level, not the caller's dict
        for pre_hook in list(self._optimizer_load_state_dict_pre_hooks.values()):
            result = pre_hook(self, state_dict)
            state_dict = state_dict if result is None else result
        load_state_dict(self, state_dict)
        for post_hook in list(self._optimizer_load_state_dict_post_hooks.values()):
            post_hook(self)

    return hooked


_HOOKED_METHODS = {
    "step": _with_step_hooks,
    "state_dict": _with_state_dict_hooks,
    "load_state_dict": _with_load_state_dict_hooks,
}


class _RunsHooks(type):
    """WrappedOptimizer's metaclass: a class of the family that defines ``step``, ``state_dict`` or
    ``load_state_dict`` is made with them already wrapped in the wrapper's hooks, so that a strategy's
    override runs them too, as torch runs an optimizer's hooks around its own methods. The wrapping is
    done to the namespace the class is made from: no class is rewritten once it exists."""

    def __new__(mcls, name: str, bases: tuple[type, ...], namespace: dict[str, Any], **kwargs: Any) -> type:
        hooked = {
            key: _HOOKED_METHODS[key](value) if key in _HOOKED_METHODS and value not in _HOOKED else value
            for key, value in namespace.items()
        }
        return super().__new__(mcls, name, bases, hooked, **kwargs)


class WrappedOptimizer(torch.optim.Optimizer, metaclass=_RunsHooks):
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
        self._boundary_steps = 0
        self._injector: inject.Injector | None = None

    # --- step boundary: timing and injection --------------------------------------

    @property
    def metrics(self) -> timing.StepMetrics:
        """This process's step timings (:class:`fleet.telemetry.timing.StepMetrics`)."""
        return timing.recorder()

    def _end_step(self, comm_s: float = 0.0, micro_batches: int = 1) -> None:
        """Mark the end of one optimizer step (after the update).

        ``comm_s``: seconds of this step spent communicating or waiting for peers, if not
        already given to ``self.metrics.add_comm``. ``micro_batches``: batches that went into
        the step (gradient accumulation), for samples/s. Applies an injected delay (counted
        as this worker's computation) and an injected crash.
        """
        if getattr(self, "_injector", None) is None:
            strategy = getattr(self, "config", None)
            if strategy is None:
                job = context.current()
                strategy = job.strategy if job is not None else None
            self._injector = inject.for_process(strategy, timing.worker_identity()[0])
        self._injector.before_boundary()
        recorder = timing.recorder()
        if comm_s:
            recorder.add_comm(comm_s)
        recorder.end_step(micro_batches)
        self._boundary_steps = getattr(self, "_boundary_steps", 0) + 1
        self._injector.after_step(self._boundary_steps)

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
        loss = self._inner.step(closure)
        self._end_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._inner.zero_grad(set_to_none=set_to_none)

    def no_sync(self) -> AbstractContextManager:
        """DDP's ``no_sync()``, also on the optimizer: backward passes inside accumulate local gradients
        only; the first backward after it reduces all of them (gradient accumulation)."""
        return context.no_sync()

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

    # --- the hooked methods' own bookkeeping -----------------------------------------

    def _enter_hooked(self, name: str) -> bool:
        """Whether this call of the hooked method ``name`` is the outermost one (it runs the hooks)."""
        running = self.__dict__.setdefault("_fleet_running", set())  # also on an unpickled wrapper
        if name in running:
            return False
        running.add(name)
        return True

    def _leave_hooked(self, name: str) -> None:
        self.__dict__["_fleet_running"].discard(name)
