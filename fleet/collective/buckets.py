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

import torch

FIRST_BUCKET_BYTES = 1 << 20  # a small first bucket starts communication early in backward

Source = torch.Tensor | None


class Bucket:
    """``flat`` (the reduced result, which ``.grad`` points into) is attached by the transport
    before the bucket's first round; ``send`` is where this worker's gradients go, the result
    buffer itself unless the transport sums elsewhere (shared memory)."""

    def __init__(self, index: int, params: list[torch.Tensor]):
        self.index = index
        self.params = params
        self.sizes = [p.numel() for p in params]
        self.numel = sum(self.sizes) + len(params)  # the gradients, then one flag per parameter
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.flat: torch.Tensor | None = None
        self.send: torch.Tensor | None = None

    def attach(self, flat: torch.Tensor, send: torch.Tensor | None = None) -> None:
        values = len(self.params)
        self.flat = flat
        self.values = flat[: self.numel - values]
        self.flags = flat[self.numel - values :]
        self.send = flat if send is None else send

    def gather(self, scale: float, changed: set[int], keep: tuple[int, int] = (0, 0)) -> list[Source]:
        """Copy every gradient (pre-scaled, in the same pass) and its changed flag into the send buffer.

        ``keep``: a ``[lo, hi)`` range of the bucket this worker sums itself, straight from its
        gradients, so its values are not copied. Returns, per parameter, where its gradient is
        (flat, dense; None when it has none), for :meth:`own`.
        """
        assert self.send is not None, "the transport attaches a bucket's buffers before its first round"
        offset = 0
        flags, sources = [], []
        for param, size in zip(self.params, self.sizes, strict=True):
            target = self.send[offset : offset + size]
            new = id(param) in changed
            grad = param.grad
            source = None
            if grad is None:
                _copy(None, target, offset, keep, scale)
            else:
                if grad.is_sparse:  # a functional sparse embedding fleet could not see coming: averaged dense
                    grad = grad.to_dense()
                if grad.data_ptr() == self.values[offset : offset + size].data_ptr() and not new:
                    # It stays this worker's gradient unless some worker has a new one, and the
                    # reduction is about to overwrite the buffer it lives in: keep it exactly.
                    param.grad = grad = grad.clone()
                source = grad.reshape(-1)
                if grad.data_ptr() == target.data_ptr():
                    target.mul_(scale)
                else:
                    _copy(source, target, offset, keep, scale)
            sources.append(source)
            flags.append(1.0 if new else 0.0)
            offset += size
        self.send[offset:].copy_(torch.tensor(flags, dtype=self.dtype))
        return sources

    def own(self, sources: list[Source], lo: int, hi: int, scale: float) -> list[tuple[int, int, Source, float]]:
        """``(a, b, source, factor)`` covering ``[lo, hi)``: this worker's contribution there is
        ``source * factor``: the gradient slices :meth:`gather` kept back (None: zero), and the
        flags at the end of the bucket, which are always in the send buffer."""
        pieces: list[tuple[int, int, Source, float]] = []
        offset = 0
        for size, source in zip(self.sizes, sources, strict=True):
            a, b = max(lo, offset), min(hi, offset + size)
            if a < b:
                pieces.append((a, b, source[a - offset : b - offset] if source is not None else None, scale))
            offset += size
        if hi > offset:
            a = max(lo, offset)
            pieces.append((a, hi, self.send[a:hi], 1.0))
        return pieces

    def scatter(self) -> None:
        """Point each parameter that got a gradient on some worker at its slice of the reduced buffer."""
        offset = 0
        for param, size, flag in zip(self.params, self.sizes, self.flags.tolist(), strict=True):
            if flag > 0.5:
                view = self.values[offset : offset + size].view_as(param)
                if param.grad is None or param.grad.data_ptr() != view.data_ptr() or param.grad.is_sparse:
                    param.grad = view
            offset += size


def _copy(source: torch.Tensor | None, target: torch.Tensor, offset: int, keep: tuple[int, int], scale: float) -> None:
    """``target = source * scale`` (zeros for None), except the part of it inside ``keep``."""
    size = target.numel()
    a, b = max(keep[0] - offset, 0), min(keep[1] - offset, size)
    for lo, hi in ((0, size),) if a >= b else ((0, a), (b, size)):
        if lo < hi:
            if source is None:
                target[lo:hi].zero_()
            else:
                torch.mul(source[lo:hi], scale, out=target[lo:hi])


def build(params: list[torch.Tensor], bucket_bytes: int) -> list[Bucket]:
    """Buckets over ``params`` in reverse order (roughly the order backward produces gradients)."""
    buckets: list[Bucket] = []
    current: list[torch.Tensor] = []
    size = 0
    limit = min(FIRST_BUCKET_BYTES, bucket_bytes)
    for param in reversed(params):
        if current and (param.dtype != current[0].dtype or param.device != current[0].device):
            buckets.append(Bucket(len(buckets), current))
            current, size, limit = [], 0, bucket_bytes
        current.append(param)
        size += param.numel() * param.element_size()
        if size >= limit:
            buckets.append(Bucket(len(buckets), current))
            current, size, limit = [], 0, bucket_bytes
    if current:
        buckets.append(Bucket(len(buckets), current))
    return buckets
