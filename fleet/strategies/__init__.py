"""Distributed strategies: one per module, behind fleet.strategies.base.Strategy."""

from fleet.strategies.base import Runtime, Strategy
from fleet.strategies.registry import register_strategy

__all__ = ["Runtime", "Strategy", "register_strategy"]
