"""Shared memory between the workers of one host: CPU buckets summed without the network stack.

For CPU buckets when every worker runs on one host (a common way to train on a multi-core
machine). Each worker owns one contiguous chunk of every bucket: it copies the rest of its
(pre-scaled) gradients into its send buffer in shared memory, then sums its chunk, reading
its own share straight from its gradients and the others' from their send buffers, and
writes the sum into every worker's result buffer (which ``.grad`` then points into). Per
worker that is about three passes over the gradients, against gloo's copies in and out of
the loopback TCP stack and its ring of messages. The two barriers around each chunk go
through the workers' shared-memory channel (:mod:`fleet.collective.shm`), on the
transport's thread, or on the training thread for a bucket that is still waiting when
backward ends. Bucket segments are created ``0600`` and fully allocated (a full
``/dev/shm`` fails at creation, never as a SIGBUS later) and unlinked once every worker has
mapped them, so nothing is left behind whatever happens to the job; if one cannot be
created, every worker falls back to the process group together, and says why.

Compressed gradients keep the process group (what they trade precision for is the wire),
as do CUDA buckets; the lockstep's headers still take the shared-memory channel.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import weakref
from datetime import timedelta
from typing import Any, ClassVar

import torch

from fleet.collective import shm
from fleet.collective.buckets import Bucket
from fleet.collective.transports.base import Setup, Transport

CLOSE_WAIT_S = 2.0  # the most close() waits for the summing thread (a bucket sums in milliseconds)
# When every worker's chunk of every bucket of a layout is smaller than this, the training thread sums them
# when backward ends, even where the summing thread runs: its hand-off (a queue, a wake-up, an event back)
# costs more than summing them there, and there is too little to overlap.
THREAD_MIN_BYTES = 64 << 10


class _Work:
    """A bucket for the shared-memory thread. Whoever claims it first (that thread, or the training
    thread waiting for it at the end of backward, which then saves the hand-off) sums it."""

    def __init__(self, index: int, run: Any):
        self.index = index
        self.run = run
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._claim = threading.Lock()
        self._claimed = False

    def claim(self) -> bool:
        with self._claim:
            mine, self._claimed = not self._claimed, True
            return mine

    def execute(self) -> None:
        try:
            self.run()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting training thread
            self.error = exc
        self.done.set()

    def wait(self, timeout: timedelta) -> None:
        if self.claim():  # the thread has not started it: do it here rather than wake it up
            self.execute()
        elif not self.done.wait(timeout.total_seconds() + 5):  # the thread's own barriers time out first
            raise RuntimeError(f"shared-memory reduction of bucket {self.index} timed out after {timeout}")
        if self.error is not None:
            raise self.error


class _Inline:
    """A bucket the training thread sums itself when it waits for it: no thread to hand it to, or too small
    for the hand-off (a queue and a wake-up) to pay."""

    def __init__(self, run: Any):
        self.run = run

    def wait(self, timeout: timedelta) -> None:
        self.run()  # the barriers inside time out on a late peer


class _Batched:
    """A bucket its :class:`_Batch` sums, with the layout's other buckets, when the first of them is waited for.
    ``sums``: its summing alone (the batch holds the barriers)."""

    def __init__(self, sums: Any, batch: _Batch):
        self.sums = sums
        self.batch = batch
        self.done = False

    def wait(self, timeout: timedelta) -> None:
        self.batch.finish(self)  # the batch's barriers time out on a late peer

    def finished(self) -> None:
        """Its batch summed it (with the layout's other buckets)."""
        self.done = True


class _Batch:
    """A layout's buckets that every worker sums on its training thread: summed one after the other between
    one pair of barriers, instead of a pair each (W2's two buckets: two barriers, each a wake-up of the peer
    and often a wait for it, less a step).

    Why it is the same sums: the first barrier still follows every worker's copies into its send buffers
    (all of a round's buckets are launched before the first is waited for: :class:`~fleet.collective.grad_sync.
    GradSync` launches them all at the end of backward, as ``shadow_round`` does), and the second still
    precedes every read of a result. Every worker batches a layout or none does (:meth:`SharedMemoryTransport.bind`
    agrees on it), so the barriers pair alike everywhere.
    """

    def __init__(self, channel: shm.Channel, size: int):
        self.channel = channel
        self.size = size  # the layout's buckets: every round launches them all before waiting for the first
        self.pending: list[_Batched] = []

    def add(self, work: _Batched, first: bool) -> None:
        """A bucket launched (in index order; ``first``: the layout's bucket 0, which begins a round)."""
        if first:
            # A round abandoned before its wait (backward raised on every worker, and the script went on) summed
            # nothing and met no barrier anywhere: its launches are forgotten, as an unwaited _Inline's are.
            self.pending = []
        self.pending.append(work)

    def finish(self, work: _Batched) -> None:
        if work.done:
            return
        pending, self.pending = self.pending, []
        if len(pending) != self.size or pending[0] is not work:
            # A round that waits before launching every bucket would pair its barriers with the peers' wrongly:
            # refuse it loudly rather than sum buffers a peer has not written.
            raise RuntimeError(
                f"shared-memory reduction: {len(pending)} of {self.size} buckets launched when the first was "
                "waited for (fleet launches every bucket of a round first)"
            )
        self.channel.barrier()  # every worker's gradients are in its send buffers
        for batched in pending:
            batched.sums()
        self.channel.barrier()  # every chunk of every bucket is summed into every result buffer
        for batched in pending:
            batched.finished()


class _Segment:
    """One bucket's shared memory: every worker's send buffer and result buffer."""

    def __init__(
        self, sends: list[torch.Tensor], results: list[torch.Tensor], inline: bool = False, batch: _Batch | None = None
    ):
        self.sends = sends
        self.results = results
        self.inline = inline  # summed on the training thread even when the summing thread runs
        self.batch = batch  # summed with the layout's other buckets between one pair of barriers (_Batch)
        self._views: dict[tuple[int, int, int], tuple[torch.Tensor | None, list[torch.Tensor]]] = {}

    def views(self, rank: int, a: int, b: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``[a, b)`` of ``rank``'s result buffer and of the others' send buffers; a worker's chunk is cut
        into the same pieces every round, so each is sliced once."""
        key = (rank, a, b)
        views = self._views.get(key)
        if views is None:
            others = [send[a:b] for k, send in enumerate(self.sends) if k != rank]
            views = self._views[key] = (self.results[rank][a:b], others)
        return views

    def results_of(self, lo: int, hi: int) -> list[torch.Tensor]:
        """``[lo, hi)`` of every worker's result buffer (sliced once, as :meth:`views`)."""
        key = (-1, lo, hi)
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = (None, [result[lo:hi] for result in self.results])
        return views[1]


class SharedMemoryTransport:
    """Sums CPU buckets through the workers' shared memory (:class:`~fleet.collective.shm.LocalHost`).

    :meth:`bind` is collective over the workers and is called where they agree (after a round's
    header exchange); a bucket that cannot live in shared memory goes through ``fallback``.
    """

    option: ClassVar[str | None] = "shared_memory"  # DistributedStrategy.shared_memory=False switches it off

    def __init__(self, host: shm.LocalHost, fallback: Transport, compress: bool = False):
        self.host = host
        self.fallback = fallback
        self.rank = host.rank
        self.world = host.world
        self.channel = host.buckets
        self.usable = not compress
        self.overlap = overlap_pays(host.world)
        self.note: str | None = None  # why it stopped being used, for the user
        self._layouts = 0
        # The buckets this transport sums (weakly: a bucket of an old layout takes its segment with it).
        self._segments: weakref.WeakKeyDictionary[Bucket, _Segment] = weakref.WeakKeyDictionary()
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._fallen_back = False  # some bucket went through the process group (bind)

    @classmethod
    def enabled(cls, setup: Setup) -> bool:
        """Every worker runs on this host and maps the others' shared memory (x86-64 with /dev/shm)."""
        return setup.group is not None and setup.local_host() is not None

    @classmethod
    def create(cls, setup: Setup, fallback: Transport | None) -> SharedMemoryTransport:
        host = setup.local_host()
        assert host is not None and fallback is not None, "enabled() and the process group come first"
        return cls(host, fallback, compress=setup.compression != "none")

    def header_channel(self) -> shm.Channel | None:
        return self.host.lockstep

    def _all_ok(self, ok: bool) -> bool:
        return min(row[0] for row in self.channel.exchange([1 if ok else 0])) == 1

    def launch_early(self) -> bool:
        """Only where a bucket may travel or be summed while backward goes on: the summing thread, or the
        process group for buckets that fell back to it. Summed on the training thread, a bucket launched at
        once would only make it wait for the round's agreement mid-backward (one more meeting with the peers
        per step, often a sleep and a wake-up) and copy its gradients earlier, for no overlap."""
        return self.overlap or self._fallen_back or not self.usable

    def bind(self, buckets: list[Bucket]) -> None:
        fresh = [b for b in buckets if b.flat is None]
        if not fresh or not self.usable or any(b.device.type != "cpu" for b in fresh):
            self._fallen_back = self._fallen_back or bool(fresh)
            self.fallback.bind(fresh)
            return
        self._layouts += 1
        name = f"{self.host.token}-{self._layouts}"
        mine: list[tuple[str, torch.Tensor]] = []
        error: OSError | None = None
        for bucket in fresh:
            path = os.path.join(shm.SHM_DIR, f"{name}-{bucket.index}-{self.rank}")
            try:
                mine.append((path, shm.create(path, 2 * bucket.numel, bucket.dtype)))
            except OSError as exc:
                error = exc
                break
        peers: list[list[torch.Tensor]] = []
        try:
            if not self._all_ok(error is None):
                self.usable = False
                self.note = f"shared memory could not be allocated ({error or 'on another worker'})"
                if self.rank == 0 or error is not None:
                    print(f"fleet: gradients go through the process group: {self.note}", file=sys.stderr, flush=True)
                self.fallback.bind(fresh)
                return
            for bucket, (_, mapped) in zip(fresh, mine, strict=True):
                paths = [os.path.join(shm.SHM_DIR, f"{name}-{bucket.index}-{peer}") for peer in range(self.world)]
                peers.append(
                    [mapped if peer == self.rank else shm.attach(paths[peer], 2 * bucket.numel, bucket.dtype)
                     for peer in range(self.world)]
                )  # fmt: skip
            # Every worker has mapped every segment: the names can go. Whether any worker sums on a thread of its own
            # comes with it (1 + 2): a layout's buckets are batched (_Batch) only where every worker sums them inline.
            rows = self.channel.exchange([1 + (2 if self.overlap else 0)])
            threads_anywhere = any(row[0] & 2 for row in rows)
        finally:
            for path, _ in mine:
                try:
                    os.unlink(path)
                except OSError:
                    pass
        # The barriers of one channel must run in the same order on every worker, so either all of a layout's
        # buckets go to the thread (in order) or none does: none when every chunk is too small to pay for it.
        inline = all(
            b.numel * maps[0].element_size() // self.world < THREAD_MIN_BYTES
            for b, maps in zip(fresh, peers, strict=True)
        )
        batch = _Batch(self.channel, len(fresh)) if inline or not threads_anywhere else None
        for bucket, maps in zip(fresh, peers, strict=True):
            n = bucket.numel
            segment = self._segments[bucket] = _Segment([m[:n] for m in maps], [m[n:] for m in maps], inline, batch)
            bucket.attach(segment.results[self.rank], send=segment.sends[self.rank])
        if self._thread is None and self.overlap:
            self._thread = threading.Thread(target=self._run, name="fleet-shm-reduce", daemon=True)
            self._thread.start()

    def _chunk(self, bucket: Bucket) -> tuple[int, int]:
        """The part of the bucket this worker sums: the rank-th of ``world`` contiguous chunks."""
        return self.rank * bucket.numel // self.world, (self.rank + 1) * bucket.numel // self.world

    def _submit(self, segment: _Segment, lo: int, hi: int, own: list, index: int) -> _Inline | _Batched | _Work:
        if segment.batch is not None:  # every worker sums the layout inline: one pair of barriers for all of it
            batched = _Batched(lambda: _sum_chunk(segment, self.rank, lo, hi, own), segment.batch)
            segment.batch.add(batched, first=index == 0)
            return batched

        def run() -> None:
            self.channel.barrier()  # every worker's gradients are in its send buffer
            _sum_chunk(segment, self.rank, lo, hi, own)
            self.channel.barrier()  # every chunk is summed into every result buffer

        if self._thread is None or segment.inline:
            return _Inline(run)  # the training thread sums it when backward ends
        work = _Work(index, run)
        self._queue.put(work)
        return work

    def launch(self, bucket: Bucket, scale: float, changed: set[int]) -> Any:
        segment = self._segments.get(bucket)
        if segment is None:
            return self.fallback.launch(bucket, scale, changed)
        lo, hi = self._chunk(bucket)
        # This worker's own share of its chunk is read straight from its gradients: never copied.
        sources = bucket.gather(scale, changed, keep=(lo, hi))
        return self._submit(segment, lo, hi, bucket.own(sources, lo, hi, scale), bucket.index)

    def start_empty(self, bucket: Bucket) -> Any:
        segment = self._segments.get(bucket)
        if segment is None:
            return self.fallback.start_empty(bucket)
        bucket.send.zero_()
        lo, hi = self._chunk(bucket)
        return self._submit(segment, lo, hi, [(lo, hi, None, 1.0)], bucket.index)

    def wait(self, bucket: Bucket, work: Any, timeout: timedelta) -> None:
        if isinstance(work, _Inline | _Batched | _Work):
            work.wait(timeout)
        else:
            self.fallback.wait(bucket, work, timeout)

    def _run(self) -> None:
        while True:
            work = self._queue.get()
            if work is None:
                return
            if work.claim():
                work.execute()

    def close(self) -> None:
        """Stop the summing thread and wait for it, at most :data:`CLOSE_WAIT_S`: a daemon thread still summing
        in torch's code when the interpreter finalises aborts the process (:mod:`fleet.runtime.store_calls`)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            if thread is not threading.current_thread():  # idle: ends at once; stuck on a dead peer: left there
                thread.join(CLOSE_WAIT_S)


def overlap_pays(workers_here: int) -> bool:
    """Whether summing buckets on a thread of their own, while backward goes on, can only help.

    Only with a core to spare for it: when every core already runs a worker's computation
    (W1: 2 workers, 1 thread each, 2 cores), the summing competes with it for the core and the
    memory bus, and measured 2-4 ms per step slower than summing after backward.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores >= workers_here * (torch.get_num_threads() + 1)


def _sum_chunk(segment: _Segment, rank: int, lo: int, hi: int, own: list) -> None:
    """Sum ``[lo, hi)`` of the bucket: the other workers' send buffers plus this worker's ``own`` pieces
    (see :meth:`Bucket.own`), into this worker's result buffer, then copy it into the others'."""
    results = segment.results_of(lo, hi)
    total = results[rank]
    for a, b, source, factor in own:
        out, others = segment.views(rank, a, b)
        if source is not None and _overlaps(source, out):
            # The gradient lives in this very result buffer (backward accumulated into last round's
            # result: zero_grad(set_to_none=False), or two backward passes before a step). With three
            # or more workers the others' sum is written into it before it is read: read it first.
            source = source.clone()
        base = others[0]
        if len(others) > 1:
            torch.add(base, others[1], out=out)
            for send in others[2:]:
                out.add_(send)
            base = out
        if source is None:
            if base is not out:
                out.copy_(base)
        else:
            torch.add(base, source, alpha=factor, out=out)
    for k, result in enumerate(results):
        if k != rank:
            result.copy_(total)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share any memory (by the address ranges they span)."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1, b1 = a0 + a.numel() * a.element_size(), b0 + b.numel() * b.element_size()
    return a.numel() > 0 and b.numel() > 0 and a0 < b1 and b0 < a1
