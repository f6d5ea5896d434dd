"""What a worker's parameter-server tables are called in the user's model.

The servers number tables in the order every worker creates them; a number means nothing to the
user, and two workers whose models differ only in the order of equal tables (two
``SparseEmbedding(16)`` defined the other way round, or tables a script's own distributed mode
split over the ranks) would even agree on every config and silently train each other's rows.
So each create carries its table's name in the model: a sparse table's module path
(``emb_l.3``), a dense table's parameter names. The servers compare creates canonically, so
workers that name a table differently get a conflicting create naming both
(:meth:`fleet.ps.worker.optimizer.PSOptimizer._explain`).

The names come from the model given to ``fleet.distributed_model`` when it holds the
parameters; else from the smallest module holding all of the optimizer's parameters (found by
:mod:`fleet.training.owners`, the search fleet already makes for buffers at the same moment: the
model itself, not a wrapper some worker made around it), else from the outermost modules
holding them, ordered by their first parameter in the optimizer so that every worker of the
same script finds the same names. A table module that no model holds has no name: the tables are then
numbered only, and messages say how to get names.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fleet.errors import ModelMismatchError
from fleet.training import owners

NAMES_HINT = (
    "give the model to fleet.distributed_model(model) before fleet.distributed_optimizer, so that fleet names "
    "each table after its module"
)
"""How a user gets tables named when fleet found no model holding them."""


class TableNames:
    """Qualified names of the modules and parameters behind one wrapped optimizer's tables."""

    def __init__(self, params: list[torch.Tensor], model: nn.Module | None = None):
        roots = self._roots(params, model)
        self._modules: dict[int, str] = {}
        self._params: dict[int, str] = {}
        for root in roots:
            prefix = f"{type(root).__name__}." if len(roots) > 1 else ""
            for name, module in root.named_modules(remove_duplicate=False):
                if name:  # the root itself is the model, not a table within it
                    self._modules.setdefault(id(module), prefix + name)
            for name, p in root.named_parameters(remove_duplicate=False):
                self._params.setdefault(id(p), prefix + name)

    @staticmethod
    def _roots(params: list[torch.Tensor], model: nn.Module | None) -> list[nn.Module]:
        wanted = {id(p) for p in params}
        if model is not None and wanted <= {id(p) for p in model.parameters()}:
            return [model]
        found_model = owners.model_of(params) if model is None else None  # not a wrapper only some workers made
        if found_model is not None:
            return [found_model]
        position = {id(p): i for i, p in enumerate(params)}
        found = owners.modules_holding(params)
        if model is not None:
            found = [model, *(m for m in found if m is not model)]
        # every worker of the same script orders them alike: by the first of the optimizer's parameters each holds
        return sorted(
            found, key=lambda m: min((position[id(p)] for p in m.parameters() if id(p) in position), default=0)
        )

    def module(self, module: nn.Module) -> str | None:
        """``module``'s path in its model (``emb_l.3``); None when no model holds it."""
        return self._modules.get(id(module))

    def params(self, params: list[torch.Tensor]) -> list[str] | None:
        """The parameters' paths in their model; None when some parameter is held by no model (then the
        table goes unnamed: a name would depend on which modules this process happens to keep alive)."""
        names = [self._params.get(id(p)) for p in params]
        return None if any(n is None for n in names) else names


def dense_name(index: int, names: list[str]) -> str:
    """A dense table in words: its param group and the parameters it holds."""
    if not names:
        return f"param group {index}"
    held = names[0] if len(names) == 1 else f"{names[0]} ... {names[-1]}, {len(names)} parameters"
    return f"param group {index} ({held})"


SAME_MODEL = (
    "Every worker must build the same model and optimizer, creating its tables (fleet.nn.SparseEmbedding modules "
    "and param groups) in the same order. A script whose own distributed mode builds part of the model on each rank "
    "(embedding tables split over the ranks, as when it sees WORLD_SIZE, which fleetrun sets) does not fit a "
    "parameter-server job: see docs/migrating-from-ddp.md."
)


def _what(side: dict[str, Any]) -> str:
    """One side of a conflicting create in words: "the sparse table 'emb_l.3'"."""
    name = side["config"].get("name")
    if side["kind"] == "dense":
        return f"the dense table of {name}" if name else "a dense table"
    return f"the sparse table {name!r}" if name else f"a sparse table held by no model ({NAMES_HINT})"


def explain_conflict(details: dict[str, Any], worker: int) -> ModelMismatchError | None:
    """A conflicting create (the server's details) in the model's terms: the module or parameter that differs.

    None when the details say nothing this can name (the server's own message is then the best).
    """
    table, existing, requested = details.get("table"), details.get("existing"), details.get("requested")
    if not isinstance(existing, dict) or not isinstance(requested, dict):
        return None
    here, first = f"worker {worker}", "the worker that created the parameter-server table first"
    theirs, mine = existing["config"], requested["config"]
    if existing["kind"] != requested["kind"] or theirs.get("name") != mine.get("name"):
        return ModelMismatchError(
            f"Workers hold different models: parameter-server table {table} is {_what(requested)} on {here} but "
            f"{_what(existing)} on {first}. {SAME_MODEL}"
        )
    names = mine.get("names") or []
    for key in ("shapes", "names"):
        a_list, b_list = theirs.get(key), mine.get(key)
        if a_list is None or b_list is None or a_list == b_list:
            continue
        for position, (a, b) in enumerate(zip(a_list, b_list, strict=False)):
            if a != b:
                name = names[position] if position < len(names) else f"parameter {position}"
                if key == "shapes":
                    return ModelMismatchError(
                        f"Workers hold different models: {name!r} has shape {b} on {here} but {a} on {first}. "
                        "Every worker must build the same model."
                    )
                return ModelMismatchError(
                    f"Workers hold different models: {_what(requested)} holds {b!r} on {here} where {first} holds "
                    f"{a!r} (position {position}). {SAME_MODEL}"
                )
        return ModelMismatchError(
            f"Workers hold different models: {here} has {len(b_list)} parameters in {_what(requested)} where the "
            f"first worker had {len(a_list)}. Every worker must build the same model and optimizer."
        )
    differ = sorted(k for k in set(theirs) | set(mine) if theirs.get(k) != mine.get(k))
    if not differ:
        return None
    settings = "; ".join(f"{k}={mine.get(k)!r} on {here} but {theirs.get(k)!r} there" for k in differ[:4])
    return ModelMismatchError(
        f"Workers disagree about {_what(requested)} (parameter-server table {table}), as created first by another "
        f"worker: {settings}. {SAME_MODEL}"
    )
