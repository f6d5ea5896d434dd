"""Time spent in FSDP2's collectives, for fleet's step timing (``fleet.telemetry.timing``).

FSDP2 gathers each unit's parameters and reduce-scatters its gradients inside forward and
backward, where the wrapped optimizer cannot see them: fleetrun reported "comm 0.0 ms" and
judged the speed-up on computation alone. Each sharded module is given (through FSDP2's public
``set_custom_all_gather`` / ``set_custom_reduce_scatter``) FSDP2's default collectives wrapped in
a clock, so the time a worker spends in them, waiting for its peers included, is counted as
communication; fleet's own announcements before them (:mod:`fleet.sharding.order`) are added
by the strategy. With gloo the collectives block, so that time is the wait. With NCCL they
are queued on FSDP2's own CUDA streams and return at once: the host-side time counted is small,
and communication the GPU could not hide shows up as computation (see docs/telemetry.md).

A :class:`CommClock` keeps two running totals of the same seconds, taken apart: one per
optimizer step, one per backward pass (for scripts that never call ``step()``).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch


class CommClock:
    """Seconds spent communicating, since the last step and since the last backward."""

    def __init__(self) -> None:
        self._step_s = 0.0
        self._backward_s = 0.0
        self._scattered = 0  # gradient bytes reduce-scattered since the last backward's end

    def scattered(self, nbytes: int) -> None:
        self._scattered += nbytes

    def take_scattered(self) -> int:
        taken, self._scattered = self._scattered, 0
        return taken

    def add(self, seconds: float) -> None:
        self._step_s += seconds
        self._backward_s += seconds

    def take_step(self) -> float:
        taken, self._step_s = self._step_s, 0.0
        return taken

    def take_backward(self) -> float:
        taken, self._backward_s = self._backward_s, 0.0
        return taken


@functools.cache
def _timed_collectives() -> tuple[type, type]:
    """FSDP2's default collectives wrapped in a clock, made on first use.

    Why not at import: importing FSDP2 costs 1-2 s, and every process of every mode imports this
    module (checking a strategy imports all strategies); only sharding jobs need it.
    """
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    class TimedAllGather(DefaultAllGather):
        def __init__(self, clock: CommClock) -> None:
            super().__init__()
            self.clock = clock

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False):
            started = time.perf_counter()
            try:
                return super().__call__(output_tensor, input_tensor, group, async_op)
            finally:
                self.clock.add(time.perf_counter() - started)

    class TimedReduceScatter(DefaultReduceScatter):
        def __init__(self, clock: CommClock) -> None:
            super().__init__()
            self.clock = clock

        def __call__(
            self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False
        ):
            started = time.perf_counter()
            self.clock.scattered(input_tensor.numel() * input_tensor.element_size())
            try:
                return super().__call__(output_tensor, input_tensor, group, op, async_op)
            finally:
                self.clock.add(time.perf_counter() - started)

    return TimedAllGather, TimedReduceScatter


def time_collectives(module: Any, clock: CommClock) -> None:
    """Count the time ``module``'s (an FSDP2 module's) all-gathers and reduce-scatters take in ``clock``."""
    all_gather, reduce_scatter = _timed_collectives()
    module.set_custom_all_gather(all_gather(clock))
    module.set_custom_reduce_scatter(reduce_scatter(clock))
