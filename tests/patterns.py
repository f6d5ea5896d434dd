"""Everyday training patterns, each run distributed and as one process on the union of the batches.

A scenario builds its models and optimizers from the current RNG state, may change them
before a step (freeze, unfreeze, add a param group), and defines one worker's loss for a
step. The single-process reference builds from worker 0's seed and, at every step,
back-propagates the mean of every worker's loss (the loss on the union of the batches), so
a distributed run must end with the reference's parameters and gradients, and with
``.grad is None`` exactly where the reference has it.

A scenario with its own ``train`` step runs the training code between two steps itself
(backward twice, clipping, a GradScaler, a scheduler...): ``losses(micro)`` is the loss of
micro-batch ``micro`` of the step, this worker's or the union's. One the parameter server
cannot run as one process would names, in ``ps_refused``, the error it must fail with at its
first step.
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
    kept: dict[str, Any] = field(default_factory=dict)  # what a train step keeps (schedulers, a GradScaler)

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
    train: Callable[[State, int, Callable[..., torch.Tensor]], None] | None = None  # instead of run_step's
    ps_refused: str | None = None  # parameter-server sync mode refuses it (wrapping or first step), saying this


def _mlp(**heads: int) -> dict[str, nn.Module]:
    modules: dict[str, nn.Module] = {"trunk": nn.Linear(6, 8)}
    for name, out in heads.items():
        modules[name] = nn.Linear(8, out)
    return modules


def _params(modules: dict[str, nn.Module], *names: str) -> list[nn.Parameter]:
    return [p for n in names for p in modules[n].parameters()]


def _one_model(model_class: type[nn.Module]) -> Callable[[str], State]:
    """A build for a scenario of one model (``State.model``) and one optimizer over all its parameters."""

    def build(kind: str) -> State:
        model = model_class()
        return State(kind, {"model": model}, [make_optimizer(kind, model.parameters())])

    return build


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


class _Heads(nn.Module):
    """Two heads in one module (one sharding unit): the branch is inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 3)
        self.b = nn.Linear(8, 3)

    def forward(self, h: torch.Tensor, use_b: bool) -> list[torch.Tensor]:
        return [self.a(h), self.b(h)] if use_b else [self.a(h)]


class _BranchInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 8)
        self.heads = _Heads()


def _branch_inside_loss(state: State, data: tuple, worker: int, step: int, workers: int) -> torch.Tensor:
    x, y = data
    model = state.model
    h = torch.tanh(model.trunk(x))
    return sum(F.cross_entropy(logits, y) for logits in model.heads(h, _uses_b(worker, step)))


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


# --- tied weights, a module called twice ------------------------------------------------------------


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.mid = nn.Linear(8, 8)
        self.out = nn.Linear(8, 10)
        self.out.weight = self.emb.weight  # one Parameter, two modules


def _tied_loss(state: State, data: tuple, worker: int, step: int, workers: int) -> torch.Tensor:
    x, y = data
    model = state.model
    h = model.emb((x[:, :2].abs() * 3).long().clamp(0, 9)).mean(1)
    h = torch.tanh(model.mid(torch.tanh(model.mid(h))))  # the same module twice in one forward
    return F.cross_entropy(model.out(h), y)


# --- training steps written by hand ----------------------------------------------------------------


def _zero_grad(state: State, set_to_none: bool = True) -> None:
    for opt in state.optimizers:
        opt.zero_grad(set_to_none=set_to_none)


def _step(state: State) -> None:
    for opt in state.optimizers:
        opt.step()


def _all_params(state: State) -> list[nn.Parameter]:
    return [p for module in state.modules.values() for p in module.parameters()]


def _backward_twice(state: State, step: int, losses: Callable[..., torch.Tensor]) -> None:
    """Accumulation without no_sync: two backward passes (one through a retained graph) per step."""
    _zero_grad(state)
    loss = losses(0)
    loss.backward(retain_graph=True)
    (0.5 * loss).backward()
    losses(1).backward()
    _step(state)


def _keep_zeros(state: State, step: int, losses: Callable[..., torch.Tensor]) -> None:
    _zero_grad(state, set_to_none=False)  # zeros, not None: a branch nobody took still steps (momentum, Adam)
    losses(0).backward()
    _step(state)


def _step_every_other(state: State, step: int, losses: Callable[..., torch.Tensor]) -> None:
    """Gradients accumulate over two iterations; zero_grad only after the step."""
    losses(0).backward()
    if step % 2:
        _step(state)
        _zero_grad(state)


def _closure_step(state: State, step: int, losses: Callable[..., torch.Tensor]) -> None:
    def closure() -> torch.Tensor:
        _zero_grad(state)
        loss = losses(0)
        loss.backward()
        return loss

    for opt in state.optimizers:
        opt.step(closure if opt is state.optimizers[0] else None)


