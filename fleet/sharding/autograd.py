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
straight through, after the callbacks given to :func:`before_backward` (fleet's check that every
worker is about to run the same backward).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

_sharded_models: weakref.WeakSet = weakref.WeakSet()
_originals: dict[str, Callable[..., Any]] = {}
_before_backward: list[weakref.WeakMethod] = []  # gone with the strategy that gave it
_after_backward: list[weakref.WeakMethod] = []
BACKWARD, AUTOGRAD_GRAD = 1, 2  # what the callbacks are told is about to run


def track(model: torch.nn.Module) -> None:
    """Translate autograd inputs naming ``model``'s sharded parameters from now on (installed once)."""
    _sharded_models.add(model)
    _install()


def before_backward(callback: Callable[[int], None]) -> None:
    """Call the bound method ``callback`` before every ``torch.autograd.backward`` and ``torch.autograd.grad``,
    for as long as its object lives and until :func:`forget`."""
    forget(callback)
    _before_backward.append(weakref.WeakMethod(callback))
    _install()


def after_backward(callback: Callable[[], None]) -> None:
    """Call the bound method ``callback`` when a ``torch.autograd.backward`` returned (its gradients reduced),
    for as long as its object lives and until :func:`forget`."""
    forget(callback)
    _after_backward.append(weakref.WeakMethod(callback))
    _install()


def forget(callback: Callable[..., None]) -> None:
    for callbacks in (_before_backward, _after_backward):
        callbacks[:] = [ref for ref in callbacks if ref() is not None and ref() != callback]


def _run_before_backward(how: int) -> None:
    for ref in list(_before_backward):
        callback = ref()
        if callback is not None:
            callback(how)


def _install() -> None:
    if not _originals:
        for name, translate_inputs in (("backward", _backward), ("grad", _grad)):
            original = getattr(torch.autograd, name)
            _originals[name] = original
            setattr(torch.autograd, name, functools.wraps(original)(translate_inputs))


def _unsharded_of() -> dict[int, torch.nn.Parameter]:
    """``id(sharded parameter) -> the unsharded parameter the graph holds``, over every tracked model."""
    found: dict[int, torch.nn.Parameter] = {}
    for model in list(_sharded_models):
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
    result = _originals["backward"](*args, **kwargs)
    for ref in list(_after_backward):
        callback = ref()
        if callback is not None:
            callback()
    return result


def _grad(outputs: Any, inputs: Any = None, *args: Any, **kwargs: Any) -> Any:
    _run_before_backward(AUTOGRAD_GRAD)
    return _originals["grad"](outputs, unsharded(inputs), *args, **kwargs)
