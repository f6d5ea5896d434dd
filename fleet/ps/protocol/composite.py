"""Requests for several sparse tables at once, written and read: PULL_SPARSE_MANY and PUSH_SPARSE_GRAD_MANY.

Several sparse tables' pulls or pushes go in one request (every feature of a
``fleet.nn.SparseFeatureCollection``, every table of a step), which the server serves as the
one-table requests they stand for, in order, and answers once all are answered. The layout:

- pull: ``[meta int64 [k, 3] (table, min_version, ids), ids]``; reply ``[rows float32, flat in the
  request's order, versions int64 [k]]``;
- push: ``[meta int64 [k, 4] (table, step, ids, has clicks), lrs float64 [k], ids, grads float32 flat,
  clicks float32 (zeros where a table has none)]``; reply ``[statuses int64 [k]]`` (OK or STALE per table).

The client writes requests and reads replies with these functions (:mod:`fleet.ps.client.many`), the
server reads requests and writes replies with them (:mod:`fleet.ps.server.many`). A request that does
not follow the layout is refused with a :class:`~fleet.ps.protocol.errors.ShardError` saying what is
wrong, before any of its tables is served.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fleet.ps.protocol.errors import ShardError
from fleet.ps.protocol.wire import Message, SparsePush, op_name

MANY_PULL_META = ("table", "min_version", "ids")
MANY_PUSH_META = ("table", "step", "ids", "has_clicks")
#: tables one such request may name (a bound on the work of splitting it, not on any model)
MAX_MANY_TABLES = 4096

#: ``dims(tables)``: each table's row width, raising ShardError for one that is not a sparse table here
Dims = Callable[[list[int]], list[int]]


# ---------------------------------------------------------------- the client's side
def pull_request(entries: Sequence[tuple[int, int, torch.Tensor]]) -> list[torch.Tensor]:
    """The tensors of a pull of ``(table, min_version, ids)`` entries."""
    meta = torch.tensor([[table, version, ids.numel()] for table, version, ids in entries], dtype=torch.int64)
    return [meta, torch.cat([ids for _, _, ids in entries])]


def read_pull_reply(reply: Message, shapes: Sequence[tuple[int, int]]) -> list[tuple[torch.Tensor, int]]:
    """Each entry's rows ``[count, dim]`` (``shapes``, in the request's order) and its shard's version."""
    flat, versions = reply.tensors
    out, at = [], 0
    for (count, dim), version in zip(shapes, versions.tolist(), strict=True):
        n = count * dim
        out.append((flat[at : at + n].view(count, dim), version))
        at += n
    return out


def push_request(pushes: Sequence[SparsePush]) -> list[torch.Tensor]:
    """The tensors of a push of every table's rows (each push: its ids, rows ``[n, dim]``, clicks or None)."""
    meta = torch.tensor(
        [[p.table, p.step, p.ids.numel(), int(p.clicks is not None)] for p in pushes], dtype=torch.int64
    )
    lrs = torch.tensor([p.lr for p in pushes], dtype=torch.float64)
    ids = torch.cat([p.ids for p in pushes])
    grads = torch.cat([p.grads.reshape(-1) for p in pushes])
    if all(p.clicks is None for p in pushes):  # the usual push: one zero tensor, not one per table joined
        clicks = torch.zeros(ids.numel())
    else:
        clicks = torch.cat([p.clicks if p.clicks is not None else torch.zeros(p.ids.numel()) for p in pushes])
    return [meta, lrs, ids, grads, clicks]


# ---------------------------------------------------------------- the server's side
def read_pull(msg: Message, dims: Dims) -> list[tuple[int, int, torch.Tensor]]:
    """``(table, min_version, ids)`` per table of a pull request, every part checked first."""
    meta, ids = _tensors(msg, ("meta", "ids"))
    rows = _check(msg, meta, len(MANY_PULL_META), ids)
    dims([r[0] for r in rows])
    # one split for every table's ids (views), not a slice per table
    parts = ids.split(_counts(rows))
    return [(table, min_version, part) for (table, min_version, _), part in zip(rows, parts, strict=True)]


