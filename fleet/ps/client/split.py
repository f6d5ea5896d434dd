"""Cutting one server's part of a sparse batch into requests under the limits (client side).

Pieces follow sorted id order, so the rows a server creates get their slots in the order one
request would have given them (the id index sorts new ids within a request), and a table
ends up identical to one that took the batch whole. A push keeps every occurrence of an id
in one piece: the server sums an id's gradients before its one update, so splitting them
would be two updates. Only an id repeated more often than a piece holds (more than
``max_request_ids`` times in one push) cannot stay together; then the push's repeated ids
are summed here first, in batch order -- the same sums the server forms -- and such a push
counts dropped (unadmitted) gradients once per distinct id rather than per occurrence.
"""

from __future__ import annotations

import torch


def pull_pieces(ids: torch.Tensor, most: int, piece: int | None = None) -> list[torch.Tensor] | None:
    """Positions in ``ids`` of each request, in sorted id order; None when one request holds them all.

    ``most``: what one request may carry; a call over it goes in pieces of ``piece`` ids (default ``most``).
    """
    if ids.numel() <= most:
        return None
    piece = most if piece is None else max(1, min(piece, most))
    order = torch.argsort(ids, stable=True)
    return [order[lo : lo + piece] for lo in range(0, ids.numel(), piece)]


def push_pieces(tensors: list[torch.Tensor], most: int, piece: int | None = None) -> list[list[torch.Tensor]]:
    """``[ids, rows, (clicks)]`` cut into requests of at most ``most`` ids, no id in two of them.

    A call over ``most`` goes in pieces of about ``piece`` ids (default ``most``); an id repeated more
    than ``piece`` times gets a piece of its own, up to ``most``.
    """
    ids = tensors[0]
    n = ids.numel()
    if n <= most:
        return [tensors]
    piece = most if piece is None else max(1, min(piece, most))
    order = torch.argsort(ids, stable=True)
    ordered = ids.index_select(0, order)
    _, runs = torch.unique_consecutive(ordered, return_counts=True)
    if int(runs.max()) > most:
        return push_pieces(_summed(tensors), most, piece)
    pieces, lo = [], 0
    while lo < n:
        hi = min(lo + piece, n)
        if hi < n:  # back to the first occurrence of the id at ``hi``: its run goes to the next piece
            start = int(torch.searchsorted(ordered, ordered[hi : hi + 1], side="left"))
            # unless that run began this piece (it is longer than ``piece``): then the piece is that run
            hi = start if start > lo else int(torch.searchsorted(ordered, ordered[hi : hi + 1], side="right"))
        pick = order[lo:hi]
        pieces.append([t.index_select(0, pick) for t in tensors])
        lo = hi
    return pieces


def _summed(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One entry per distinct id: rows (and clicks) of repeated ids added in batch order."""
    ids, rows, *clicks = tensors
    uniq, inverse = torch.unique(ids, return_inverse=True)
    out = [uniq, torch.zeros(uniq.numel(), *rows.shape[1:], dtype=rows.dtype).index_add_(0, inverse, rows)]
    out += [torch.zeros(uniq.numel(), dtype=c.dtype).index_add_(0, inverse, c) for c in clicks]
    return out
