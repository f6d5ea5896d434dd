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

Among workers of one host a shared-memory exchange would spare gloo's copies through the
loopback, as the collective and sharding paths do for their reductions; not built yet.
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