def _backward_inputs(state: State, step: int, losses: Callable[..., torch.Tensor]) -> None:
    """backward(inputs=...): the head's gradients first, then the trunk's, through a retained graph."""
    _zero_grad(state)
    loss = losses(0)
    loss.backward(inputs=list(state.head.parameters()), retain_graph=True)
    loss.backward(inputs=list(state.trunk.parameters()))
    _step(state)


def _input_penalty_loss(state: State, data: tuple, worker: int, step: int, workers: int) -> torch.Tensor:
    """A gradient penalty on the inputs (torch.autograd.grad with create_graph, then a double backward)."""
    x, y = data
    x = x.clone().requires_grad_(True)
    loss = _mlp_loss(state, (x, y), worker, step, workers)
    (gx,) = torch.autograd.grad(loss, x, create_graph=True)
    return loss + 0.5 * gx.pow(2).sum()


def _schedules(state: State, step: int, losses: Callable[..., torch.Tensor]) -> None:
    if step == 0:  # built on the wrapped optimizer, as a script builds them after fleet.distributed_optimizer
        opt = state.optimizers[0]
        state.kept["schedulers"] = [
            torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
            torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 / (1 + epoch)),
        ]
    if step == 3:
        state.optimizers[0].param_groups[1]["lr"] = 0.03  # by hand
    _zero_grad(state)
    losses(0).backward()
    _step(state)
    for scheduler in state.kept["schedulers"]:
        scheduler.step()


def _one_cycle(state: State, step: int, losses: Callable[..., torch.Tensor]) -> None:
    if step == 0:  # cycles the momentum (SGD) or betas[0] (Adam) as well as the lr
        state.kept["scheduler"] = torch.optim.lr_scheduler.OneCycleLR(state.optimizers[0], 0.2, total_steps=STEPS)
    _zero_grad(state)
    losses(0).backward()
    _step(state)
    state.kept["scheduler"].step()


def _hyper_by_hand(state: State, step: int, losses: Callable[..., torch.Tensor]) -> None:
    if step == 0:
        group = state.optimizers[0].param_groups[0]
        if "momentum" in group:
            group["momentum"] = 0.5
        else:
            group["weight_decay"] = 0.2
    _zero_grad(state)
    losses(0).backward()
    _step(state)


def _clip_norm(state: State, step: int, losses: Callable[..., torch.Tensor]) -> None:
    _zero_grad(state)
    losses(0).backward()
    torch.nn.utils.clip_grad_norm_(_all_params(state), 0.3)  # small enough to clip the union's gradient
    _step(state)


def _clip_value(state: State, step: int, losses: Callable[..., torch.Tensor]) -> None:
    _zero_grad(state)
    losses(0).backward()
    torch.nn.utils.clip_grad_value_(_all_params(state), 0.02)
    _step(state)


def _grads_by_hand(state: State, step: int, losses: Callable[..., torch.Tensor]) -> None:
    _zero_grad(state)
    losses(0).backward()
    state.head.weight.grad.mul_(0.5)
    state.trunk.bias.grad = torch.full_like(state.trunk.bias, 0.1)
    _step(state)


def _grads_from_autograd_grad(state: State, step: int, losses: Callable[..., torch.Tensor]) -> None:
    """Gradients computed with torch.autograd.grad and set by hand: every one of them on even steps (no
    backward at all), the head's after a backward into the trunk only on odd steps."""
    _zero_grad(state)
    loss = losses(0)
    by_hand = _all_params(state) if step % 2 == 0 else list(state.head.parameters())
    grads = torch.autograd.grad(loss, by_hand, retain_graph=True)
    if step % 2:
        loss.backward(inputs=list(state.trunk.parameters()))
    for p, g in zip(by_hand, grads, strict=True):
        p.grad = g
    _step(state)


def _grad_scaler(state: State, step: int, losses: Callable[..., torch.Tensor]) -> None:
    if step == 0:
        state.kept["scaler"] = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    scaler, opt = state.kept["scaler"], state.optimizers[0]
    _zero_grad(state)
    scaler.scale(losses(0)).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(_all_params(state), 0.3)
    scaler.step(opt)  # skipped where the gradient is not finite (step 2): on every worker alike
    scaler.update()


def _inf_at_2_loss(state: State, data: tuple, worker: int, step: int, workers: int) -> torch.Tensor:
    loss = _mlp_loss(state, data, worker, step, workers)
    return loss * float("inf") if step == 2 and worker == workers - 1 else loss


