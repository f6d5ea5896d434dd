"""Which parameter the workers disagree about, in words (after the headers showed that they do)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fleet.errors import FleetError


def check_same_values(
    params: list[torch.Tensor], name: Callable[[torch.Tensor], str], group: Any, wait: Callable[[Any, str], None]
) -> None:
    """Raise FleetError naming the parameters whose values differ between workers (by checksums)."""
    with torch.no_grad():
        mine = torch.tensor([[float(p.double().sum()), float(p.double().square().sum())] for p in params])
    mine = mine.to(torch.float64)
    gathered = torch.empty(dist.get_world_size(group) * mine.shape[0], 2, dtype=torch.float64)
    wait(dist.all_gather_single(gathered, mine, group=group, async_op=True), "comparing added parameters")
    everyone = gathered.view(-1, *mine.shape)
    differs = (everyone != everyone[0]).any(dim=2).any(dim=0).tolist()
    if any(differs):
        names = [name(p) for p, d in zip(params, differs, strict=True) if d]
        ranks = [r for r in range(everyone.shape[0]) if not torch.equal(everyone[r], everyone[0])]
        raise FleetError(
            f"Parameters added to the optimizer hold different values on different workers: "
            f"{', '.join(map(repr, names))} (worker {', '.join(map(str, ranks))} differs from worker 0). They were "
            "added with add_param_group on the unwrapped optimizer, so fleet could not give every worker worker 0's "
            "values before the forward pass. Call add_param_group on the optimizer fleet.distributed_optimizer "
            "returned (it broadcasts worker 0's values), or initialise them identically on every worker."
        )


def explain(everyone: list[list[list[Any]]]) -> str:
    """Name the first parameter on which the workers' ``[name, shape, trainable, sparse]`` lists differ."""
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        if len(theirs) != len(reference):
            return (
                f"Workers train different sets of parameters: worker {rank}'s wrapped optimizers and models hold "
                f"{len(theirs)} parameters, worker 0's hold {len(reference)} (add_param_group on some workers only?). "
                "Every worker must add the same parameter groups."
            )
    for position, entry in enumerate(reference):
        column = [w[position] for w in everyone]
        for field in (1, 2, 3):  # shape, trainable, sparse
            values = [c[field] for c in column]
            if len({repr(v) for v in values}) == 1:
                continue
            split: dict[str, list[int]] = {}
            for rank, value in enumerate(values):
                split.setdefault(repr(value), []).append(rank)
            if field == 2:
                on = split.get("True", [])
                off = split.get("False", [])
                return (
                    f"Workers disagree about which parameters train: {entry[0]!r} requires grad on "
                    f"{_ranks(on)} but is frozen on {_ranks(off)}. Freeze and unfreeze parameters the same way "
                    "on every worker (the change takes effect at the next backward)."
                )
            if field == 1:
                return (
                    f"Workers hold different models: {entry[0]!r} has shape "
                    + " vs ".join(f"{value} on {_ranks(ranks)}" for value, ranks in split.items())
                    + ". Every worker must build the same model."
                )
            return (
                f"Workers disagree about {entry[0]!r}: its embedding has sparse="
                + " vs ".join(f"{value} on {_ranks(ranks)}" for value, ranks in split.items())
                + ". Build the model the same way on every worker."
            )
    return "Workers hold the same parameters but different gradient bucket settings (bucket_mb)."


def _ranks(ranks: list[int]) -> str:
    return ("worker " if len(ranks) == 1 else "workers ") + ", ".join(str(r) for r in ranks)
