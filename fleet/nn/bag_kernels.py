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

That order is an unstable sort's: ties (the entries of one row) come out in no simple order, and
float sums depend on it. Below 32768 ids, torch's CPU sort of int64 values is libstdc++'s
``std::sort`` over (value, position) pairs; the kernel's ``ties_order`` repeats that sort step for
step, in the same call as the sum. It is used only once :func:`native_order_is_torchs` has seen
torch's own ``sort()`` give the same permutations (a build with another sort, x86-simd-sort for
one, keeps ``inverse.sort()``); from 32768 ids on, where torch may switch to fbgemm's radix sort,
``inverse.sort()`` is always taken.
"""

from __future__ import annotations

import torch

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


# torch's CPU sort: below at::internal::GRAIN_SIZE values std::sort (or x86-simd-sort), from it on possibly
# fbgemm's radix sort
_TIES_LIMIT = 1 << 15
_ties_order_checked: bool | None = None


def _probe_keys() -> list[torch.Tensor]:
    """Keys whose sort permutation tells unstable sorts apart: many ties, every size class of introsort (the
    16-element runs, partitions, deep recursions), sorted, reversed and constant runs."""
    gen = torch.Generator().manual_seed(20261207)
    keys = [torch.randint(0, span, (n,), generator=gen) for n in (2, 7, 16, 17, 33, 100, 257) for span in (2, 5)]
    keys += [torch.randint(0, span, (n,), generator=gen) for n in (1000, 5120, 20000)
             for span in (3, 100, n)]  # fmt: skip
    keys += [torch.arange(3000), torch.arange(3000).flip(0), torch.zeros(3000, dtype=torch.int64)]
    keys += [torch.arange(4000) % 37, (torch.arange(4000) % 61).flip(0)]
    return keys


def native_order_is_torchs() -> bool:
    """Whether the kernel's ``ties_order`` gives torch's ``sort()`` permutations here (checked once a process)."""
    global _ties_order_checked
    if _ties_order_checked is None:
        same = True
        for keys in _probe_keys():
            mine = torch.empty_like(keys)
            kernels.ties_order(keys.numpy(), mine.numpy())
            if not torch.equal(mine, keys.sort().indices):
                same = False
                break
        _ties_order_checked = same
    return _ties_order_checked


def sum_bags_gradient(
    grad: torch.Tensor, inverse: torch.Tensor, offsets: torch.Tensor, rows: int, divisor: int = 1
) -> torch.Tensor:
    """The gradient of :func:`sum_bags` for its ``rows`` (``[rows, dim]``) given its output's gradient ``grad``
    (``[bags, dim]``): each entry's bag gradient added into its row in torch's order, bit for bit the gradient
    torch's ``embedding_bag`` backward gives; ``divisor``: then divided by it, bit for bit ``.div_(divisor)``. Why a
    function of its own: a table's holder (``fleet.collective.table_wise``) pools without autograd and asks for the
    rows' gradient at the step (the mean over its ``divisor`` workers: divided in the kernel's one pass)."""
    return _gradient(grad, inverse, offsets, rows, native_order_is_torchs(), divisor)


def _gradient(
    grad: torch.Tensor, inverse: torch.Tensor, offsets: torch.Tensor, rows: int, native: bool, divisor: int = 1
) -> torch.Tensor:
    # sum_bags_gradient once native_order_is_torchs() is known (``native``): asked once per backward, not per bag
    out = torch.empty(rows, grad.shape[1], dtype=grad.dtype)  # the kernel writes every row (zeros where no entry)
    # below the limit the kernel sorts the ties as torch would
    order = None if native and inverse.numel() < _TIES_LIMIT else inverse.sort().indices.numpy()
    kernels.bag_sum_backward(grad.contiguous().numpy(), offsets.numpy(), inverse.numpy(), order, out.numpy(), divisor)
    return out


def _sum_bags_forward(rows: torch.Tensor, inverse: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    # F.embedding_bag(mode="sum", include_last_offset=True) without its Python checks (pool made the arguments);
    # the forward-only op: the same kernel and sums, without the bookkeeping for a backward (offset2bag, bag
    # sizes) that torch.embedding_bag makes for rows requiring grad, which the native backward does not use
    return _FORWARD_ONLY(rows, inverse, offsets, False, 0, False, None, True)[0]


_FORWARD_ONLY = torch.ops.aten._embedding_bag_forward_only.default


class _SumBags(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, inverse: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(rows, inverse, offsets)  # rows: for the gradient's shape (the leaf is alive anyway)
        return _sum_bags_forward(rows, inverse, offsets)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:  # type: ignore[override]
        rows, inverse, offsets = ctx.saved_tensors
        return sum_bags_gradient(grad, inverse, offsets, rows.shape[0]), None, None


def sum_bags(rows: torch.Tensor, inverse: torch.Tensor, offsets: torch.Tensor, graph: bool = True) -> torch.Tensor:
    """``F.embedding_bag(inverse, rows, offsets, mode="sum", include_last_offset=True)`` with a native backward.

    ``rows``: float32 ``[unique, dim]``; ``inverse``: 1-D int64, each entry's row; ``offsets``: int64
    ``[bags + 1]``, each bag's start and the end of the last one. ``graph=False``: the sums only, no autograd
    node (the caller gets the rows' gradient from :func:`sum_bags_gradient`).
    """
    if not graph:
        return _sum_bags_forward(rows, inverse.contiguous(), offsets.contiguous())
    return _SumBags.apply(rows, inverse.contiguous(), offsets.contiguous())


# One table's bags for sum_bags_many: (its rows [unique, dim], each feature's (inverse, offsets [bags + 1])).
TableBags = tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]


class _SumBagsMany(torch.autograd.Function):
    """:class:`_SumBags` over every feature of several tables as ONE autograd node.

    Why: a collection's forward made one node per feature, and each costs its Python ``apply``, an engine
    dispatch and a Python ``backward`` call (W6: 8 of them a step, a fixed cost whatever the bags' size). The
    values are the same bit for bit: each feature's sums and each row gradient as :func:`sum_bags_gradient` gives
    them, a table's features added as autograd adds the gradients of one leaf used by several nodes (the last
    feature's node runs first, each earlier one is added to the running sum; an unused output adds nothing)."""

    @staticmethod
    def forward(ctx, plan: tuple, *rows: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.set_materialize_grads(False)
        # each table's rows (for their number), its features' (inverse, offsets), and how many features it has
        counts = torch.tensor([len(bags) for bags in plan], dtype=torch.int64)
        ctx.save_for_backward(counts, *rows, *(t for bags in plan for pair in bags for t in pair))
        return tuple(_sum_bags_forward(r, inverse, offsets) for r, bags in zip(rows, plan, strict=True)
                     for inverse, offsets in bags)  # fmt: skip

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        counts, *saved = ctx.saved_tensors
        counts = counts.tolist()
        rows, pairs = saved[: len(counts)], saved[len(counts) :]
        out: list[torch.Tensor | None] = [None]
        at = 0
        native = native_order_is_torchs()
        for t, (n, size) in enumerate(zip(counts, (r.shape[0] for r in rows), strict=True)):
            bags = [(pairs[2 * f], pairs[2 * f + 1]) for f in range(at, at + n)]
            mine, at = grads[at : at + n], at + n
            total = None
            if ctx.needs_input_grad[1 + t]:
                for (inverse, offsets), grad in zip(reversed(bags), reversed(mine), strict=True):
                    if grad is None:
                        continue
                    part = _gradient(grad, inverse, offsets, size, native)
                    total = part if total is None else total.add_(part)
            out.append(total)
        return tuple(out)


def sum_bags_many(tables: list[TableBags]) -> list[torch.Tensor]:
    """:func:`sum_bags` of every feature of every table (``tables``: each one's rows and its features' ``(inverse,
    offsets)``), feature after feature, with one autograd node for all: the same values and row gradients."""
    plan = tuple(tuple((inverse.contiguous(), offsets.contiguous()) for inverse, offsets in bags) for _, bags in tables)
    return list(_SumBagsMany.apply(plan, *(rows for rows, _ in tables)))
