"""Make every worker start identical: check shapes, broadcast parameters and optimizer state.

Structure (shapes, state layout) travels as JSON in uint8 tensors, never pickled.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from fleet.errors import ModelMismatchError


def _all_gather_json(value: Any, group: dist.ProcessGroup) -> list[Any]:
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


def _broadcast_json(value: Any, group: dist.ProcessGroup) -> Any:
    """Rank 0's value on every rank."""
    src = dist.get_global_rank(group, 0)
    payload = json.dumps(value).encode() if dist.get_rank(group) == 0 else b""
    length = torch.tensor([len(payload)], dtype=torch.int64)
    dist.broadcast(length, src=src, group=group)
    data = torch.zeros(int(length.item()), dtype=torch.uint8)
    if payload:
        data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(data, src=src, group=group)
    return json.loads(bytes(data.tolist()))


def check_same_shapes(params: list[torch.Tensor], names: list[str], group: dist.ProcessGroup) -> None:
    """Raise ModelMismatchError on every worker, naming the first parameter that differs."""
    mine = [[name, list(p.shape), str(p.dtype)] for name, p in zip(names, params, strict=True)]
    everyone = _all_gather_json(mine, group)
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


def broadcast_tensors(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Overwrite ``tensors`` with worker 0's values, one flat broadcast per dtype and device."""
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for same in _by_kind(tensors):
            flat = _flatten_dense_tensors([t.detach() for t in same])
            dist.broadcast(flat, src=src, group=group)
            for tensor, value in zip(same, _unflatten_dense_tensors(flat, same), strict=True):
                tensor.copy_(value)


def average_tensors(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Replace ``tensors`` with their mean over the group (local SGD)."""
    world = dist.get_world_size(group)
    with torch.no_grad():
        for same in _by_kind(tensors):
            flat = _flatten_dense_tensors([t.detach() for t in same])
            flat.div_(world)
            dist.all_reduce(flat, group=group)
            for tensor, value in zip(same, _unflatten_dense_tensors(flat, same), strict=True):
                tensor.copy_(value)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, group: dist.ProcessGroup) -> None:
    """Give every worker worker 0's optimizer state (momentum buffers, Adam moments, step counts)."""
    is_source = dist.get_rank(group) == 0
    full = optimizer.state_dict()
    layout: dict[str, dict[str, Any]] = {}
    if is_source:
        for index, entry in full["state"].items():
            layout[str(index)] = {
                key: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
                if torch.is_tensor(v)
                else {"value": v}
                for key, v in entry.items()
            }
    layout = _broadcast_json(layout, group)
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
    broadcast_tensors(tensors, group)
    if not is_source:
        full["state"] = state
        optimizer.load_state_dict(full)
