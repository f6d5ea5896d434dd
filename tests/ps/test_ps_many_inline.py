"""A composite request served at once (fleet.ps.server.many's inline path) answers and changes the tables exactly
as its parts served one by one do: the same reply bytes, the same rows, versions, counts and error replies --
new rows, repeated ids, clicks, a non-finite part skipped or refused, a failing part in the middle.

In process: a server with no table threads, its requests handed to ``_serve`` and its replies encoded as sent.
"""

from __future__ import annotations

import json

import pytest
import torch

from fleet.ps.protocol import composite
from fleet.ps.protocol.wire import Message, Op, SparsePush, encode
from fleet.ps.server.loop import ParameterServer

SECRET = b"inline-secret-0123456"
DIMS = {1: 4, 2: 8, 3: 1}


def _serve(inline: bool, nonfinite: str, requests: list[Message]) -> tuple[list[list[bytes]], dict, dict]:
    srv = ParameterServer("127.0.0.1:0", SECRET, 0, 1, 5.0, torch_threads=None, threads=0, ipc=False)
    sent: list[list[bytes]] = []
    srv._send = lambda ident, reply: sent.append([bytes(f) for f in encode(reply)])  # type: ignore[method-assign]
    try:
        if not inline:
            for op in (Op.PULL_SPARSE_MANY, Op.PUSH_SPARSE_GRAD_MANY):
                srv._handlers[op].__self__._inline = None  # part by part, as with table threads
        for table, dim in DIMS.items():
            optimizer = {"kind": "adagrad", "lr": 0.1} if dim == 8 else {"kind": "sgd", "lr": 0.5}
            config = {"dim": dim, "optimizer": optimizer, "update": "async", "seed": table, "nonfinite": nonfinite}
            srv._serve(b"w", Message(Op.CREATE_SPARSE, table, 0, 1, blob=json.dumps(config).encode()))
        for msg in requests:
            srv._serve(b"w", msg)
        tables = {t: (s.version, s.table.export(), dict(s.nonfinite_skipped)) for t, s in srv._shards.items()}
        return sent, tables, {t: dict(v) for t, v in srv._table_ops.items()}
    finally:
        srv._sockets.router.close(linger=0)
        srv._sockets.zap.close()
        srv._sockets._ctx.term()


def _requests(bad: float | None) -> list[Message]:
    g = torch.Generator().manual_seed(7)
    out = []
    for step in range(3):
        ids = {t: torch.randint(-40, 40, (300,), generator=g).unique() for t in DIMS}  # new rows, then known ones
        pull = composite.pull_request([(t, 0, x) for t, x in ids.items()])
        out.append(Message(Op.PULL_SPARSE_MANY, 0, 0, 10 + step, tensors=pull))
        pushes = []
        for t, x in ids.items():
            grads = torch.randn(x.numel(), DIMS[t], generator=g)
            if bad is not None and t == 2 and step == 1:
                grads[3, 1] = bad
            clicks = torch.rand(x.numel(), generator=g) if t == 3 else None
            pushes.append(SparsePush(t, torch.cat([x, x[:5]]), torch.cat([grads, grads[:5]]), step, 0.5, clicks))
        pushes[-1] = SparsePush(3, ids[3], pushes[-1].grads[: ids[3].numel()], step, 0.5, pushes[-1].clicks)
        out.append(Message(Op.PUSH_SPARSE_GRAD_MANY, 0, 0, 20 + step, tensors=composite.push_request(pushes)))
    return out


@pytest.mark.parametrize(
    ("bad", "nonfinite"),
    [(None, "skip"), (float("nan"), "skip"), (float("inf"), "error")],
    ids=["finite", "skip", "error"],
)
def test_a_composite_served_at_once_equals_its_parts_served_one_by_one(bad: float | None, nonfinite: str) -> None:
    requests = _requests(bad)
    inline = _serve(True, nonfinite, requests)
    parts = _serve(False, nonfinite, _requests(bad))
    assert inline[0] == parts[0]  # every reply, byte for byte (an error reply names the failing part's table)
    assert inline[2] == parts[2]  # each table's count of operations
    assert inline[1].keys() == parts[1].keys()
    for table, (version, (ids, rows), skipped) in inline[1].items():
        version2, (ids2, rows2), skipped2 = parts[1][table]
        assert (version, skipped) == (version2, skipped2)
        assert torch.equal(ids, ids2) and torch.equal(rows, rows2)
    if nonfinite == "error":
        assert any(b"refused (nonfinite='error')" in frame for reply in inline[0] for frame in reply)
