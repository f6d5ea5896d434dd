"""All-to-all of variable-sized blocks through shared memory, for CPU workers on one host.

Why: tables sharded across the workers (:mod:`fleet.collective.sharded_rows`) exchange ids,
rows and gradients several times a step. Through gloo each all-to-all is two (counts, then the
blocks), and each goes through the loopback with hand-offs between the calling thread and
gloo's I/O threads (and the peer's), each a scheduling delay when every core computes
(W6: 2 workers on 2 cores). Here one meeting on a shared-memory channel
(:class:`~fleet.collective.shm.Channel`, the :class:`~fleet.collective.shm.LocalHost`'s
``tables`` channel, used by nothing else) moves both: each worker writes a header (for every
destination, ``k`` numbers chosen by the caller and the block's length) and then its blocks
into its own segment, arrives, and copies its block out of every peer's segment, on the
calling thread. The counts a receiver needs come with the blocks, so a pull costs two meetings
(ids, rows) and a step one (gradients), where gloo needs four and two exchanges.

Each worker owns one segment in ``/dev/shm`` in two halves, used by alternate exchanges (the
parity of the channel's sequence number, as :mod:`fleet.sharding.shm_collectives` does): a
worker writes exchange s+2 into the half of s only after every worker arrived at s+1, which
each does only after it finished reading s. A segment grows (a new one, a new generation, which
travels in the meeting; the peers map it by name, and the name is removed once every worker
has mapped it). If ``/dev/shm`` refuses a segment, that worker says so in the meeting (-1) and
every worker goes on through the process group from that exchange on, together.

A peer that dies while the others wait is named (:class:`~fleet.errors.PeerError`) within
about a second, one that hangs after the strategy's ``collective_wait_s``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from fleet.collective import shm
from fleet.errors import PeerError

_ALIGN = 4096  # segment halves are whole pages
_DATA_ALIGN = 64  # the blocks start on a cache line after the header


class SharedMemoryAllToAll:
    """One job's all-to-all through shared memory (every sharded table of the job shares it: one channel).

    ``host``: the workers' shared memory; ``diagnose``: names a silent peer after a timeout.
    """

    def __init__(self, host: shm.LocalHost, diagnose: Callable[[], str | None] | None = None):
        self.rank = host.rank
        self.world = host.world
        self.channel = host.tables
        self.token = host.token
        self.diagnose = diagnose
        self.usable = True  # False once a worker could not get shared memory: the process group for every worker
        self._mine = torch.empty(0, dtype=torch.uint8)
        self._half = 0
        self._generation = 0
        self._peers: list[torch.Tensor | None] = [None] * self.world
        self._generations = [0] * self.world
        self._to_unlink: list[tuple[int, str]] = []  # (sequence from which every worker has mapped it, path)
        self._refused: OSError | None = None

    def exchange(
        self, send: torch.Tensor, header: torch.Tensor, sizes: list[int], what: str
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]] | None:
        """Worker ``j`` gets ``send``'s block ``j`` (``sizes[j]`` elements of the flat ``send``, blocks in worker
        order) and ``header[j]`` (``k`` int64s). Returns (the blocks received, in worker order, flat; the headers
        received, ``[world, k]``, row ``i`` from worker ``i``; the elements each worker sent here), or None when shared memory is not to be had
        (then every worker returns None from this exchange on: the caller uses the process group)."""
        if not self.usable:
            return None
        world, k = self.world, header.shape[1]
        head = torch.cat([header.to(torch.int64), torch.tensor(sizes, dtype=torch.int64).unsqueeze(1)], 1)
        head_bytes = -(-head.numel() * 8 // _DATA_ALIGN) * _DATA_ALIGN
        flat = send.reshape(-1)
        data_bytes = flat.numel() * flat.element_size()
        parity = (self.channel.seq + 1) % 2  # the half this exchange uses, alike on every worker
        ok = self._room(head_bytes + data_bytes)
        if ok:
            own = self._mine[parity * self._half :]
            own[: head.numel() * 8].copy_(head.reshape(-1).view(torch.uint8))
            if data_bytes:
                own[head_bytes : head_bytes + data_bytes].copy_(flat.contiguous().view(torch.uint8))
        if not self._meet(ok, what):
            return None
        heads = []
        for peer in range(world):
            segment = self._peers[peer]
            assert segment is not None
            half = segment.numel() // 2
            heads.append(segment[parity * half : parity * half + head.numel() * 8].view(torch.int64).view(world, k + 1))
        every = torch.stack([h[self.rank] for h in heads])  # [world, k + 1]: what each peer sent here
        got_sizes = every[:, k].tolist()
        out = flat.new_empty(sum(got_sizes))
        out_bytes = out.view(torch.uint8)
        item = flat.element_size()
        at = 0
        for peer in range(world):
            n = got_sizes[peer] * item
            if n:
                segment = self._peers[peer]
                assert segment is not None
                start = (segment.numel() // 2) * parity + head_bytes + int(heads[peer][: self.rank, k].sum()) * item
                out_bytes[at : at + n].copy_(segment[start : start + n])
            at += n
        return out, every[:, :k].clone(), got_sizes

    # --- this worker's segment ------------------------------------------------------------------

    def _room(self, nbytes: int) -> bool:
        """Make each half hold ``nbytes``; False if ``/dev/shm`` refused (then this worker says so)."""
        if nbytes <= self._half:
            return True
        if self._refused is not None:
            return False
        half = -(-max(nbytes, 2 * self._half) // _ALIGN) * _ALIGN  # doubling: a few generations, early
        path = self._path(self.rank, self._generation + 1)
        try:
            segment = shm.create(path, 2 * half, torch.uint8)
        except OSError as error:
            self._refused = error
            return False
        self._mine, self._half, self._generation = segment, half, self._generation + 1
        self._peers[self.rank] = segment
        self._generations[self.rank] = self._generation
        # The peers map it after the next meeting, before they arrive at the one after.
        self._to_unlink.append((self.channel.seq + 2, path))
        return True

    def _path(self, rank: int, generation: int) -> str:
        return os.path.join(shm.SHM_DIR, f"{self.token}-a2a-{rank}-{generation}")

    def _meet(self, ok: bool, what: str) -> bool:
        """Arrive with this worker's segment generation (-1: no shared memory here) and wait for all; map the
        peers' new segments. False: someone had no shared memory, every worker uses the process group."""
        try:
            rows = self.channel.exchange([self._generation if ok else -1])
        except shm.ChannelError as error:
            dead = "died" in str(error)
            diagnosis = None if dead or self.diagnose is None else self.diagnose()
            raise PeerError.from_collective(what, error, diagnosis, plain=dead) from None
        generations = [row[0] for row in rows]
        if min(generations) < 0:
            self.usable = False
            return False
        for rank, generation in enumerate(generations):
            if rank != self.rank and generation != self._generations[rank]:
                path = self._path(rank, generation)
                self._peers[rank] = shm.attach(path, os.stat(path).st_size, torch.uint8)
                self._generations[rank] = generation
        while self._to_unlink and self._to_unlink[0][0] <= self.channel.seq:
            self._unlink(self._to_unlink.pop(0)[1])
        return True

    def close(self) -> None:
        """Remove the names of segments not yet removed (a job ending right after one was made)."""
        for _, path in self._to_unlink:
            self._unlink(path)
        self._to_unlink.clear()

    @staticmethod
    def _unlink(path: str) -> None:
        try:
            os.unlink(path)
        except OSError:
            pass
