"""Gradient buckets all-reduced from gradient hooks, overlapping backward computation.

Parameters are grouped, in reverse registration order (roughly the order backward
produces their gradients), into flat buckets of about ``bucket_mb``. When every
gradient of a bucket has been accumulated, the bucket is averaged asynchronously.
Buckets are launched strictly in index order on every worker, because gloo and NCCL
match collectives by issue order: a different order on two workers would pair the
wrong tensors. A callback queued on the autograd engine waits for all buckets at the
end of backward and writes the averaged gradients back, so after ``backward()``
returns every ``.grad`` holds the average, exactly as with DDP, and gradient
clipping or GradScaler.unscale_ see reduced gradients.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from fleet.collective.compression import Compressor
from fleet.errors import PeerError

FIRST_BUCKET_BYTES = 1 << 20  # a small first bucket starts communication early in backward


class _Bucket:
    def __init__(self, index: int, params: list[torch.Tensor]):
        self.index = index
        self.params = params
        self.sizes = [p.numel() for p in params]
        self.flat = torch.zeros(sum(self.sizes), dtype=params[0].dtype, device=params[0].device)
        self.pending = len(params)
        self.work: dist.Work | None = None
        self.wire: torch.Tensor | None = None

    def gather(self, scale: float) -> None:
        """Copy (and pre-scale, in the same pass) every gradient into the flat buffer."""
        offset = 0
        for param, size in zip(self.params, self.sizes, strict=True):
            target = self.flat[offset : offset + size]
            grad = param.grad
            if grad is None:
                target.zero_()
            elif grad.data_ptr() == target.data_ptr():
                target.mul_(scale)  # the gradient already lives in the bucket (see scatter)
            else:
                torch.mul(grad.reshape(-1), scale, out=target)
            offset += size

    def scatter(self) -> None:
        """Point each ``.grad`` at its slice of the reduced buffer instead of copying back.

        Saves a pass over every gradient per step. With ``zero_grad(set_to_none=False)``
        backward then accumulates straight into the bucket, which gather recognises.
        """
        offset = 0
        for param, size in zip(self.params, self.sizes, strict=True):
            view = self.flat[offset : offset + size].view_as(param)
            if param.grad is None or param.grad.data_ptr() != view.data_ptr():
                param.grad = view
            offset += size


class GradientBuckets:
    """Averages gradients over ``group`` while backward runs.

    ``scale`` multiplies gradients before the sum (1 / (workers x accumulation steps)), so the
    all-reduce sums already-averaged values: fp16 compression then cannot overflow on the sum.
    """

    def __init__(
        self,
        params: list[torch.Tensor],
        group: dist.ProcessGroup | None,
        world_size: int,
        bucket_bytes: int,
        compressor: Compressor,
        timeout_s: float,
        diagnose: Callable[[], str] | None = None,
    ):
        self.group = group
        self.world_size = world_size
        self.compressor = compressor
        self.timeout = timedelta(seconds=timeout_s)
        self.diagnose = diagnose
        self.enabled = True
        self.scale = 1.0 / world_size
        self.buckets = self._build(params, bucket_bytes)
        self._where = {id(p): b for b in self.buckets for p in b.params}
        self._handles = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready) for b in self.buckets for p in b.params
        ]
        self._in_backward = False
        self._next = 0
        self.comm_wait_s = 0.0

    @staticmethod
    def _build(params: list[torch.Tensor], bucket_bytes: int) -> list[_Bucket]:
        buckets: list[_Bucket] = []
        current: list[torch.Tensor] = []
        size = 0
        limit = min(FIRST_BUCKET_BYTES, bucket_bytes)
        for param in reversed([p for p in params if p.requires_grad]):
            if current and (param.dtype != current[0].dtype or param.device != current[0].device):
                buckets.append(_Bucket(len(buckets), current))
                current, size, limit = [], 0, bucket_bytes
            current.append(param)
            size += param.numel() * param.element_size()
            if size >= limit:
                buckets.append(_Bucket(len(buckets), current))
                current, size, limit = [], 0, bucket_bytes
        if current:
            buckets.append(_Bucket(len(buckets), current))
        return buckets

    def remove(self) -> None:
        """Unhook from the parameters (after stop_worker their backward no longer talks to the group)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # --- during backward ---------------------------------------------------------

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self.enabled:
            return
        if not self._in_backward:
            self._in_backward = True
            self._next = 0
            for bucket in self.buckets:
                bucket.pending = len(bucket.params)
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        bucket = self._where[id(param)]
        bucket.pending -= 1
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, bucket: _Bucket) -> None:
        bucket.gather(self.scale)
        if self.group is None:
            return
        bucket.wire = self.compressor.compress(bucket.flat)
        bucket.work = dist.all_reduce(bucket.wire, group=self.group, async_op=True)

    def _finish(self) -> None:
        """End of backward: launch what unused parameters held back, wait for all, write back."""
        self._in_backward = False
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
            self._next += 1
        started = time.perf_counter()
        for bucket in self.buckets:
            if bucket.work is not None:
                try:
                    bucket.work.wait(self.timeout)
                except RuntimeError as error:
                    diagnosis = self.diagnose() if self.diagnose is not None else None
                    raise PeerError.from_collective(
                        f"all-reduce of gradient bucket {bucket.index}", error, diagnosis
                    ) from None
                self.compressor.decompress(bucket.wire, bucket.flat)
                bucket.work = bucket.wire = None
            bucket.scatter()
        self.comm_wait_s += time.perf_counter() - started
