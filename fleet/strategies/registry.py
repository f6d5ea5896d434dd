"""Name -> Strategy class. Built-in strategies are registered on first use; users add their own."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fleet.strategies.base import Strategy
    from fleet.strategy import DistributedStrategy

_BUILTIN = {
    "collective": ("fleet.strategies.collective", "CollectiveStrategy"),
    "ps": ("fleet.strategies.parameter_server", "ParameterServerStrategy"),
    "sharding": ("fleet.strategies.sharding", "ShardingStrategy"),
}
_registered: dict[str, type[Strategy]] = {}


def register_strategy(name: str, cls: type[Strategy], override: bool = False) -> None:
    """Make ``DistributedStrategy(mode=name)`` run ``cls`` (a subclass of fleet.strategies.Strategy).

    A name that is taken (a built-in such as "collective", or one registered before) is
    refused unless ``override=True``.
    """
    from fleet.strategies.base import Strategy

    if not isinstance(cls, type) or not issubclass(cls, Strategy):
        raise TypeError(f"register_strategy({name!r}, ...) needs a subclass of fleet.strategies.Strategy, got {cls!r}.")
    if not name or not isinstance(name, str):
        raise ValueError(f"A strategy name must be a non-empty string, got {name!r}.")
    taken = name in _BUILTIN or name in _registered
    if taken and not override and _registered.get(name) is not cls:
        what = "a built-in strategy" if name in _BUILTIN else f"already registered ({_registered[name].__name__})"
        raise ValueError(
            f"register_strategy({name!r}, {cls.__name__}): {name!r} is {what}. Choose another name, or pass "
            "override=True to replace it."
        )
    _registered[name] = cls


def names() -> list[str]:
    return sorted(set(_BUILTIN) | set(_registered))


def get(name: str) -> type[Strategy]:
    if name not in _registered and name in _BUILTIN:
        module, attr = _BUILTIN[name]
        _registered[name] = getattr(importlib.import_module(module), attr)
    if name not in _registered:
        raise ValueError(f"mode {name!r} is not a registered strategy; known modes: {', '.join(names())}")
    return _registered[name]


def _combinations() -> str:
    parts = []
    for name in names():
        updates = get(name).supported_updates
        parts.append(f"mode={name!r} with update " + " or ".join(repr(u) for u in updates))
    return "; ".join(parts)


def check_combination(config: DistributedStrategy) -> None:
    """Raise ValueError when the strategy's mode and options cannot run together."""
    cls = get(config.mode)
    if config.update not in cls.supported_updates:
        raise ValueError(
            f"update={config.update!r} is not supported with mode={config.mode!r}. "
            f"Supported combinations: {_combinations()}"
        )
    cls.check(config)
