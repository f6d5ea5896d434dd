"""The process group's all-reduce (gloo for CPU tensors, NCCL for CUDA): every job can use it.

Optionally compressed to fp16/bf16 on the wire (:mod:`fleet.collective.transports.compression`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from fleet.collective.buckets import Bucket
from fleet.collective.shm import Channel
from fleet.collective.transports.base import Setup, Transport
from fleet.collective.transports.compression import Compressor, make_compressor


class _Sent:
    """An all-reduce in flight, and the tensor it travels in (the bucket itself, or its compressed copy)."""

    def __init__(self, work: Any, wire: torch.Tensor | None):
        self.work = work
        self.wire = wire


class ProcessGroupTransport:
    """A bucket's all-reduce over the process group (``group`` None: one worker, nothing to send)."""

    option: ClassVar[str | None] = None  # the last resort: never switched off

    def __init__(self, group: Any, compressor: Compressor):
        self.group = group
        self.compressor = compressor

    @classmethod
    def enabled(cls, setup: Setup) -> bool:
        return True

    @classmethod
    def create(cls, setup: Setup, fallback: Transport | None) -> ProcessGroupTransport:
        return cls(setup.group, make_compressor(setup.compression))

    def header_channel(self) -> Channel | None:
        return None

    def bind(self, buckets: list[Bucket]) -> None:
        for bucket in buckets:
            if bucket.flat is None:
                bucket.attach(torch.zeros(bucket.numel, dtype=bucket.dtype, device=bucket.device))

    def launch_early(self) -> bool:
        return True  # the all-reduce travels while backward goes on

    def launch(self, bucket: Bucket, scale: float, changed: set[int]) -> Any:
        bucket.gather(scale, changed)
        if self.group is None:
            return None
        wire = self.compressor.compress(bucket.flat)
        return _Sent(dist.all_reduce(wire, group=self.group, async_op=True), wire)

    def start_empty(self, bucket: Bucket) -> Any:
        zeros = torch.zeros(bucket.numel, dtype=bucket.dtype, device=bucket.device)
        # Nothing comes back into the bucket: a shadow keeps its gradients as they are.
        return _Sent(dist.all_reduce(self.compressor.compress(zeros), group=self.group, async_op=True), None)

    def wait(self, bucket: Bucket, work: Any, timeout: timedelta) -> None:
        work.work.wait(timeout)
        if work.wire is not None:
            self.compressor.decompress(work.wire, bucket.flat)

    def close(self) -> None:
        pass
