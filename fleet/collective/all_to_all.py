"""All-to-all of variable-sized row blocks over the workers' process group.

Tables sharded across the workers (:mod:`fleet.collective.sharded_rows`) send each step's ids
to their owners and rows or gradients back: every worker has a block of rows for every
other worker, of a size only the sender knows. :func:`counts` first tells each worker how
many rows every peer sends it (one fixed-size all-to-all of ``world`` integers, which can
carry a few flags beside each count); :func:`rows` then moves the blocks themselves.

Both run on whatever device the tensors are on (gloo for CPU tensors, NCCL for CUDA ones):
``torch.distributed.all_to_all_single`` with split sizes where the backend has it. A backend
without it (older gloo builds answer "not supported") gets the same result from
``all_gather``: every block padded to the longest, each worker keeping the blocks addressed
to it, which moves ``world`` times the bytes; it is chosen once per group.

Every wait has the strategy's deadline: a worker that never reaches the exchange (it
evaluates alone, or died) becomes a :class:`~fleet.errors.PeerError` naming what was
exchanged, never a hang.

Among CPU workers of one host, :func:`blocks` goes through shared memory instead
(:class:`SharedMemoryAllToAll`: one meeting carries a block's counts and the block); across
hosts, for CUDA tensors, or with ``shared_memory=False`` it is :func:`counts` (when the receiver
does not know the sizes yet) and then :func:`rows`.

Through shared memory, why: tables sharded across the workers exchange ids, rows and gradients
several times a step. Through gloo each all-to-all is two (counts, then the blocks), and each
goes through the loopback with hand-offs between the calling thread and gloo's I/O threads (and
the peer's), each a scheduling delay when every core computes (W6: 2 workers on 2 cores). One
meeting on a shared-memory channel (the :class:`~fleet.collective.shm.LocalHost`'s ``tables``
channel, used by nothing else) moves both: each worker writes a header (for every destination,
``k`` numbers chosen by the caller and the block's length) and then its blocks into its own
segment, arrives, and copies its block out of every peer's segment, on the calling thread. The
counts a receiver needs come with the blocks, so a pull costs two meetings (ids, rows) and a step
one (gradients), where gloo needs three and two exchanges.

Each worker owns one segment in ``/dev/shm`` in two halves, used by alternate exchanges (the
parity of the channel's sequence number, as :mod:`fleet.sharding.shm_collectives` does): a
worker writes exchange s+2 into the half of s only after every worker arrived at s+1, which
each does only after it finished reading s. A segment grows (a new one, a new generation, which
travels in the meeting; the peers map it by name, and the name is removed once every worker
has mapped it). If ``/dev/shm`` refuses a segment, that worker says so in the meeting (-1) and
every worker goes on through the process group from that exchange on, together. A peer that
dies while the others wait is named (:class:`~fleet.errors.PeerError`) within about a second,
one that hangs after the strategy's ``collective_wait_s``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fleet.collective import shm
from fleet.errors import PeerError

_NO_ALL_TO_ALL: set[int] = set()  # groups whose backend lacks all_to_all_single (by id): all_gather instead


def finish(work: Any, timeout_s: float, what: str, diagnose: Callable[[], str | None] | None) -> None:
    """Wait for ``work`` (a collective started with ``async_op=True``) within the deadline, naming ``what`` if not."""
    try:
        work.wait(timedelta(seconds=timeout_s))
    except RuntimeError as error:
        raise PeerError.from_collective(what, error, diagnose() if diagnose is not None else None) from None


def counts(
    sends: torch.Tensor, group: Any, timeout_s: float, what: str, diagnose: Callable[[], str | None] | None = None
) -> torch.Tensor:
    """``sends[j]`` (an int64 ``[world, k]``: ``k`` numbers for worker ``j``) -> what each worker sent here."""
    world = dist.get_world_size(group)
    if sends.shape[0] != world:
        raise ValueError(f"all-to-all counts: {sends.shape[0]} blocks for {world} workers")
    got = torch.empty_like(sends)
    return _exchange(got, sends, [1] * world, [1] * world, group, timeout_s, what, diagnose)


def blocks(
    send: torch.Tensor,
    sizes: list[int],
    header: torch.Tensor | None,
    recv_sizes: list[int] | None,
    group: Any,
    timeout_s: float,
    what: str,
    diagnose: Callable[[], str | None] | None = None,
    local: Any = None,
) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """Worker ``j`` gets the flat ``send``'s block ``j`` (``sizes[j]`` elements, blocks in worker order) and
    ``header[j]`` (``k`` int64s, or no header: None). Returns (the blocks received, in worker order, flat; the
    headers received, ``[world, k]``, row ``i`` from worker ``i``, or None; the elements each worker sent
    here). ``recv_sizes``: what each worker sends here, when the caller knows (else it travels with the
    header). ``local``: the workers' :class:`SharedMemoryAllToAll` (None: the
    process group)."""
    send = send.reshape(-1)
    world = len(sizes)
    if local is not None and send.device.type == "cpu":
        done = local.exchange(send, header if header is not None else _NO_HEADER.expand(world, 0), sizes, what)
        if done is not None:
            return done[0], (done[1] if header is not None else None), done[2]
    got_header = None
    if recv_sizes is None or header is not None:
        mine = torch.tensor(sizes, dtype=torch.int64).unsqueeze(1)
        if header is not None:
            mine = torch.cat([header.to(torch.int64).cpu(), mine], 1)
        got = counts(mine.to(send.device), group, timeout_s, what, diagnose).cpu()
        got_header, recv_sizes = got[:, :-1], got[:, -1].tolist()
    assert recv_sizes is not None
    return rows(send, sizes, recv_sizes, group, timeout_s, what, diagnose), got_header, recv_sizes


_NO_HEADER = torch.empty(1, 0, dtype=torch.int64)


def rows(
    send: torch.Tensor,
    send_counts: list[int],
    recv_counts: list[int],
    group: Any,
    timeout_s: float,
    what: str,
    diagnose: Callable[[], str | None] | None = None,
) -> torch.Tensor:
    """Worker ``j`` gets ``send``'s block ``j`` (``send_counts[j]`` rows, blocks in worker order); the result
    holds the blocks received (``recv_counts[i]`` rows from worker ``i``), in worker order."""
    out = send.new_empty(sum(recv_counts), *send.shape[1:])
    return _exchange(out, send.contiguous(), send_counts, recv_counts, group, timeout_s, what, diagnose)


def _exchange(
    out: torch.Tensor,
    send: torch.Tensor,
    send_counts: list[int],
    recv_counts: list[int],
    group: Any,
    timeout_s: float,
    what: str,
    diagnose: Callable[[], str | None] | None,
) -> torch.Tensor:
    if id(group) not in _NO_ALL_TO_ALL:
        try:
            work = dist.all_to_all_single(out, send, recv_counts, send_counts, group=group, async_op=True)
        except RuntimeError as error:
            if "support" not in str(error).lower() and "implement" not in str(error).lower():
                raise PeerError.from_collective(what, error, diagnose() if diagnose is not None else None) from None
            _NO_ALL_TO_ALL.add(id(group))
        else:
            finish(work, timeout_s, what, diagnose)
            return out
    return _by_all_gather(out, send, send_counts, recv_counts, group, timeout_s, what, diagnose)


def _by_all_gather(
    out: torch.Tensor,
    send: torch.Tensor,
    send_counts: list[int],
    recv_counts: list[int],
    group: Any,
    timeout_s: float,
    what: str,
    diagnose: Callable[[], str | None] | None,
) -> torch.Tensor:
    """The all-to-all from all-gathers, for a backend without all_to_all_single: blocks padded to the longest
    (every worker knows the longest: the counts are all-gathered first)."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    mine = torch.tensor(send_counts, dtype=torch.int64, device=send.device)
    every = [torch.empty_like(mine) for _ in range(world)]
    finish(dist.all_gather(every, mine, group=group, async_op=True), timeout_s, what, diagnose)
    longest = max(int(c.max()) for c in every) if world else 0
    padded = send.new_zeros(world, longest, *send.shape[1:])
    at = 0
    for j, n in enumerate(send_counts):
        padded[j, :n] = send[at : at + n]
        at += n
    gathered = [torch.empty_like(padded) for _ in range(world)]
    finish(dist.all_gather(gathered, padded, group=group, async_op=True), timeout_s, what, diagnose)
    at = 0
    for i, n in enumerate(recv_counts):
        out[at : at + n] = gathered[i][rank, :n]
        at += n
    return out


