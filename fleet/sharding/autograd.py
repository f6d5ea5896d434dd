"""Autograd calls that name sharded parameters, under ``mode="sharding"`` (FSDP2).

FSDP2 runs forward and backward on an unsharded parameter of its own and puts the sharded one
(a DTensor) back on the module between steps. A script that names the module's parameters as
autograd inputs therefore names tensors the graph never saw:
``loss.backward(inputs=list(model.head.parameters()))`` computed nothing for them, silently,
and ``torch.autograd.grad(loss, model.parameters())`` failed with "appears to not have been
used in the graph". While fleet holds a sharded model, ``torch.autograd.backward`` and
``torch.autograd.grad`` pass autograd the unsharded parameter in place of each sharded one, so
both do what they do in one process: ``backward(inputs=...)`` accumulates into those parameters
and FSDP2 reduce-scatters the result as after any backward; ``autograd.grad`` returns this
worker's whole gradient, which :class:`~fleet.strategies.sharding.ShardingOptimizer` averages
and shards at ``step()`` if the script sets it as ``.grad``.

Only the rare calls that name inputs pay for the lookup; a plain ``loss.backward()`` goes
straight through, after the callbacks given to :meth:`EntryPoints.before_backward` (fleet's check that
every worker is about to run the same backward).

Why fleet replaces two functions of torch for the whole process, and who owns that: PyTorch offers
no hook that runs before a backward starts (fleet's check needs one: every worker must agree before
FSDP2's first reduce-scatter) and none that can change the tensors a call names as ``inputs``, so
fleet's versions stand in for ``torch.autograd.backward`` and ``torch.autograd.grad`` (``Tensor.backward``
calls the first). A sharding strategy holds them through an :class:`EntryPoints` of its own: they are
put in place when the first is opened and torch's own functions are put back when the last is closed
(:meth:`ShardingStrategy.shutdown <fleet.strategies.sharding.ShardingStrategy.shutdown>`, at
``fleet.stop_worker()``), is garbage collected, or at interpreter exit, whichever comes first.
"""

from __future__ import annotations

import atexit
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

BACKWARD, AUTOGRAD_GRAD = 1, 2  # what the callbacks are told is about to run


class EntryPoints:
    """A sharding strategy's hold on ``torch.autograd.backward`` and ``torch.autograd.grad``: while it is
    open, they translate inputs naming its models' sharded parameters and run its callbacks."""

    def __init__(self) -> None:
        self._models: weakref.WeakSet = weakref.WeakSet()
        self._before: list[weakref.WeakMethod] = []  # gone with the object that gave it
        self._after: list[weakref.WeakMethod] = []
        _PATCH.hold(self)

    def track(self, model: torch.nn.Module) -> None:
        """Translate autograd inputs naming ``model``'s sharded parameters from now on."""
        self._models.add(model)

    def models(self) -> list[torch.nn.Module]:
        return list(self._models)

    def before_backward(self, callback: Callable[[int], None]) -> None:
        """Call the bound method ``callback`` before every ``torch.autograd.backward`` and ``torch.autograd.grad``,
        for as long as its object lives and until :meth:`forget`."""
        self.forget(callback)
        self._before.append(weakref.WeakMethod(callback))

    def after_backward(self, callback: Callable[[], None]) -> None:
        """Call the bound method ``callback`` when a ``torch.autograd.backward`` returned (its gradients reduced),
        for as long as its object lives and until :meth:`forget`."""
        self.forget(callback)
        self._after.append(weakref.WeakMethod(callback))

    def forget(self, callback: Callable[..., None]) -> None:
        for callbacks in (self._before, self._after):
            callbacks[:] = [ref for ref in callbacks if ref() is not None and ref() != callback]

    def run_before(self, how: int) -> None:
        for ref in list(self._before):
            callback = ref()
            if callback is not None:
                callback(how)

    def run_after(self) -> None:
        for ref in list(self._after):
            callback = ref()
            if callback is not None:
                callback()

    def close(self) -> None:
        """Let go: torch's own functions are back once no other hold is open."""
        self._models = weakref.WeakSet()
        self._before.clear()
        self._after.clear()
        _PATCH.let_go(self)


