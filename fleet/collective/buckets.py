"""Gradient buckets: flat buffers of gradients that travel together in one all-reduce.

A bucket holds the gradients of a few parameters back to back, followed by one flag per
parameter: 1 when this worker has a new gradient for it since the last round, 0 when not.
The flags are summed with the gradients, so after the all-reduce every worker knows which
parameters got a gradient on any worker: those get the average (absent counting as zero);
the others keep their ``.grad`` exactly as it was (``None`` stays ``None``, so optimizers
skip them as they would in a single process).

After a round each ``.grad`` points at its slice of the reduced buffer instead of being
copied back (one pass over the gradients saved per step); with
``zero_grad(set_to_none=False)`` backward then accumulates straight into the bucket, which
``gather`` recognises.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

FIRST_BUCKET_BYTES = 1 << 20  # a small first bucket starts communication early in backward

Allocate = Callable[[int, torch.dtype, torch.device], torch.Tensor]


def zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(numel, dtype=dtype, device=device)


class Bucket:
    def __init__(self, index: int, params: list[torch.Tensor], allocate: Allocate = zeros):
        self.index = index
        self.params = params
        self.sizes = [p.numel() for p in params]
        numel = sum(self.sizes)
        self.flat = allocate(numel + len(params), params[0].dtype, params[0].device)
        self.values = self.flat[:numel]
        self.flags = self.flat[numel:]
        self.pending = 0
        self.work = None
        self.wire: torch.Tensor | None = None

    def gather(self, scale: float, changed: set[int]) -> None:
        """Copy every gradient (pre-scaled, in the same pass) and its changed flag into the buffer."""
        offset = 0
        flags = []
        for param, size in zip(self.params, self.sizes, strict=True):
            target = self.values[offset : offset + size]
            new = id(param) in changed
            grad = param.grad
            if grad is None:
                target.zero_()
            else:
                if grad.is_sparse:  # a functional sparse embedding fleet could not see coming: averaged dense
                    grad = grad.to_dense()
                if grad.data_ptr() == target.data_ptr():
                    if not new:
                        # It stays this worker's gradient unless some worker has a new one: keep it exactly.
                        param.grad = grad.clone()
                    target.mul_(scale)
                else:
                    torch.mul(grad.reshape(-1), scale, out=target)
            flags.append(1.0 if new else 0.0)
            offset += size
        self.flags.copy_(torch.tensor(flags, dtype=self.flags.dtype))

    def zero_contribution(self) -> torch.Tensor:
        """A worker with nothing to add (shadowing inside fleet.join()) sends zeros and no flags."""
        return torch.zeros_like(self.flat)

    def scatter(self) -> None:
        """Point each parameter that got a gradient on some worker at its slice of the reduced buffer."""
        offset = 0
        for param, size, flag in zip(self.params, self.sizes, self.flags.tolist(), strict=True):
            if flag > 0.5:
                view = self.values[offset : offset + size].view_as(param)
                if param.grad is None or param.grad.data_ptr() != view.data_ptr() or param.grad.is_sparse:
                    param.grad = view
            offset += size


def build(params: list[torch.Tensor], bucket_bytes: int, allocate: Allocate = zeros) -> list[Bucket]:
    """Buckets over ``params`` in reverse order (roughly the order backward produces gradients)."""
    buckets: list[Bucket] = []
    current: list[torch.Tensor] = []
    size = 0
    limit = min(FIRST_BUCKET_BYTES, bucket_bytes)
    for param in reversed(params):
        if current and (param.dtype != current[0].dtype or param.device != current[0].device):
            buckets.append(Bucket(len(buckets), current, allocate))
            current, size, limit = [], 0, bucket_bytes
        current.append(param)
        size += param.numel() * param.element_size()
        if size >= limit:
            buckets.append(Bucket(len(buckets), current, allocate))
            current, size, limit = [], 0, bucket_bytes
    if current:
        buckets.append(Bucket(len(buckets), current, allocate))
    return buckets