# --------------------------------------------------------------------------- through shared memory

_DATA_ALIGN = 64  # the blocks start on a cache line after the header


class SharedMemoryAllToAll(shm.SharedSegments):
    """One job's all-to-all through shared memory (every sharded table of the job shares it: one channel).

    ``host``: the workers' shared memory; ``diagnose``: names a silent peer after a timeout.
    """

    def __init__(self, host: shm.LocalHost, diagnose: Callable[[], str | None] | None = None):
        # doubling: the blocks' sizes follow the batches' ids, which grow and shrink step by step
        super().__init__(host, host.tables, "a2a", doubling=True, diagnose=diagnose)
        # Its own count of meetings, not the channel's sequence: a meeting may be a lockstep announcement instead
        # (exchange_pieces' ``meet``); every worker has the same count, as they run the same exchanges.
        self._meetings = 0
        self._arrays: dict[int, tuple[torch.Tensor, np.ndarray]] = {}  # _numpy's: by the segment's id

    def _clock(self) -> int:
        return self._meetings

    def _met(self) -> None:
        self._meetings += 1

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
        parity = (self._clock() + 1) % 2  # the half this exchange uses, alike on every worker
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

    def exchange_pieces(
        self,
        pieces: list[Piece],
        sizes: list[int],
        header: torch.Tensor,
        dtype: torch.dtype,
        what: str,
        meet: Callable[[int], list[int]] | None = None,
    ) -> tuple[list[torch.Tensor], list[list[int]], list[int]] | None:
        """:meth:`exchange` without its copies: ``pieces`` (of ``dtype``, in order: worker 0's block, then worker
        1's ..., ``sizes[j]`` elements for worker ``j``) are written straight into this worker's segment, and
        the blocks received are views of the peers' segments (row ``i``: worker ``i``'s block, flat), valid until
        the next exchange on this channel: the caller copies what it keeps before it. Returns (those views; the
        headers received as lists, row ``i`` from worker ``i``; the elements each worker sent here), or None as
        :meth:`exchange` does. ``meet``: the meeting, when another one carries it (the lockstep's announcement of
        this exchange, :meth:`fleet.collective.shm.SharedSegments._meet`): one meeting, not two."""
        if not self.usable:
            return None
        world, k = self.world, header.shape[1]
        item = _ITEM_SIZE.get(dtype) or _ITEM_SIZE.setdefault(dtype, torch.empty((), dtype=dtype).element_size())
        width = k + 1
        head_bytes = -(-world * width * 8 // _DATA_ALIGN) * _DATA_ALIGN
        total = sum(sizes)
        data_bytes = total * item
        parity = (self._clock() + 1) % 2  # the half this exchange uses, alike on every worker
        ok = self._room(head_bytes + data_bytes)
        if ok:
            base = parity * self._half
            # the header through numpy: written in place, without the tensors torch.cat would make
            words = self._numpy(self._mine)[base : base + world * width * 8].view(np.int64).reshape(world, width)
            if k:
                words[:, :k] = header.to(torch.int64).numpy()
            words[:, k] = sizes
            if data_bytes:
                data = self._mine[base + head_bytes : base + head_bytes + data_bytes].view(dtype)
                if _write_pieces(data, pieces) != total:
                    raise ValueError(f"all-to-all pieces of {what}: they do not fill the {total} elements given")
        if not self._meet(ok, what, meet):
            return None
        views, headers, got_sizes = [], [], []
        rank = self.rank
        for peer in range(world):
            segment = self._peers[peer]
            assert segment is not None
            base = (segment.numel() // 2) * parity
            # the peer's header read through numpy (a slice and a list, no tensors); its block a view of the segment
            heads = self._numpy(segment)[base : base + world * width * 8].view(np.int64).tolist()
            row = heads[rank * width : (rank + 1) * width]
            n = row[k]
            if n:
                start = base + head_bytes + sum(heads[k : rank * width : width]) * item
                views.append(segment[start : start + n * item].view(dtype))
            else:  # nothing from this peer (a table-wise holder's own bags): no view to make
                views.append(_empty(dtype))
            headers.append(row[:k])
            got_sizes.append(n)
        return views, headers, got_sizes

    def _numpy(self, segment: torch.Tensor) -> np.ndarray:
        """``segment`` (a mapped segment, this worker's or a peer's) as a numpy array of its bytes, made once per
        segment: a numpy slice costs a fraction of a torch one, and the headers are read at every exchange."""
        cached = self._arrays.get(id(segment))
        if cached is None or cached[0] is not segment:
            # a new segment (they grow rarely): the arrays of the replaced ones go, and their mappings with them
            live = {id(s) for s in (self._mine, *self._peers) if s is not None}
            self._arrays = {key: value for key, value in self._arrays.items() if key in live}
            cached = self._arrays[id(segment)] = (segment, segment.numpy())
        return cached[1]


_EMPTY: dict[torch.dtype, torch.Tensor] = {}


def _empty(dtype: torch.dtype) -> torch.Tensor:
    """An empty block of ``dtype`` (shared: it has no elements to change)."""
    empty = _EMPTY.get(dtype)
    if empty is None:
        empty = _EMPTY[dtype] = torch.empty(0, dtype=dtype)
    return empty


Piece = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""What :meth:`SharedMemoryAllToAll.exchange_pieces` sends: a tensor's values, or ``(source, index)``: the rows
``source.index_select(0, index)``, gathered straight into the shared memory."""

_ITEM_SIZE: dict[torch.dtype, int] = {}


def _write_pieces(data: torch.Tensor, pieces: list[Piece]) -> int:
    """Write ``pieces`` one after another into the flat ``data``; the elements written (when they are not
    ``data``'s size, nothing need be written: the caller refuses the exchange)."""
    if all(type(p) is torch.Tensor and p.dtype == data.dtype and not p.requires_grad for p in pieces):
        # Why one cat: a copy per piece costs a slice, a view and a dispatch each (W6's table-wise exchanges
        # carry 8-16 pieces), about twice the time of one cat writing them all
        flat = [p.reshape(-1) for p in pieces]
        n = sum(int(p.numel()) for p in flat)
        if n == data.numel() and n:
            torch.cat(flat, out=data)
        return n
    at = 0
    for piece in pieces:
        if isinstance(piece, tuple):
            source, index = piece
            shape = (index.numel(), *source.shape[1:])
            n = index.numel() * math.prod(source.shape[1:])
            if n:
                torch.index_select(source, 0, index, out=data[at : at + n].view(shape))
        else:
            n = piece.numel()
            if n:
                data[at : at + n].view(piece.shape).copy_(piece)
        at += n
    return at


def piece_values(piece: Piece) -> torch.Tensor:
    """A piece's values, flat (the process group's way: the pieces are concatenated)."""
    if isinstance(piece, tuple):
        return piece[0].index_select(0, piece[1]).reshape(-1)
    return piece.reshape(-1)
