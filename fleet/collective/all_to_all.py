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
(:mod:`fleet.collective.shm_all_to_all`: one meeting carries a block's counts and the block);
across hosts, for CUDA tensors, or with ``shared_memory=False`` it is :func:`counts` (when the
receiver does not know the sizes yet) and then :func:`rows`.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

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
    here). ``recv_sizes``: what each worker
    sends here, when the caller knows (else it travels with the header). ``local``: the workers'
    :class:`~fleet.collective.shm_all_to_all.SharedMemoryAllToAll` (None: the process group)."""
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
