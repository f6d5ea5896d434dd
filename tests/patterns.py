"""Everyday training patterns, each run distributed and as one process on the union of the batches.

A scenario builds its models and optimizers from the current RNG state, may change them
before a step (freeze, unfreeze, add a param group), and defines one worker's loss for a
step. The single-process reference builds from worker 0's seed and, at every step,
back-propagates the mean of every worker's loss (the loss on the union of the batches), so
a distributed run must end with the reference's parameters, and with ``.grad is None``
exactly where the reference has it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

STEPS = 5
BATCH = 6
SEED = 1000


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    return torch.optim.Adam(params, lr=0.01)


def batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + worker)
    return torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g)


@dataclass
class State:
    kind: str
    modules: dict[str, nn.Module]
    optimizers: list[torch.optim.Optimizer]
    inner: list[torch.optim.Optimizer] = field(default_factory=list)  # the unwrapped ones, when distributed

    def __getattr__(self, name: str) -> nn.Module:
        try:
            return self.__dict__["modules"][name]
        except KeyError:
            raise AttributeError(name) from None


@dataclass
class Scenario:
    name: str
    build: Callable[[str], State]
    loss: Callable[[State, tuple, int, int, int], torch.Tensor]  # (state, batch, worker, step, workers)
    before_step: Callable[[State, int], None] = lambda state, step: None  # before zero_grad
    after_zero_grad: Callable[[State, int], None] = lambda state, step: None
    make_batch: Callable[[int, int], tuple] = batch
    kinds: tuple[str, ...] = ("sgd", "adam")
    ps_kinds: tuple[str, ...] = ("sgd", "adam")  # also run in parameter-server sync mode with these


def _mlp(**heads: int) -> dict[str, nn.Module]:
    modules: dict[str, nn.Module] = {"trunk": nn.Linear(6, 8)}
    for name, out in heads.items():
        modules[name] = nn.Linear(8, out)
    return modules


def _params(modules: dict[str, nn.Module], *names: str) -> list[nn.Parameter]:
    return [p for n in names for p in modules[n].parameters()]


def _single(kind: str, modules: dict[str, nn.Module], names: tuple[str, ...]) -> State:
    return State(kind, modules, [make_optimizer(kind, _params(modules, *names))])


# --- a branch some or all workers skip ---------------------------------------------------------


def _branch_build(kind: str) -> State:
    return _single(kind, _mlp(head_a=3, head_b=3, head_c=3), ("trunk", "head_a", "head_b", "head_c"))


def _uses_b(worker: int, step: int) -> bool:
    # step 0 and 3: nobody; 1: worker 0 only; 2: everybody; 4: every worker but 0
    return {0: False, 1: worker == 0, 2: True, 3: False, 4: worker != 0}[step]


def _branch_loss(state: State, data: tuple, worker: int, step: int, workers: int) -> torch.Tensor:
    x, y = data
    h = torch.tanh(state.trunk(x))
    loss = F.cross_entropy(state.head_a(h), y)
    if _uses_b(worker, step):
        loss = loss + F.cross_entropy(state.head_b(h), y)
    return loss  # head_c: never used by anyone


# --- frozen, unfrozen --------------------------------------------------------------------------


def _frozen_build(kind: str) -> State:
    state = _single(kind, _mlp(head=3), ("trunk", "head"))
    state.trunk.requires_grad_(False)  # in the optimizer, frozen at the start
    return state


def _mlp_loss(state: State, data: tuple, worker: int, step: int, workers: int) -> torch.Tensor:
    x, y = data
    return F.cross_entropy(state.head(torch.tanh(state.trunk(x))), y)


def _unfreeze_at_2(state: State, step: int) -> None:
    if step == 2:
        state.trunk.requires_grad_(True)


def _plain_build(kind: str) -> State:
    return _single(kind, _mlp(head=3), ("trunk", "head"))


def _freeze_at_2(state: State, step: int) -> None:
    if step == 2:
        state.trunk.requires_grad_(False)


# --- add_param_group ---------------------------------------------------------------------------


def _grow_build(kind: str) -> State:
    modules = _mlp(head=3)
    modules["extra"] = nn.Linear(8, 3)  # drawn from this worker's RNG: the wrapper must give worker 0's
    return _single(kind, modules, ("trunk", "head"))


def _grow_loss(state: State, data: tuple, worker: int, step: int, workers: int) -> torch.Tensor:
    x, y = data
    h = torch.tanh(state.trunk(x))
    out = state.head(h) + (state.extra(h) if step >= 2 else 0)
    return F.cross_entropy(out, y)


def _add_group_at_2(state: State, step: int) -> None:
    if step == 2:
        state.optimizers[0].add_param_group({"params": list(state.extra.parameters()), "lr": 0.05})


def _grow_same_build(kind: str) -> State:
    state = _grow_build(kind)
    with torch.no_grad():  # identical on every worker: adding it to the unwrapped optimizer is then fine
        g = torch.Generator().manual_seed(7)
        for p in state.extra.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return state


def _add_group_to_inner_at_2(state: State, step: int) -> None:
    if step == 2:
        target = state.inner[0] if state.inner else state.optimizers[0]
        target.add_param_group({"params": list(state.extra.parameters()), "lr": 0.05})


# --- two optimizers sharing a backward ------------------------------------------------------------


def _two_build(kind: str) -> State:
    modules = {"encoder": nn.Linear(6, 8), "decoder": nn.Linear(8, 3), "aux": nn.Linear(8, 3)}
    first = make_optimizer(kind, modules["encoder"].parameters())
    second = make_optimizer(
        "adam" if kind == "sgd" else "sgd", [*modules["decoder"].parameters(), *modules["aux"].parameters()]
    )
    return State(kind, modules, [first, second])


def _two_loss(state: State, data: tuple, worker: int, step: int, workers: int) -> torch.Tensor:
    x, y = data
    h = torch.relu(state.encoder(x))
    loss = F.cross_entropy(state.decoder(h), y)
    if worker == 1:  # aux is unused on every other worker
        loss = loss + 0.5 * F.cross_entropy(state.aux(h), y)
    return loss


# --- sparse gradients ------------------------------------------------------------------------------


def _sparse_build(kind: str) -> State:
    modules = {
        "emb": nn.Embedding(20, 4, sparse=True),
        "bag": nn.EmbeddingBag(20, 4, mode="sum", sparse=True),
        "head": nn.Linear(8, 3),
    }
    if kind == "sgd":  # torch's SGD takes sparse gradients with momentum (weight decay it refuses)
        optimizers = [torch.optim.SGD([p for m in modules.values() for p in m.parameters()], lr=0.1, momentum=0.9)]
    else:
        embeddings = [*modules["emb"].parameters(), *modules["bag"].parameters()]
        optimizers = [
            torch.optim.SparseAdam(embeddings, lr=0.05),
            torch.optim.Adam(modules["head"].parameters(), lr=0.01),
        ]
    return State(kind, modules, optimizers)


def _sparse_batch(worker: int, step: int) -> tuple:
    g = torch.Generator().manual_seed(100 * step + worker)
    ids = torch.randint(0, 10, (BATCH, 3), generator=g) + 5 * worker  # some rows only one worker touches
    return ids, torch.randint(0, 3, (BATCH,), generator=g)


def _sparse_loss(state: State, data: tuple, worker: int, step: int, workers: int) -> torch.Tensor:
    ids, y = data
    features = torch.cat([state.emb(ids).mean(1), state.bag(ids)], 1)
    return F.cross_entropy(state.head(features), y)


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("unused_branch", _branch_build, _branch_loss),
        Scenario("frozen_then_unfrozen", _frozen_build, _mlp_loss, before_step=_unfreeze_at_2),
        Scenario("unfrozen_after_zero_grad", _frozen_build, _mlp_loss, after_zero_grad=_unfreeze_at_2),
        Scenario("frozen_mid_training", _plain_build, _mlp_loss, before_step=_freeze_at_2),
        Scenario("add_param_group", _grow_build, _grow_loss, before_step=_add_group_at_2),
        Scenario("add_param_group_to_inner", _grow_same_build, _grow_loss, before_step=_add_group_to_inner_at_2),
        Scenario("two_optimizers", _two_build, _two_loss),
        # The parameter server has no SparseAdam: its dense tables take sparse gradients densified.
        Scenario("sparse_gradients", _sparse_build, _sparse_loss, make_batch=_sparse_batch, ps_kinds=("sgd",)),
    )
}


def snapshot(state: State) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for module_name, module in state.modules.items():
        for name, p in module.named_parameters():
            out[f"{module_name}.{name}"] = p.detach().clone()
            out[f"{module_name}.{name}.grad_is_none"] = p.grad is None
    return out


def run_step(scenario: Scenario, state: State, step: int, losses: Callable[[], torch.Tensor]) -> None:
    scenario.before_step(state, step)
    for opt in state.optimizers:
        opt.zero_grad()
    scenario.after_zero_grad(state, step)
    losses().backward()
    for opt in state.optimizers:
        opt.step()


def reference(name: str, kind: str, workers: int, steps: int = STEPS) -> dict[str, Any]:
    """One process, worker 0's initial values, each step on the mean of every worker's loss."""
    scenario = SCENARIOS[name]
    torch.manual_seed(SEED)
    state = scenario.build(kind)
    for step in range(steps):

        def union(step: int = step) -> torch.Tensor:
            parts = [scenario.loss(state, scenario.make_batch(w, step), w, step, workers) for w in range(workers)]
            return sum(parts) / workers

        run_step(scenario, state, step, union)
    return snapshot(state)


def distributed(name: str, kind: str, rank: int, workers: int, wrap: Callable, steps: int = STEPS) -> dict[str, Any]:
    """One worker's run; ``wrap`` is fleet.distributed_optimizer. Initial values differ per worker on purpose."""
    scenario = SCENARIOS[name]
    torch.manual_seed(SEED + rank)
    state = scenario.build(kind)
    state.inner = list(state.optimizers)
    state.optimizers = [wrap(opt) for opt in state.optimizers]
    for step in range(steps):
        run_step(
            scenario,
            state,
            step,
            lambda step=step: scenario.loss(state, scenario.make_batch(rank, step), rank, step, workers),
        )
    return snapshot(state)


def compare(got: dict[str, Any], want: dict[str, Any], atol: float = 1e-5) -> list[str]:
    """Differences between a run and the reference, in words (empty when they agree)."""
    problems = []
    for key, value in want.items():
        if isinstance(value, bool):
            if got[key] != value:
                problems.append(f"{key}: {got[key]} (reference {value})")
        elif not torch.allclose(got[key], value, atol=atol):
            problems.append(f"{key}: off by {(got[key] - value).abs().max().item():.3g}")
    return problems
