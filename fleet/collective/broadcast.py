"""Make every worker start identical: check shapes, broadcast parameters and optimizer state.

Structure (shapes, state layout) travels as JSON in uint8 tensors, never pickled.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from fleet.errors import ModelMismatchError


def all_gather_json(value: Any, group: dist.ProcessGroup) -> list[Any]:
    """Every worker's JSON-able ``value``, by rank."""
    data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
    world = dist.get_world_size(group)
    length = torch.tensor([data.numel()], dtype=torch.int64)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    longest = int(max(n.item() for n in lengths))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    gathered = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return [json.loads(bytes(g[: int(n.item())].tolist())) for g, n in zip(gathered, lengths, strict=True)]


def _broadcast_json(value: Any, group: dist.ProcessGroup, source: int = 0) -> Any:
    """Rank ``source``'s value on every rank."""
    src = dist.get_global_rank(group, source)
    payload = json.dumps(value).encode() if dist.get_rank(group) == source else b""
    length = torch.tensor([len(payload)], dtype=torch.int64)
    dist.broadcast(length, src=src, group=group)
    data = torch.zeros(int(length.item()), dtype=torch.uint8)
    if payload:
        data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(data, src=src, group=group)
    return json.loads(bytes(data.tolist()))


def check_same_shapes(params: list[torch.Tensor], names: Callable[[], list[str]], group: dist.ProcessGroup) -> None:
    """Raise ModelMismatchError on every worker, naming the first parameter that differs.

    ``names`` is called (on every worker) only when the shapes differ: finding a parameter's
    name may cost a scan of the live modules.
    """
    shapes = [[list(p.shape), str(p.dtype)] for p in params]
    if all(theirs == shapes for theirs in all_gather_json(shapes, group)):
        return
    mine = [[name, *shape] for name, shape in zip(names(), shapes, strict=True)]
    everyone = all_gather_json(mine, group)
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        if theirs == reference:
            continue
        for position, (a, b) in enumerate(zip(reference, theirs, strict=False)):
            if a[1:] != b[1:]:
                raise ModelMismatchError(
                    f"Workers hold different models: parameter {position} ({b[0]!r}) has shape {b[1]} {b[2]} "
                    f"on worker {rank} but {a[1]} {a[2]} on worker 0 ({a[0]!r}). Every worker must build the same "
                    "model before fleet.distributed_optimizer."
                )
        raise ModelMismatchError(
            f"Workers hold different models: worker {rank} has {len(theirs)} parameters to optimize, "
            f"worker 0 has {len(reference)}. Every worker must build the same model and optimizer."
        )


def _by_kind(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Tensors grouped by dtype and device: one flat buffer (one collective) per group."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    return list(groups.values())


def broadcast_tensors(tensors: list[torch.Tensor], group: dist.ProcessGroup, source: int = 0) -> None:
    """Overwrite ``tensors`` with worker ``source``'s values, one flat broadcast per dtype and device."""
    src = dist.get_global_rank(group, source)
    with torch.no_grad():
        for same in _by_kind(tensors):
            flat = _flatten_dense_tensors([t.detach() for t in same])
            dist.broadcast(flat, src=src, group=group)
            for tensor, value in zip(same, _unflatten_dense_tensors(flat, same), strict=True):
                tensor.copy_(value)


def average_tensors(
    tensors: list[torch.Tensor], group: dist.ProcessGroup, active: int, contribute: bool = True
) -> None:
    """Replace ``tensors`` with their mean over the ``active`` workers (local SGD).

    A worker shadowing inside fleet.join() takes part with ``contribute=False``: it adds
    nothing and keeps its own values.
    """
    with torch.no_grad():
        for same in _by_kind(tensors):
            flat = _flatten_dense_tensors([t.detach() for t in same])
            if contribute:
                flat.div_(active)
            else:
                flat.zero_()
            dist.all_reduce(flat, group=group)
            if contribute:
                for tensor, value in zip(same, _unflatten_dense_tensors(flat, same), strict=True):
                    tensor.copy_(value)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, group: dist.ProcessGroup, source: int = 0) -> None:
    """Give every worker worker ``source``'s optimizer state (momentum buffers, Adam moments, step counts)
    and hyper-parameters (learning rates an LR scheduler moved)."""
    is_source = dist.get_rank(group) == source
    full = optimizer.state_dict()
    hyper = _broadcast_json(_hyper_parameters(full), group, source)
    layout: dict[str, dict[str, Any]] = {}
    if is_source:
        for index, entry in full["state"].items():
            layout[str(index)] = {
                key: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
                if torch.is_tensor(v)
                else {"value": v}
                for key, v in entry.items()
            }
    layout = _broadcast_json(layout, group, source)
    if not is_source and hyper != _hyper_parameters(full):
        for group_state, values in zip(full["param_groups"], hyper, strict=True):
            for key, value in values.items():
                if torch.is_tensor(group_state.get(key)):
                    group_state[key] = torch.full_like(group_state[key], value)
                else:
                    group_state[key] = tuple(value) if isinstance(group_state.get(key), tuple) else value
        if not layout and not full["state"]:
            optimizer.load_state_dict(full)
    if not layout and not full["state"]:
        return
    state: dict[int, dict[str, Any]] = {}
    tensors: list[torch.Tensor] = []
    for index, entry in layout.items():
        built: dict[str, Any] = {}
        for key, spec in entry.items():
            if "value" in spec:
                built[key] = spec["value"]
            else:
                own = full["state"].get(int(index), {}).get(key) if is_source else None
                tensor = own if own is not None else torch.zeros(spec["shape"], dtype=getattr(torch, spec["dtype"]))
                built[key] = tensor
                tensors.append(tensor)
        state[int(index)] = built
    broadcast_tensors(tensors, group, source)
    if not is_source:
        full["state"] = state
        optimizer.load_state_dict(full)


def _hyper_parameters(state_dict: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON-able hyper-parameters of each param group (lr, momentum, betas, ...)."""
    out = []
    for group in state_dict["param_groups"]:
        values = {}
        for key, value in group.items():
            if key == "params":
                continue
            if torch.is_tensor(value) and value.numel() == 1:
                value = value.item()
            if isinstance(value, bool | int | float | str | type(None)) or (
                isinstance(value, tuple | list) and all(isinstance(v, int | float) for v in value)
            ):
                values[key] = list(value) if isinstance(value, tuple) else value
        out.append(values)
    return out
