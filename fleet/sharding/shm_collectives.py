"""FSDP2's all-gather and reduce-scatter through shared memory, for CPU workers on one host.

Why: with gloo, every FSDP2 collective goes through the loopback TCP stack: each worker's
shard is copied into the socket, out of it, and through gloo's ring of messages, with a
hand-off between the calling thread and gloo's I/O threads (and the peer's) at every hop,
each a scheduling delay when every core computes. Here the bytes move with one copy each,
on the calling thread, and the workers meet on the shared-memory channel of
:mod:`fleet.collective.shm` (the :class:`~fleet.collective.shm.LocalHost` that the
announcements of :mod:`fleet.sharding.order` already use), sleeping on a futex while a peer
is late.

Each worker owns one segment in ``/dev/shm``, in two halves used by alternate collectives (by
the parity of the channel's sequence number, as :class:`~fleet.collective.shm.Channel`
double-buffers its values): a worker writes collective s+2 into the half of s only after every
worker arrived at s+1, which each does only after it finished reading s. So one meeting per
collective suffices:

- all-gather: a worker copies its shard into its half and arrives; then it copies every
  peer's shard from the peer's half into its own output (FSDP2's, in private memory);
- reduce-scatter: FSDP2 writes the gradients straight into the worker's half (``allocate``
  hands it out as the input buffer, no copy); after the meeting a worker sums its own chunk
  over the workers, in rank order, into its output (``AVG``: then divides by the world size,
  as gloo does), so every run and every worker count gives the same bits.

A segment grows (a new, larger one: its generation number travels in the meeting, and the
peers map it by name) when a bigger unit comes, and its name is removed once every worker
mapped it. If ``/dev/shm`` refuses a segment, that worker says so in the meeting, and every
worker goes on through gloo from that collective on, together. A peer that dies while the
others wait is named (:class:`~fleet.errors.PeerError`) within about a second, one that
hangs after the strategy's ``timeout_s``. CUDA tensors never come here: the strategy keeps
FSDP2's own collectives (NCCL) for them.
"""

from __future__ import annotations

import functools
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fleet.collective import shm
from fleet.sharding.comm_timing import CommClock


class SharedMemoryCollectives(shm.SharedSegments):
    """The job's shared-memory all-gather and reduce-scatter (one per job; every sharded module uses it).

    ``host``: the workers' shared memory (its ``buckets`` channel, which nothing else uses in a
    sharding job, carries the meetings); ``diagnose``: names a silent peer after a timeout.
    """

    def __init__(self, host: shm.LocalHost, diagnose: Callable[[], str | None] | None = None):
        # not doubling: the biggest unit's gradients size it, during the first step only
        super().__init__(host, host.buckets, "fsdp", doubling=False, diagnose=diagnose)
        self.note: str | None = None

    # --- this worker's segment ------------------------------------------------------------------

    def _parity(self) -> int:
        """The half the next collective uses (its sequence number's parity, alike on every worker)."""
        return (self.channel.seq + 1) % 2

    def _own(self, parity: int, nbytes: int) -> torch.Tensor:
        return self._mine[parity * self._half : parity * self._half + nbytes]

    def _theirs(self, rank: int, parity: int, nbytes: int) -> torch.Tensor:
        segment = self._peers[rank]
        if segment is None:  # nothing was ever sent: only for an empty collective
            return torch.empty(nbytes, dtype=torch.uint8)
        half = segment.numel() // 2
        return segment[parity * half : parity * half + nbytes]

    def input_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Where FSDP2 should write the next reduce-scatter's input: this worker's half for it (no copy
        later), or private memory when there is no shared memory to be had."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if self.usable and self._room(nbytes):
            return self._own(self._parity(), nbytes).view(dtype)
        return torch.empty(numel, dtype=dtype)

    # --- the collectives -------------------------------------------------------------------------

    def _fell_back(self) -> None:
        self.note = f"shared memory could not be allocated ({self._refused or 'on another worker'})"
        if self.rank == 0 or self._refused is not None:
            print(f"fleet: sharding's collectives go through gloo: {self.note}", file=sys.stderr, flush=True)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group: Any, what: str) -> None:
        """``output`` (``world`` x ``input``, this worker's slot included) from every worker's ``input``."""
        nbytes = input.numel() * input.element_size()
        if self.usable:
            parity = self._parity()
            ok = self._room(nbytes)
            if ok:
                self._own(parity, nbytes).copy_(_bytes(input))
            if self._meet(ok, what):
                slots = _bytes(output).view(self.world, nbytes)
                for rank in range(self.world):
                    if rank != self.rank:
                        slots[rank].copy_(self._theirs(rank, parity, nbytes))
                return
        dist.all_gather_single(output, input, group=group)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, group: Any, op: Any, what: str) -> None:
        """This worker's chunk of the sum (``AVG``: the mean) of every worker's ``input``, summed in rank order."""
        average = _is(op, dist.ReduceOp.AVG)
        if not (average or _is(op, dist.ReduceOp.SUM)):  # PREMUL_SUM (a custom divide factor): FSDP2's own way
            dist.reduce_scatter_single(output, input, group=group, op=op)
            return
        nbytes = input.numel() * input.element_size()
        if self.usable:
            parity = self._parity()
            if _overlaps(output, self._mine):
                raise RuntimeError(
                    "fleet: FSDP2's reduce-scatter output (its sharded gradients) was given shared memory meant for "
                    "its input: this torch asks for the buffers in another way than fleet expects (input, then an "
                    "output 1/world its size); run with DistributedStrategy(shared_memory=False)"
                )
            ok = self._room(nbytes)
            own = self._own(parity, nbytes) if ok else None
            if own is not None and _bytes(input).data_ptr() != own.data_ptr():
                own.copy_(_bytes(input))  # not the buffer input_buffer() handed out: copy it in
            if self._meet(ok, what):
                chunk = output.numel()
                lo = self.rank * chunk
                parts = [self._theirs(r, parity, nbytes).view(input.dtype)[lo : lo + chunk] for r in range(self.world)]
                torch.add(parts[0], parts[1], out=output)
                for part in parts[2:]:
                    output.add_(part)
                if average:
                    output.div_(self.world)
                return
        dist.reduce_scatter_single(output, input, group=group, op=op)


