"""Name -> strategy class. Built-in strategies are found on first use; users add their own.

The registry sits below the strategy model (``fleet.strategy`` asks it which modes exist and
whether a combination of options runs) and below the strategies themselves, so it imports
neither: a built-in is named by where it lives, as an entry point would be, and a class is
recognised by its place in ``fleet.strategies.base.Strategy``'s family.
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar, Protocol

__all__ = ["StrategyClass", "check_combination", "get", "names", "register_strategy", "strategy_classes"]

_BUILTIN = {
    "collective": ("fleet.strategies.collective", "CollectiveStrategy"),
    "ps": ("fleet.strategies.parameter_server", "ParameterServerStrategy"),
    "sharding": ("fleet.strategies.sharding", "ShardingStrategy"),
}
_BASE = ("fleet.strategies.base", "Strategy")
_registered: dict[str, StrategyClass] = {}


class StrategyClass(Protocol):
    """What the registry and the strategy model need of a strategy class (``fleet.strategies.Strategy``)."""

    name: ClassVar[str]
    supported_updates: ClassVar[tuple[str, ...]]
    owned_fields: ClassVar[frozenset[str]]
    uses_servers: ClassVar[bool]

    @classmethod
    def check(cls, config: Any) -> None: ...

    @classmethod
    def check_launch(cls, config: Any, role: Any) -> None: ...


def _is_strategy_class(cls: Any) -> bool:
    return isinstance(cls, type) and any((c.__module__, c.__qualname__) == _BASE for c in cls.__mro__)


def register_strategy(name: str, cls: type, override: bool = False) -> None:
    """Make ``DistributedStrategy(mode=name)`` run ``cls`` (a subclass of fleet.strategies.Strategy).

    A name that is taken (a built-in such as "collective", or one registered before) is
    refused unless ``override=True``.
    """
    if not _is_strategy_class(cls):
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
    _registered[name] = cls  # type: ignore[assignment]


def names() -> list[str]:
    return sorted(set(_BUILTIN) | set(_registered))


def get(name: str) -> Any:
    """The strategy class registered as ``name`` (a built-in is imported on first use)."""
    if name not in _registered and name in _BUILTIN:
        module, attr = _BUILTIN[name]
        _registered[name] = getattr(importlib.import_module(module), attr)
    if name not in _registered:
        raise ValueError(f"mode {name!r} is not a registered strategy; known modes: {', '.join(names())}")
    return _registered[name]


def strategy_classes() -> list[Any]:
    """Every registered strategy class, in name order (built-ins imported)."""
    return [get(name) for name in names()]


def _combinations() -> str:
    parts = []
    for name in names():
        updates = get(name).supported_updates
        parts.append(f"mode={name!r} with update " + " or ".join(repr(u) for u in updates))
    return "; ".join(parts)


def check_combination(config: Any) -> None:
    """Raise ValueError when the strategy's mode and options cannot run together."""
    cls = get(config.mode)
    if config.update not in cls.supported_updates:
        raise ValueError(
            f"update={config.update!r} is not supported with mode={config.mode!r}. "
            f"Supported combinations: {_combinations()}"
        )
    cls.check(config)
