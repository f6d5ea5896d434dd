"""Sparse gradients (``nn.Embedding``/``EmbeddingBag`` with ``sparse=True``), averaged as sparse tensors.

A small all-reduce of one flag per sparse parameter first says which ones have a new gradient
on any worker; those (only those) are then summed: gloo all-reduces sparse CPU tensors itself
(gathering and summing indices and values); for other devices (NCCL has no sparse
all-reduce) the indices and values are all-gathered and coalesced here. A parameter that no
worker has a new gradient for keeps its ``.grad``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def start(
    params: list[torch.Tensor], changed: list[bool], scale: float, group: Any, wait: Callable[[Any, str], None]
) -> list[tuple[torch.Tensor, Any, Any]]:
    """``(param, result, work)`` for each parameter to average: once ``work`` is done (None: already),
    ``result`` is its averaged gradient. Issues no collective at all without sparse parameters."""
    if not params:
        return []
    flags = torch.tensor([1.0 if c else 0.0 for c in changed])
    if group is not None:
        wait(dist.all_reduce(flags, group=group, async_op=True), "agreeing on the sparse gradients")
    started = []
    for param, flag in zip(params, flags.tolist(), strict=True):
        if flag < 0.5:
            continue  # no worker has a new gradient: .grad stays as it is
        contribution = own(param).mul_(scale) if param.grad is not None else empty(param)
        if group is None:
            started.append((param, contribution, None))
        elif contribution.device.type == "cpu":
            started.append((param, contribution, dist.all_reduce(contribution, group=group, async_op=True)))
        else:
            started.append((param, gather_sum(contribution, group), None))
    return started


def own(param: torch.Tensor) -> torch.Tensor:
    """This worker's gradient of ``param`` as a coalesced sparse tensor (a copy)."""
    grad = param.grad
    assert grad is not None
    if not grad.is_sparse:
        grad = grad.to_sparse(sparse_dim=1)
    return grad.coalesce().clone()


def empty(param: torch.Tensor) -> torch.Tensor:
    """A sparse gradient with no rows, for a worker that has none."""
    indices = torch.empty(1, 0, dtype=torch.int64, device=param.device)
    values = torch.empty(0, *param.shape[1:], dtype=param.dtype, device=param.device)
    return torch.sparse_coo_tensor(indices, values, param.shape)


def gather_sum(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum over the group of a coalesced sparse tensor, by all-gathering its rows (any backend)."""
    world = dist.get_world_size(group)
    indices, values = tensor._indices()[0], tensor._values()
    count = torch.tensor([indices.numel()], dtype=torch.int64, device=indices.device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    sizes = [int(c.item()) for c in counts]
    longest = max(sizes)
    padded_indices = torch.zeros(longest, dtype=indices.dtype, device=indices.device)
    padded_indices[: indices.numel()] = indices
    padded_values = torch.zeros(longest, *values.shape[1:], dtype=values.dtype, device=values.device)
    padded_values[: values.shape[0]] = values
    all_indices = [torch.empty_like(padded_indices) for _ in range(world)]
    all_values = [torch.empty_like(padded_values) for _ in range(world)]
    dist.all_gather(all_indices, padded_indices, group=group)
    dist.all_gather(all_values, padded_values, group=group)
    merged_indices = torch.cat([t[:n] for t, n in zip(all_indices, sizes, strict=True)]).unsqueeze(0)
    merged_values = torch.cat([t[:n] for t, n in zip(all_values, sizes, strict=True)])
    return torch.sparse_coo_tensor(merged_indices, merged_values, tensor.shape).coalesce()


def gather_rows(
    ids: torch.Tensor, grads: torch.Tensor, group: Any, active: int, averaged: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``fleet.nn.SparseEmbedding`` step's (ids, row gradients) of every worker, merged (ids may repeat);
    gradients divided by the ``active`` workers, so that every worker applies the same averaged update.
    Only the first ``averaged`` columns are divided (the rest, such as clicks, are summed)."""
    world = dist.get_world_size(group)
    dim = grads.shape[1]
    count = torch.tensor([ids.numel()], dtype=torch.int64)
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    sizes = [int(c.item()) for c in counts]
    longest = max(sizes)
    padded_ids = torch.zeros(longest, dtype=torch.int64)
    padded_ids[: ids.numel()] = ids
    padded = torch.zeros(longest, dim)
    padded[: ids.numel()] = grads
    all_ids = [torch.empty_like(padded_ids) for _ in range(world)]
    all_grads = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(all_ids, padded_ids, group=group)
    dist.all_gather(all_grads, padded, group=group)
    merged_ids = torch.cat([t[:n] for t, n in zip(all_ids, sizes, strict=True)])
    merged = torch.cat([t[:n] for t, n in zip(all_grads, sizes, strict=True)])
    merged[:, :averaged].div_(active)
    return merged_ids, merged
