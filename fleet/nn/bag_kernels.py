"""The one-process lookup's native helpers: a batch's unique ids, and the gradient of sum-pooled bags.

Why: in a DLRM-shaped step (W6: 8 tables, bags of ~10 ids, 512 samples) ``torch.unique`` sorted
every id of every table, and ``embedding_bag``'s backward for a dense weight (the unique rows of a
sparse table are one) sorted them again and built per-bag bookkeeping: together about a third of
fleet's step beside plain ``nn.EmbeddingBag``. Both are replaced by kernels of
``fleet/sparse/csrc/bags.cpp`` that give the same values bit for bit:

- :func:`unique_inverse` is ``torch.unique(ids, sorted=True, return_inverse=True)``: one hashing
  pass over the ids, then a sort of the distinct ones only;
- :func:`sum_bags` is ``F.embedding_bag(inverse, rows, offsets, mode="sum", include_last_offset=True)``
  whose backward adds each entry's output gradient into its row in the order torch's own backward
  does (the permutation of ``inverse.sort()``), so every row's gradient is the same sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fleet.sparse.native import kernels


def unique_inverse(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.unique(ids, sorted=True, return_inverse=True)`` for 1-D int64 ``ids`` on the CPU."""
    if ids.numel() >= 1 << 30:  # beyond the kernel's 32-bit table
        return torch.unique(ids, sorted=True, return_inverse=True)
    ids = ids.contiguous()
    unique = torch.empty_like(ids)
    inverse = torch.empty_like(ids)
    k = kernels.unique_inverse(ids.numpy(), unique.numpy(), inverse.numpy())
    return unique[:k].clone(), inverse  # its own storage: the ids travel on (pushes, saves)


class _SumBags(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, inverse: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(rows, inverse, offsets)  # rows: for the gradient's shape (the leaf is alive anyway)
        return F.embedding_bag(inverse, rows, offsets, mode="sum", include_last_offset=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:  # type: ignore[override]
        rows, inverse, offsets = ctx.saved_tensors
        out = torch.zeros_like(rows, dtype=grad.dtype)
        order = inverse.sort().indices
        kernels.bag_sum_backward(
            grad.contiguous().numpy(), offsets.numpy(), inverse.numpy(), order.numpy(), out.numpy()
        )
        return out, None, None


def sum_bags(rows: torch.Tensor, inverse: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``F.embedding_bag(inverse, rows, offsets, mode="sum", include_last_offset=True)`` with a native backward.

    ``rows``: float32 ``[unique, dim]``; ``inverse``: 1-D int64, each entry's row; ``offsets``: int64
    ``[bags + 1]``, each bag's start and the end of the last one.
    """
    return _SumBags.apply(rows, inverse.contiguous(), offsets.contiguous())