def read_push(msg: Message, dims: Dims) -> list[SparsePush]:
    """Each table's push of a push request (clicks None where it has none), every part checked first."""
    meta, lrs, ids, grads, clicks = _tensors(msg, ("meta", "lrs", "ids", "grads", "clicks"))
    rows = _check(msg, meta, len(MANY_PUSH_META), ids)
    tables, counts = [r[0] for r in rows], _counts(rows)
    widths = dims(tables)
    if lrs.dtype != torch.float64 or list(lrs.shape) != [len(tables)]:
        raise ShardError(f"{op_name(msg.op)}: lrs must be float64 [{len(tables)}], got {lrs.dtype} {list(lrs.shape)}")
    want = sum(c * d for c, d in zip(counts, widths, strict=True))
    if grads.dtype != torch.float32 or grads.dim() != 1 or grads.numel() != want:
        raise ShardError(
            f"{op_name(msg.op)}: grads must be float32, flat, {want} values (the tables' ids x their dims), "
            f"got {grads.dtype} {list(grads.shape)}"
        )
    if clicks.dtype != torch.float32 or list(clicks.shape) != [ids.numel()]:
        raise ShardError(f"{op_name(msg.op)}: clicks must be float32 [{ids.numel()}], got {list(clicks.shape)}")
    # one split per tensor for every table's part (views), not slices per table
    id_parts, click_parts = ids.split(counts), clicks.split(counts)
    grad_parts = grads.split([c * d for c, d in zip(counts, widths, strict=True)])
    return [
        SparsePush(table, id_parts[k], grad_parts[k].view(count, dim), step, lr, click_parts[k] if has_clicks else None)
        for k, ((table, step, count, has_clicks), dim, lr) in enumerate(zip(rows, widths, lrs.tolist(), strict=True))
    ]


def pull_reply(rows: Sequence[torch.Tensor], versions: Sequence[int]) -> list[torch.Tensor]:
    """The tensors of a pull's reply: every table's rows, flat in the request's order, and their versions."""
    return [torch.cat([r.reshape(-1) for r in rows]), torch.tensor(list(versions), dtype=torch.int64)]


def push_reply(statuses: Sequence[int]) -> list[torch.Tensor]:
    """The tensors of a push's reply: each table's status (OK or STALE)."""
    return [torch.tensor(list(statuses), dtype=torch.int64)]


def _tensors(msg: Message, names: tuple[str, ...]) -> list[torch.Tensor]:
    if len(msg.tensors) != len(names):
        raise ShardError(
            f"{op_name(msg.op)} carries {len(msg.tensors)} tensors, expected {len(names)} ({', '.join(names)})"
        )
    return msg.tensors


def _counts(rows: list[list[int]]) -> list[int]:
    return [r[2] for r in rows]  # the id count column, the same in both layouts


def _check(msg: Message, meta: torch.Tensor, columns: int, ids: torch.Tensor) -> list[list[int]]:
    """The rows of a request's ``meta`` (one list per table), its layout checked before any part is served."""
    what = op_name(msg.op)
    if meta.dtype != torch.int64 or meta.dim() != 2 or meta.shape[1] != columns:
        raise ShardError(f"{what}: meta must be int64 [tables, {columns}], got {meta.dtype} {list(meta.shape)}")
    if not 1 <= meta.shape[0] <= MAX_MANY_TABLES:
        raise ShardError(f"{what} names {meta.shape[0]} tables; one request names 1 to {MAX_MANY_TABLES}")
    if ids.dtype != torch.int64 or ids.dim() != 1:
        raise ShardError(f"{what}: ids must be a flat int64 tensor, got {ids.dtype} {list(ids.shape)}")
    rows = meta.tolist()
    tables, counts = [r[0] for r in rows], _counts(rows)  # the same columns in both layouts
    if len(set(tables)) != len(tables):
        raise ShardError(f"{what} names a table twice: {tables}")
    if any(c < 0 for c in counts) or sum(counts) != ids.numel():
        raise ShardError(f"{what}: the tables' id counts {counts} do not add up to the {ids.numel()} ids sent")
    return rows
