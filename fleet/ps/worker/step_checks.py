"""What a worker checks at ``step()`` so that a parameter-server job never silently differs from one process.

Two things ordinary training code does between steps cannot be carried to the servers, so
they fail at once, naming the parameter or the setting, instead of training differently:

- :class:`HyperParameters`: the servers run the optimizer with the hyper-parameters its table
  was created with; only ``lr`` travels with every push. A param group whose ``momentum``,
  ``betas``, ``weight_decay``, ... changed since (``OneCycleLR`` cycles the momentum by
  default, or a hand-made schedule) would be silently ignored.
- :class:`GradWatch` (sync mode): the servers average the workers' gradients after
  ``step()``. A single process changes the *averaged* gradient between ``backward()`` and
  ``step()`` (``clip_grad_norm_``, ``clip_grad_value_``, ``GradScaler.unscale_``, by hand);
  here each worker would change its own, and clipping the parts is not clipping the whole.
  A gradient that backward left and that was written since is refused on every worker alike
  (whatever the values: ``clip_grad_norm_`` rescales even when it has nothing to clip, so
  all workers fail at the same step; to log the norm use ``torch.nn.utils.get_total_norm``);
  one set by hand without a backward into it (``p.grad = g`` from ``torch.autograd.grad``)
  is this worker's gradient and is averaged as such; one set to ``None`` takes no part, as
  in torch.optim.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from fleet.errors import FleetError
from fleet.sparse.optim import OptimizerSpec


class HyperParameters:
    """Every param group's hyper-parameters (all but ``lr``) as the servers hold them."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.created: dict[int, OptimizerSpec] = {}  # param group index -> its spec when its tables were made
        # param group index -> its settings (all but params and lr) when they last gave the created spec: a step
        # whose group still holds exactly these skips rebuilding the spec (a pydantic model, ~0.1 ms a step)
        self._agreed: dict[int, tuple] = {}

    def record(self, index: int) -> None:
        self.created[index] = self._spec(index)
        self._agreed.pop(index, None)

    def _spec(self, index: int) -> OptimizerSpec:
        spec = OptimizerSpec.from_torch(
            type(self.optimizer), self.optimizer.param_groups[index], where="by the parameter server"
        )
        return spec.model_copy(update={"lr": 0.0})

    def check(self, indices: list[int]) -> None:
        """The groups ``indices`` (those the servers step with their own spec) still have it."""
        for index in indices:
            before = self.created.get(index)
            if before is None:
                continue
            settings = _settings(self.optimizer.param_groups[index])
            if settings is not None and self._agreed.get(index) == settings:
                continue
            now = self._spec(index)
            if now == before:
                if settings is not None:
                    self._agreed[index] = settings
                continue
            name = next(n for n in now.model_dump() if getattr(now, n) != getattr(before, n))  # the rule's fields too
            raise FleetError(
                f"param group {index}'s {name!r} changed from {_plain(getattr(before, name))} to "
                f"{_plain(getattr(now, name))} after fleet.distributed_optimizer (a scheduler such as "
                "OneCycleLR, which cycles the momentum unless cycle_momentum=False, load_state_dict of a state saved "
                "with other settings, or by hand). In parameter-server "
                "mode the servers run the optimizer with the hyper-parameters its table was created with and only "
                "'lr' travels with every step, so this change would be silently ignored. Keep every hyper-parameter "
                "but 'lr' fixed, or use mode='collective'."
            )


_PLAIN = (bool, int, float, str, type(None))


def _settings(group: dict[str, Any]) -> tuple | None:
    """A param group's settings but ``params`` and ``lr`` (which the spec leaves out) as a tuple to compare, when
    each is a plain immutable value (a number, a string, None, a tuple of them), which the spec is a function of;
    else None (a tensor, a list: the spec is built and compared every time)."""
    out = []
    for key, value in group.items():
        if key == "params" or key == "lr":
            continue
        if type(value) is tuple:
            if not all(type(v) in _PLAIN for v in value):
                return None
        elif type(value) not in _PLAIN:
            return None
        out.append((key, type(value), value))
    return tuple(out)


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


class GradWatch:
    """The gradients each backward left in the watched parameters, to tell at step() whether they changed since."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[weakref.ref, torch.Tensor, int]] = {}
        self._hooked: dict[int, tuple[weakref.ref, Any]] = {}  # id(param) -> (param, hook handle)
        me = weakref.ref(self)

        def record(param: torch.Tensor) -> None:  # holds the watch weakly: a dropped optimizer stops watching
            watch = me()
            if watch is not None:
                watch._record(param)

        self._hook = record

    def watch(self, params: list[torch.Tensor]) -> None:
        """Hook the parameters that train now (a frozen one is hooked once it trains: at the next call)."""
        for p in params:
            hooked = self._hooked.get(id(p))
            if p.requires_grad and (hooked is None or hooked[0]() is not p):
                self._hooked[id(p)] = (weakref.ref(p), p.register_post_accumulate_grad_hook(self._hook))

    def _record(self, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None or grad.is_sparse:
            self._seen.pop(id(param), None)
            return
        self._seen[id(param)] = (weakref.ref(param), grad, grad._version)

    def check(self, params: list[torch.Tensor], name: Callable[[torch.Tensor], str]) -> None:
        """Raise if a gradient backward left in one of ``params`` was changed since; then forget them all."""
        try:
            for p in params:
                entry = self._seen.get(id(p))
                if entry is None or entry[0]() is not p or p.grad is None:
                    continue
                _, grad, version = entry
                if p.grad is grad and grad._version == version:
                    continue
                raise FleetError(
                    f"The gradient of {name(p)!r} was changed between backward() and "
                    "optimizer.step() (clip_grad_norm_, clip_grad_value_, GradScaler's unscale_/step, or by hand). "
                    "In a single process that change applies to the gradient of the whole batch, but in "
                    "parameter-server sync mode the servers average the workers' gradients only after step(), so it "
                    "would apply to each worker's own gradient and training would silently differ. Leave the "
                    "gradients as backward() left them (scale the loss instead; torch.nn.utils.get_total_norm reads "
                    "the norm without writing), or use mode='collective', whose gradients are averaged during "
                    "backward()."
                )
        finally:
            self._seen = {}
