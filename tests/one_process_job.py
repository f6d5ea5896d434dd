"""A one-process fleet job to save and load (tests/storage/conftest.py's ``trained``), and what to compare."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import fleet
import fleet.api


def started(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[torch.nn.Module, torch.optim.Optimizer]]:
    """A model and its wrapped optimizer, stepped once, in a job of this process alone."""
    for name in ("FLEET_ROLE", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    fleet.api._reset_for_tests()
    fleet.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = fleet.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=0.1))
    step(model, opt)
    try:
        yield model, opt
    finally:
        fleet.api._reset_for_tests()


def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.ones(4, 3)).sum().backward()
    opt.step()


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The model's state and the optimizer's tensors, copied."""
    state = [t.clone() for t in model.state_dict().values()]
    for per_param in opt.state_dict()["state"].values():
        state += [v.clone() for v in per_param.values() if isinstance(v, torch.Tensor)]
    return state


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
