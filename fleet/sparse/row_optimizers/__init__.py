"""The sparse row optimizers, registered here and nowhere else: each kind's name -> its :class:`RowOptimizer`.

Everything that depends on the kind of a table's optimizer (the spec's hyper-parameters and checks, the
per-row state, step counting, the native kernel's arguments, the torch math, the torch classes) asks the
object :func:`get` returns. Adding a rule: a module here with a :class:`RowOptimizer` subclass, its line in
``_RULES``, its element loop in the native kernel (fleet/sparse/csrc), its tests (docs/architecture.md).
"""

from __future__ import annotations

from fleet.sparse.row_optimizers.adagrad import Adagrad, RowWiseAdagradRule
from fleet.sparse.row_optimizers.adam import Adam, AdamW
from fleet.sparse.row_optimizers.base import Hyper, RowOptimizer
from fleet.sparse.row_optimizers.ftrl import FTRL
from fleet.sparse.row_optimizers.sgd import SGD

# Order matters only for from_torch: the first rule that claims a torch class wins (row-wise Adagrad before Adagrad).
_RULES: tuple[RowOptimizer, ...] = (SGD(), Adam(), AdamW(), RowWiseAdagradRule(), Adagrad(), FTRL())
_BY_NAME = {rule.name: rule for rule in _RULES}


def names() -> tuple[str, ...]:
    """Every registered kind's name."""
    return tuple(_BY_NAME)


def get(kind: object) -> RowOptimizer:
    """The rule called ``kind``; ``ValueError`` naming the registered kinds otherwise."""
    rule = _BY_NAME.get(kind) if isinstance(kind, str) else None
    if rule is None:
        raise ValueError(f"kind: unknown optimizer kind {kind!r}; known kinds: {sorted(_BY_NAME)}")
    return rule


def all_rules() -> tuple[RowOptimizer, ...]:
    """The registered rules, in lookup order."""
    return _RULES


__all__ = ["Hyper", "RowOptimizer", "all_rules", "get", "names"]
