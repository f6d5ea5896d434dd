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

import itertools

import torch

FIRST_BUCKET_BYTES = 1 << 20  # a small first bucket starts communication early in backward
# Up to this size a bucket's gradients are copied whole and scaled in one pass (see Bucket.gather): the
# calls saved outweigh the bytes copied twice; above it each gradient is scaled as it is copied.
SMALL_BUCKET_BYTES = 256 << 10

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
        # Each parameter's slices, made once: slicing costs microseconds per tensor, per round, per parameter.
        self._offsets = [0, *itertools.accumulate(self.sizes)][:values]
        self._targets = [self.send[o : o + n] for o, n in zip(self._offsets, self.sizes, strict=True)]
        self._slots = [self.values[o : o + n] for o, n in zip(self._offsets, self.sizes, strict=True)]
        self._slot_ptrs = [slot.data_ptr() for slot in self._slots]
        self._target_ptrs = [target.data_ptr() for target in self._targets]
        self._views = [slot.view_as(p) for slot, p in zip(self._slots, self.params, strict=True)]
        self._small = self.numel * self.flat.element_size() <= SMALL_BUCKET_BYTES
        self._plans: dict[tuple[int, int], list] = {}
        self._owned: dict[tuple[int, int], tuple] = {}
        self._copies: dict[tuple[int, int], list] = {}
        self._send_flags = self.send[self.numel - values :]

    def gather(self, scale: float, changed: set[int], keep: tuple[int, int] = (0, 0)) -> list[Source]:
        """Copy every gradient (pre-scaled, in the same pass) and its changed flag into the send buffer.

        ``keep``: a ``[lo, hi)`` range of the bucket this worker sums itself, straight from its
        gradients, so its values are not copied. Returns, per parameter, where its gradient is
        (flat, dense; None when it has none), for :meth:`own`.
        """
        assert self.send is not None, "the transport attaches a bucket's buffers before its first round"
        flags, sources, in_place = [], [], []
        whole = self._small  # one copy of every gradient, then one scaling pass, while none needs another path
        for param, size, slot_ptr, target_ptr in zip(
            self.params, self.sizes, self._slot_ptrs, self._target_ptrs, strict=True
        ):
            new = id(param) in changed
            grad = param.grad
            source = None
            living = False  # the gradient is this very slice of the send buffer (backward accumulated into it)
            if grad is None:
                whole = whole and size == 0  # an empty one (a sharded table's placeholder) adds nothing
            else:
                if grad.is_sparse:  # a functional sparse embedding fleet could not see coming: averaged dense
                    grad = grad.to_dense()
                if not new and grad.data_ptr() == slot_ptr:
                    # It stays this worker's gradient unless some worker has a new one, and the
                    # reduction is about to overwrite the buffer it lives in: keep it exactly.
                    param.grad = grad = grad.clone()
                source = grad.reshape(-1)
                living = grad.data_ptr() == target_ptr
                whole = whole and not living
            sources.append(source)
            in_place.append(living)
            flags.append(1.0 if new else 0.0)
        if whole:
            # The same products as one multiplication per gradient (each element is source * scale, exactly):
            # for a small bucket, two passes in two calls per range cost less than a call or three per parameter.
            for lo, hi, parts in self._ranges(keep):
                pieces = [sources[i] if whole_part else sources[i][a:b] for i, a, b, whole_part in parts]
                torch.cat(pieces, out=self.send[lo:hi]).mul_(scale)
        else:
            for source, living, target, pieces in zip(
                sources, in_place, self._targets, self._pieces(keep), strict=True
            ):
                if living:
                    target.mul_(scale)
                elif source is None:
                    for _, _, view, _ in pieces:
                        view.zero_()
                else:
                    for lo, hi, view, whole in pieces:
                        torch.mul(source if whole else source[lo:hi], scale, out=view)
        if all(flags):  # the usual round: every parameter has a new gradient (one fill, not a tensor made and copied)
            self._send_flags.fill_(1.0)
        else:
            self._send_flags.copy_(torch.tensor(flags, dtype=self.dtype))
        return sources

    def _pieces(self, keep: tuple[int, int]) -> list[list[tuple[int, int, torch.Tensor, bool]]]:
        """Per parameter, the pieces ``(lo, hi, its send-buffer slice, whole)`` of its gradient outside ``keep``
        (``whole``: the piece is all of it), each copied as ``source[lo:hi] * scale``; sliced once per ``keep``
        (a worker's chunk, the same every round): slicing costs microseconds per tensor, per round, per parameter."""
        cached = self._copies.get(keep)
        if cached is None:
            cached = self._copies[keep] = [
                [(lo, hi, target[lo:hi], lo == 0 and hi == size) for lo, hi in _outside(keep, offset, size)]
                for target, offset, size in zip(self._targets, self._offsets, self.sizes, strict=True)
            ]
        return cached

    def _ranges(self, keep: tuple[int, int]) -> list[tuple[int, int, list[tuple[int, int, int, bool]]]]:
        """The gradients' part of the send buffer outside ``keep``, as contiguous ranges ``(lo, hi, parts)``,
        each part ``(i, a, b, whole)``: ``[a, b)`` of parameter ``i``'s gradient (all of it when ``whole``).
        The same ``keep`` comes back every round (a worker's chunk), so the ranges are kept."""
        cached = self._plans.get(keep)
        if cached is not None:
            return cached
        values = self.numel - len(self.params)
        k0, k1 = min(keep[0], values), min(keep[1], values)
        spans = [(0, values)] if k0 >= k1 else [(0, k0), (k1, values)]
        plan = []
        for lo, hi in spans:
            parts = []
            for i, (offset, size) in enumerate(zip(self._offsets, self.sizes, strict=True)):
                a, b = max(lo, offset) - offset, min(hi, offset + size) - offset
                if a < b:
                    parts.append((i, a, b, a == 0 and b == size))
            if parts:
                plan.append((lo, hi, parts))
        self._plans[keep] = plan
        return plan

    def own(self, sources: list[Source], lo: int, hi: int, scale: float) -> list[tuple[int, int, Source, float]]:
        """``(a, b, source, factor)`` covering ``[lo, hi)``: this worker's contribution there is
        ``source * factor``: the gradient slices :meth:`gather` kept back (None: zero), and the
        flags at the end of the bucket, which are always in the send buffer."""
        plan = self._owned.get((lo, hi))
        if plan is None:  # the same chunk every round: where it cuts the gradients is worked out once
            plan = self._owned[(lo, hi)] = self._plan_own(lo, hi)
        parts, flags = plan
        pieces: list[tuple[int, int, Source, float]] = []
        for i, a, b, whole in parts:
            source = sources[i]
            if source is not None and not whole:
                offset = self._offsets[i]
                source = source[a - offset : b - offset]
            pieces.append((a, b, source, scale))
        if flags is not None:
            pieces.append(flags)
        return pieces

    def _plan_own(self, lo: int, hi: int) -> tuple[list[tuple[int, int, int, bool]], tuple | None]:
        parts = []
        for i, (offset, size) in enumerate(zip(self._offsets, self.sizes, strict=True)):
            a, b = max(lo, offset), min(hi, offset + size)
            if a < b:
                parts.append((i, a, b, a == offset and b == offset + size))
        values = self.numel - len(self.params)
        flags = None
        if hi > values:
            a = max(lo, values)
            flags = (a, hi, self.send[a:hi], 1.0)
        return parts, flags

    def scatter(self) -> None:
        """Point each parameter that got a gradient on some worker at its slice of the reduced buffer."""
        for i, (param, ptr, flag) in enumerate(zip(self.params, self._slot_ptrs, self.flags.tolist(), strict=True)):
            if flag > 0.5:
                grad = param.grad
                if grad is None or grad.is_sparse or grad.data_ptr() != ptr:
                    view = self._views[i]
                    if view.shape != param.shape:  # the parameter was reshaped in place (param.data = ...)
                        view = self._views[i] = self._slots[i].view_as(param)
                    param.grad = view


def _outside(keep: tuple[int, int], offset: int, size: int) -> list[tuple[int, int]]:
    """The non-empty ranges of ``[0, size)`` (a gradient at ``offset`` in its bucket) outside ``keep``."""
    a, b = max(keep[0] - offset, 0), min(keep[1] - offset, size)
    return [(lo, hi) for lo, hi in (((0, size),) if a >= b else ((0, a), (b, size))) if lo < hi]


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