def install(module: torch.nn.Module, name: str, collectives: SharedMemoryCollectives, clock: CommClock) -> None:
    """Give ``module`` (an FSDP2 module on the CPU) the shared-memory collectives, timed in ``clock``."""
    all_gather, reduce_scatter = _fsdp_classes()
    module.set_custom_all_gather(all_gather(collectives, clock, f"all-gather of sharded module {name!r}"))
    module.set_custom_reduce_scatter(
        reduce_scatter(collectives, clock, f"reduce-scatter of the gradients of sharded module {name!r}")
    )


@functools.cache
def _fsdp_classes() -> tuple[type, type]:
    """FSDP2's collective interfaces, implemented here; made on first use (importing FSDP2 costs 1-2 s)."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    class SharedMemoryAllGather(AllGather):
        def __init__(self, collectives: SharedMemoryCollectives, clock: CommClock, what: str) -> None:
            self.collectives, self.clock, self.what = collectives, clock, what

        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return torch.empty(*size, dtype=dtype, device=device)  # FSDP2 reads it after the call: private

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False):
            started = time.perf_counter()
            try:
                self.collectives.all_gather(output_tensor, input_tensor, group, self.what)
            finally:
                self.clock.add(time.perf_counter() - started)
            return None  # done: FSDP2 waits for no work

    class SharedMemoryReduceScatter(ReduceScatter):
        def __init__(self, collectives: SharedMemoryCollectives, clock: CommClock, what: str) -> None:
            self.collectives, self.clock, self.what = collectives, clock, what
            self._input: int | None = None  # the size of the input handed out, until the call

        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            """FSDP2 asks for the input, then the output (1/world of it), then calls: the input is
            written straight into shared memory; the output, which becomes the gradients, is private."""
            numel = math.prod(int(s) for s in size)
            handed, self._input = self._input, None
            if torch.device(device).type != "cpu" or (handed is not None and numel * self.collectives.world == handed):
                return torch.empty(*size, dtype=dtype, device=device)
            self._input = numel
            return self.collectives.input_buffer(numel, dtype).view(*size)

        def __call__(
            self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False
        ):
            self._input = None
            started = time.perf_counter()
            try:
                self.collectives.reduce_scatter(output_tensor, input_tensor, group, op, self.what)
            finally:
                self.clock.add(time.perf_counter() - started)
            return None

    return SharedMemoryAllGather, SharedMemoryReduceScatter


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _is(op: Any, which: Any) -> bool:
    try:
        return bool(op == which)
    except (TypeError, RuntimeError):  # a ReduceOp carrying a factor (PREMUL_SUM)
        return False


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1, b1 = a0 + a.numel() * a.element_size(), b0 + b.numel() * b.element_size()
    return a.numel() > 0 and b.numel() > 0 and a0 < b1 and b0 < a1