class _Patch:
    """The one owner of the process's replacement of ``torch.autograd``'s entry points (module docstring)."""

    def __init__(self) -> None:
        self.holders: set[weakref.ref] = set()  # a holder gone without close() lets go too
        self.wrapped: dict[str, Callable[..., Any]] = {}  # torch's own, which fleet's call (kept once put back)
        self.ours: dict[str, Callable[..., Any]] = {}
        self.standing: set[str] = set()  # the names where fleet's stands in for torch's

    def hold(self, holder: EntryPoints) -> None:
        self.holders.add(weakref.ref(holder, self.died))
        for name, translate_inputs in (("backward", _backward), ("grad", _grad)):
            if name in self.standing and getattr(torch.autograd, name) is self.wrapped[name]:
                self.standing.discard(name)  # whoever wrapped fleet's took theirs and fleet's out again
            if name not in self.standing:
                self.wrapped[name] = getattr(torch.autograd, name)
                self.ours[name] = functools.wraps(self.wrapped[name])(translate_inputs)
                _put(name, self.ours[name])
                self.standing.add(name)

    def open_holders(self) -> list[EntryPoints]:
        return [holder for ref in list(self.holders) if (holder := ref()) is not None]

    def let_go(self, holder: EntryPoints) -> None:
        self.holders = {ref for ref in self.holders if ref() is not None and ref() is not holder}
        self.put_back()

    def died(self, ref: weakref.ref) -> None:
        self.holders.discard(ref)
        self.put_back()

    def put_back(self) -> None:
        """torch's own functions back, once no hold is open."""
        if self.open_holders():
            return
        for name in sorted(self.standing):
            # Put torch's back unless someone wrapped fleet's since: taking it out from under their
            # wrapper would drop theirs too (fleet's then passes every call straight through).
            if getattr(torch.autograd, name) is self.ours[name]:
                _put(name, self.wrapped[name])
                self.standing.discard(name)

    def end(self) -> None:
        """The end of the process (the job ended without ``fleet.stop_worker()``): torch's own are back."""
        self.holders = set()
        self.put_back()


def _put(name: str, function: Callable[..., Any]) -> None:
    setattr(torch.autograd, name, function)  # the process-wide write _Patch owns (module docstring)


_PATCH = _Patch()
atexit.register(_PATCH.end)


def _run_before_backward(how: int) -> None:
    for holder in _PATCH.open_holders():
        holder.run_before(how)


def _unsharded_of() -> dict[int, torch.nn.Parameter]:
    """``id(sharded parameter) -> the unsharded parameter the graph holds``, over every tracked model."""
    found: dict[int, torch.nn.Parameter] = {}
    for model in [m for holder in _PATCH.open_holders() for m in holder.models()]:
        for module in model.modules():
            get_state = getattr(module, "_get_fsdp_state", None)
            if get_state is None:
                continue
            for group in get_state()._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    # Made at the first all-gather and kept (its storage freed between uses), so the
                    # graph of any forward since then holds this very object.
                    unsharded = getattr(fsdp_param, "_unsharded_param", None)
                    if unsharded is not None:
                        found[id(fsdp_param.sharded_param)] = unsharded
    return found


def unsharded(inputs: Any) -> Any:
    """``inputs`` (a tensor, a sequence or a dict, as autograd takes them) with sharded parameters replaced."""
    from torch.distributed.tensor import DTensor

    if inputs is None:
        return None
    single = isinstance(inputs, torch.Tensor)
    items: Sequence[Any] = [inputs] if single else list(inputs.values() if isinstance(inputs, dict) else inputs)
    if not any(isinstance(t, DTensor) for t in items):
        return inputs
    found = _unsharded_of()
    if isinstance(inputs, dict):
        return {name: found.get(id(t), t) for name, t in inputs.items()}
    swapped = [found.get(id(t), t) for t in items]
    return swapped[0] if single else swapped


_BACKWARD_INPUTS_AT = 5  # backward(tensors, grad_tensors, retain_graph, create_graph, grad_variables, inputs)


def _backward(*args: Any, **kwargs: Any) -> Any:
    _run_before_backward(BACKWARD)
    if "inputs" in kwargs:
        kwargs["inputs"] = unsharded(kwargs["inputs"])
    elif len(args) > _BACKWARD_INPUTS_AT:
        args = (*args[:_BACKWARD_INPUTS_AT], unsharded(args[_BACKWARD_INPUTS_AT]), *args[_BACKWARD_INPUTS_AT + 1 :])
    result = _PATCH.wrapped["backward"](*args, **kwargs)
    for holder in _PATCH.open_holders():
        holder.run_after()
    return result


def _grad(outputs: Any, inputs: Any = None, *args: Any, **kwargs: Any) -> Any:
    _run_before_backward(AUTOGRAD_GRAD)
    return _PATCH.wrapped["grad"](outputs, unsharded(inputs), *args, **kwargs)