def _normalise_by_hand(state: State, step: int, losses: Callable[..., torch.Tensor]) -> None:
    _zero_grad(state)
    losses(0).backward()
    _step(state)
    with torch.no_grad():  # weight normalisation by hand between steps
        state.head.weight.div_(state.head.weight.norm(dim=1, keepdim=True))
        state.trunk.bias.clamp_(-0.1, 0.1)


def _groups_build(kind: str) -> State:
    """Three param groups with their own hyper-parameters, for the optimizers beyond plain SGD and Adam."""
    modules = _mlp(head=3, head2=3)
    groups = [
        {"params": list(modules["trunk"].parameters())},
        {"params": list(modules["head"].parameters()), "lr": 0.05, "weight_decay": 0.1},
        {"params": list(modules["head2"].parameters()), "lr": 0.02},
    ]
    if kind == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(groups, lr=0.01, weight_decay=0.05, betas=(0.8, 0.99))
    elif kind == "adagrad":
        opt = torch.optim.Adagrad(groups, lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1)
    elif kind == "nesterov":
        groups[2]["momentum"] = 0.5
        opt = torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True)
    elif kind == "maximize":
        opt = torch.optim.Adam(groups, lr=0.01, maximize=True)
    elif kind == "adam_decoupled":
        opt = torch.optim.Adam(groups, lr=0.01, weight_decay=0.1, decoupled_weight_decay=True)
    elif kind == "rmsprop":
        opt = torch.optim.RMSprop(groups, lr=0.01, momentum=0.5)
    else:
        opt = make_optimizer(kind, groups)
    return State(kind, modules, [opt])


def _groups_loss(state: State, data: tuple, worker: int, step: int, workers: int) -> torch.Tensor:
    x, y = data
    h = torch.tanh(state.trunk(x))
    return F.cross_entropy(state.head(h) + state.head2(h), y)


class _Mixed(nn.Module):
    """A float64 layer, a float32 one, and integer and boolean buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8).double()
        self.b = nn.Linear(8, 3)
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))
        self.register_buffer("mask", torch.ones(8, dtype=torch.bool))


def _mixed_loss(state: State, data: tuple, worker: int, step: int, workers: int) -> torch.Tensor:
    x, y = data
    model = state.model
    model.seen += 1
    h = torch.tanh(model.a(x.double())).float() * model.mask
    return F.cross_entropy(model.b(h), y)


def _ema_build(kind: str) -> State:
    state = _plain_build(kind)
    state.modules["ema"] = nn.Linear(6, 8).requires_grad_(False)  # worker's own values until the first step
    return state


def _ema_train(state: State, step: int, losses: Callable[..., torch.Tensor]) -> None:
    """An EMA of the trunk kept by a step post-hook registered on the (wrapped) optimizer."""
    if step == 0:

        @torch.no_grad()
        def update(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
            first = not state.kept.setdefault("ema_steps", 0)
            state.kept["ema_steps"] += 1
            for mine, trained in zip(state.ema.parameters(), state.trunk.parameters(), strict=True):
                mine.copy_(trained) if first else mine.lerp_(trained, 0.5)

        state.optimizers[0].register_step_post_hook(update)
    _zero_grad(state)
    losses(0).backward()
    _step(state)


class _RandomBuffer(nn.Module):
    """A fixed random projection, drawn when the model is built (each worker draws its own), beside a
    random one larger than one parameter-server request (4 MiB as float64), which travels in pieces."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("projection", torch.randn(6, 6))
        self.register_buffer("table", torch.randn(600_000))
        self.trunk = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)


def _random_buffer_loss(state: State, data: tuple, worker: int, step: int, workers: int) -> torch.Tensor:
    x, y = data
    model = state.model
    return F.cross_entropy(
        model.head(torch.tanh(model.trunk(x @ model.projection))) + (model.table[:3] - model.table[-3:]), y
    )


