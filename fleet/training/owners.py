"""Which ``nn.Module`` holds a parameter, and the parameter's name in its model.

Users hand fleet an optimizer, not a model, so error messages would otherwise say
"parameter 3" and fleet could not tell that a parameter is an ``nn.Embedding(sparse=True)``
weight. The modules are found among the live objects (``gc``), once per call: a parameter's
name is taken from the module that holds the most of the parameters asked about (the model
they came from; its ``named_parameters`` path), and its owner is the module that holds it
directly. A parameter held by no module keeps a positional name.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Owner:
    name: str
    module: nn.Module | None  # the module whose own _parameters hold it


def _modules() -> list[nn.Module]:
    # issubclass(type(o)) rather than isinstance: some lazy module proxies warn when their __class__ is read.
    return [o for o in gc.get_objects() if issubclass(type(o), nn.Module)]


def find_owners(params: list[torch.Tensor]) -> dict[int, Owner]:
    """``id(param) -> Owner`` for every parameter in ``params``."""
    wanted = {id(p) for p in params}
    direct: dict[int, nn.Module] = {}
    named: list[tuple[int, dict[int, str]]] = []  # (how many wanted params the module holds, their names)
    for module in _modules():
        for p in module._parameters.values():
            if p is not None and id(p) in wanted:
                held = direct.get(id(p))
                # Tied weights (several modules hold it): whether any of them is a sparse embedding decides,
                # not which one the collector's list (an order that differs between workers) names first.
                if held is None or (_sparse_embedding(module) and not _sparse_embedding(held)):
                    direct[id(p)] = module
        names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False) if id(p) in wanted}
        if names:
            named.append((len(names), names))
    owners: dict[int, Owner] = {}
    for i, p in enumerate(params):
        # The outermost path within the module that holds the most of them: the model's own name for it.
        candidates = [(count, len(names[id(p)]), names[id(p)]) for count, names in named if id(p) in names]
        name = max(candidates)[2] if candidates else f"parameter {i} of the optimizer"
        owners[id(p)] = Owner(name, direct.get(id(p)))
    return owners


def names_of(params: list[torch.Tensor]) -> list[str]:
    owners = find_owners(params)
    return [owners[id(p)].name for p in params]


def _sparse_embedding(module: nn.Module | None) -> bool:
    return isinstance(module, nn.Embedding | nn.EmbeddingBag) and bool(module.sparse)


def is_sparse_embedding_weight(owner: Owner) -> bool:
    """Whether backward gives this parameter a sparse gradient (nn.Embedding / EmbeddingBag with sparse=True)."""
    return _sparse_embedding(owner.module)


def modules_holding(params: list[torch.Tensor]) -> list[nn.Module]:
    """The outermost modules that hold any of ``params`` (the models they came from), ordered by the first
    of ``params`` each holds.

    Why that order: the garbage collector's lists (the scan's order) differ between workers, with the
    moments their collections ran; callers issue a collective per model (sharding shards each in turn),
    so every worker must list them alike -- in the gc's order, two workers once checked different models
    against each other ("Workers hold different models") when one had collected a previous model's cycle.
    """
    position: dict[int, int] = {}
    for i, p in enumerate(params):
        position.setdefault(id(p), i)
    holding = [m for m in _modules() if any(id(p) in position for p in m.parameters())]
    inner = {id(child) for m in holding for child in m.modules() if child is not m}
    outer = [m for m in holding if id(m) not in inner]
    return sorted(
        outer, key=lambda m: (min(position[id(p)] for p in m.parameters() if id(p) in position), type(m).__name__)
    )


def model_of(params: list[torch.Tensor]) -> nn.Module | None:
    """The smallest module holding every one of ``params``: the model they came from, never a wrapper
    around it that only some processes made (None when no module holds them all)."""
    wanted = {id(p) for p in params}
    best: tuple[int, int] | None = None
    found = None
    for module in _modules():
        held = {id(p) for p in module.parameters()}
        if wanted <= held:
            size = (len(held), sum(1 for _ in module.modules()))
            if best is None or size < best:
                best, found = size, module
    return found


def model_buffers(params: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[str]]:
    """The buffers of the models holding ``params`` and their names, in an order every worker agrees on
    (the models by the first of ``params`` each holds)."""
    models = modules_holding(params)  # in that order already
    seen: set[int] = set()
    buffers, names = [], []
    for model in models:
        for name, buffer in model.named_buffers():
            if id(buffer) not in seen and not torch.nn.parameter.is_lazy(buffer):
                seen.add(id(buffer))
                buffers.append(buffer)
                names.append(name)
    return buffers, names
