"""Distributed strategies: one per module, behind fleet.strategies.base.Strategy."""

from fleet.registry import register_strategy
from fleet.strategies.base import Runtime, Strategy

__all__ = ["Runtime", "Strategy", "register_strategy"]