_CHANGED_GRADIENT = "was changed between backward() and optimizer.step()"
_CHANGED_SETTING = "after fleet.distributed_optimizer"
_OPTIMIZERS = ("adamw", "adagrad", "nesterov", "maximize", "adam_decoupled")


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("unused_branch", _branch_build, _branch_loss),
        Scenario("branch_inside_a_module", _one_model(_BranchInside), _branch_inside_loss, kinds=("adam",)),
        Scenario("frozen_then_unfrozen", _frozen_build, _mlp_loss, before_step=_unfreeze_at_2),
        Scenario("unfrozen_after_zero_grad", _frozen_build, _mlp_loss, after_zero_grad=_unfreeze_at_2),
        Scenario("frozen_mid_training", _plain_build, _mlp_loss, before_step=_freeze_at_2),
        Scenario("add_param_group", _grow_build, _grow_loss, before_step=_add_group_at_2),
        Scenario("add_param_group_to_inner", _grow_same_build, _grow_loss, before_step=_add_group_to_inner_at_2),
        Scenario("two_optimizers", _two_build, _two_loss),
        # The parameter server has no SparseAdam: its dense tables take sparse gradients densified.
        Scenario("sparse_gradients", _sparse_build, _sparse_loss, make_batch=_sparse_batch, ps_kinds=("sgd",)),
        Scenario("tied_weights", _one_model(_Tied), _tied_loss, kinds=("adam",)),
        Scenario("backward_twice", _plain_build, _mlp_loss, train=_backward_twice, kinds=("sgd",)),
        Scenario("zero_grad_to_zeros", _branch_build, _branch_loss, train=_keep_zeros),
        Scenario("step_every_other", _plain_build, _mlp_loss, train=_step_every_other, kinds=("adam",)),
        Scenario("closure_step", _two_build, _two_loss, train=_closure_step, kinds=("sgd",)),  # and an Adam
        Scenario("backward_inputs", _plain_build, _mlp_loss, train=_backward_inputs, kinds=("sgd",)),
        Scenario("input_gradient_penalty", _plain_build, _input_penalty_loss, kinds=("adam",)),
        Scenario("lr_schedules", _groups_build, _groups_loss, train=_schedules),
        Scenario("no_grad_edits", _plain_build, _mlp_loss, train=_normalise_by_hand, kinds=("adam",)),
        Scenario("grads_from_autograd_grad", _plain_build, _mlp_loss, train=_grads_from_autograd_grad),
        Scenario("random_buffer", _one_model(_RandomBuffer), _random_buffer_loss, kinds=("sgd",)),
        Scenario("ema_step_hook", _ema_build, _mlp_loss, train=_ema_train, kinds=("adam",)),
        Scenario(
            "float64_and_int_buffers", _one_model(_Mixed), _mixed_loss, kinds=("sgd",), ps_refused="servers hold dense"
        ),
        Scenario("optimizers", _groups_build, _groups_loss, kinds=(*_OPTIMIZERS, "rmsprop"), ps_kinds=_OPTIMIZERS),
        # What the parameter server cannot do as one process would: refused at the first step, never diverging.
        Scenario("one_cycle_lr", _plain_build, _mlp_loss, train=_one_cycle, ps_refused=_CHANGED_SETTING),
        *(
            Scenario(name, _plain_build, loss, train=train, kinds=kinds, ps_refused=refused)
            for name, loss, train, kinds, refused in (
                ("hyperparameter_by_hand", _mlp_loss, _hyper_by_hand, ("sgd",), _CHANGED_SETTING),
                ("clip_grad_norm", _mlp_loss, _clip_norm, ("sgd",), _CHANGED_GRADIENT),
                ("clip_grad_value", _mlp_loss, _clip_value, ("adam",), _CHANGED_GRADIENT),
                ("gradients_by_hand", _mlp_loss, _grads_by_hand, ("sgd",), _CHANGED_GRADIENT),
                ("grad_scaler", _inf_at_2_loss, _grad_scaler, ("sgd",), _CHANGED_GRADIENT),
            )
        ),
    )
}


def snapshot(state: State) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for module_name, module in state.modules.items():
        for name, p in module.named_parameters():
            out[f"{module_name}.{name}"] = p.detach().clone()
            out[f"{module_name}.{name}.grad_is_none"] = p.grad is None
            if p.grad is not None:
                out[f"{module_name}.{name}.grad"] = p.grad.detach().to_dense().clone()
    return out


def run_step(scenario: Scenario, state: State, step: int, losses: Callable[..., torch.Tensor]) -> None:
    scenario.before_step(state, step)
    if scenario.train is not None:
        scenario.train(state, step, losses)
        return
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

        def union(micro: int = 0, step: int = step) -> torch.Tensor:
            batches = [scenario.make_batch(w, step + 10 * micro) for w in range(workers)]
            return sum(scenario.loss(state, b, w, step, workers) for w, b in enumerate(batches)) / workers

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
            lambda micro=0, step=step: scenario.loss(
                state, scenario.make_batch(rank, step + 10 * micro), rank, step, workers
            ),
        )
    return snapshot(state)


def compare(got: dict[str, Any], want: dict[str, Any], atol: float = 1e-5) -> list[str]:
    """Differences between a run and the reference, in words (empty when they agree)."""
    problems = []
    for key, value in want.items():
        if key not in got:
            problems.append(f"{key}: missing (reference has it)")
        elif isinstance(value, bool):
            if got[key] != value:
                problems.append(f"{key}: {got[key]} (reference {value})")
        elif not torch.allclose(got[key], value, atol=atol):
            problems.append(f"{key}: off by {(got[key] - value).abs().max().item():.3g}")
    return problems
