"""Models built on the ``meta`` device: each worker materialises and initialises only its own shards.

FSDP2's recipe for a model larger than one worker: build it under ``torch.device("meta")``
(shapes, no storage), ``fully_shard`` it, ``to_empty`` (storage for this worker's shards only),
then initialise. :func:`materialize` does the last two steps so that the values are the ones
a whole build gives with the same random seed:

1. every module's own ``reset_parameters()`` (torch.nn's ``_reset_parameters()`` for its modules
   that have only that one, such as ``nn.MultiheadAttention``), children before parents, as the
   constructors ran them;
2. then the user's ``init``, if given, called on every module as ``model.apply(init)`` calls it
   (nanoGPT's and Hugging Face's ``_init_weights(module)``).

A random ``uniform_`` on a sharded DTensor on the CPU draws the same numbers on every worker
(each shard a copy of the first), so each call runs on *whole* tensors: the parameters the
module holds (for a reset, those of its submodules too, up to the next sharded unit) are
swapped for whole ones of the same shape, the call writes them, and each worker keeps its own
slice. Every worker draws the whole tensor from its own generator, so with the same seed on every
worker the model equals a whole build; memory goes up by one module's parameters at a time
(one block at most), never the model.

A parameter that no reset reached, with no ``init`` given, would keep whatever memory
``to_empty`` handed it: refused, naming it. Buffers are not sharded: those of modules with a
reset count as set, the rest need ``init``; every worker then takes worker 0's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from fleet.errors import FleetError

Init = Callable[[nn.Module], None]


def on_meta(tensors: list[torch.Tensor]) -> bool:
    """Whether any of ``tensors`` lives on the meta device (built without storage)."""
    return any(t.is_meta for t in tensors)


def target_device() -> torch.device:
    """Where a meta model's shards go: this process's GPU when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def materialize(model: nn.Module, device: torch.device, init: Init | None = None) -> None:
    """Give ``model``'s (sharded or whole) tensors storage on ``device`` and initialise them; see the module."""
    model.to_empty(device=device)
    done: set[int] = set()  # parameters and buffers some call wrote: full_tensor() of them is meaningful
    with torch.no_grad():
        for module in _post_order(model):
            reset = _reset_method(module)
            if reset is None:
                continue
            with _whole(_held(module, recurse=True), done):
                reset()
            done.update(id(b) for b in module.buffers())
        if init is not None:
            for module in _post_order(model):
                with _whole(_held(module, recurse=False), done):
                    init(module)
                done.update(id(b) for b in module.buffers(recurse=False))
    if init is None:
        _refuse_unset(model, done)


def _post_order(model: nn.Module) -> Iterator[nn.Module]:
    """Children before their parent, in registration order (``Module.apply``'s order, the constructors' too)."""
    for child in model.children():
        yield from _post_order(child)
    yield model


def _reset_method(module: nn.Module) -> Callable[[], None] | None:
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        return reset
    private = getattr(module, "_reset_parameters", None)  # nn.MultiheadAttention, nn.Transformer
    if callable(private) and type(module).__module__.startswith("torch.nn."):
        return private
    return None


def _is_unit(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _held(module: nn.Module, recurse: bool) -> dict[int, list[tuple[nn.Module, str]]]:
    """``id(parameter) -> [(owner, name), ...]`` for the parameters a call on ``module`` may write.

    With ``recurse``, those of its submodules too, except inside another sharded unit (a unit's own
    reset covers it; crossing units would make one call hold more than one block whole). A
    parameter held twice (tied weights) appears with both owners.
    """
    found: dict[int, list[tuple[nn.Module, str]]] = {}
    stack = [module]
    while stack:
        owner = stack.pop()
        for name, param in owner.named_parameters(recurse=False):
            found.setdefault(id(param), []).append((owner, name))
        if recurse:
            stack.extend(child for child in owner.children() if not _is_unit(child))
    return found


@contextmanager
def _whole(held: dict[int, list[tuple[nn.Module, str]]], done: set[int]) -> Iterator[None]:
    """Swap each sharded parameter of ``held`` for a whole one while the body runs; keep this worker's slice."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    swapped: list[tuple[DTensor, nn.Parameter, list[tuple[nn.Module, str]]]] = []
    for owners in held.values():
        owner, name = owners[0]
        param = getattr(owner, name)
        if not isinstance(param, DTensor):
            continue  # one worker: the module holds the whole tensor already
        value = param.full_tensor() if id(param) in done else torch.empty(param.shape, dtype=param.dtype,
                                                                          device=param.to_local().device)  # fmt: skip
        whole = nn.Parameter(value, requires_grad=param.requires_grad)
        for owner, name in owners:
            owner.register_parameter(name, whole)
        swapped.append((param, whole, owners))
    try:
        yield
    finally:
        for param, whole, owners in swapped:
            for owner, name in owners:
                owner.register_parameter(name, param)
            local = distribute_tensor(whole.detach(), param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(local.to_local())
    done.update(held)


def _refuse_unset(model: nn.Module, done: set[int]) -> None:
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, tensor in named:
            if id(tensor) not in done:
                owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
                raise FleetError(
                    f"{kind} {name!r} of the meta-device model has no initial value: its module "
                    f"{type(owner).__name__} has no reset_parameters(), so it would keep the uninitialised memory "
                    "to_empty() gives it. Give the module a reset_parameters(), or pass init=fn to "
                    "fleet.distributed_optimizer / fleet.distributed_model (called on every module as "
                    "model.apply(fn) calls it, with whole tensors); to load a checkpoint instead, pass "
                    "init=lambda module: None and call fleet.load_checkpoint before training."
                )
