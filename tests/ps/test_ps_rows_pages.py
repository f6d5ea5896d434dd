"""A table's rows read (state_dict) and written (load_state_dict, load_rows) in requests under the limits."""

from __future__ import annotations

import json
import math

import pytest
import torch
import zmq

from fleet.ps.client.client import PSClient
from fleet.ps.modes.rows import RemoteRows
from fleet.ps.protocol.limits import RequestLimits
from fleet.ps.protocol.wire import Message, Op, Status, encode
from ps_servers import SECRET, ask, raw_socket, servers

ADAM = {"kind": "adam", "lr": 0.1}


def _by_id(state: dict) -> dict:
    order = torch.argsort(state["ids"])
    return {k: v[order] for k, v in state.items()}


@pytest.mark.timeout(60)
def test_rows_go_both_ways_in_pages_no_bigger_than_one_request() -> None:
    limits = RequestLimits(max_ids=8)
    ctx = zmq.Context()
    with servers(2, 1, 5.0, limits) as srvs, PSClient([s.endpoint for s in srvs], SECRET, 0, 5.0, limits=limits) as c:
        c.create_sparse(1, {"dim": 4, "optimizer": ADAM}).result()
        c.pull_sparse(1, torch.arange(1000, 1010)).result()  # rows a replacing write must remove
        ids = torch.randperm(100) * 13 - 600
        g = torch.Generator().manual_seed(0)
        given = {"rows": torch.randn(100, 4, generator=g), "steps": torch.randint(1, 9, (100,), generator=g)}
        given["state.exp_avg"] = torch.randn(100, 4, generator=g)
        given["state.exp_avg_sq"] = torch.rand(100, 4, generator=g)
        c.write_sparse_rows(1, ids, given, replace=True).result()
        rows = RemoteRows(c, 1)
        state = rows.rows_state()
        assert set(state) == {"ids", "optimizer", *given} and json.loads(state["optimizer"])["kind"] == "adam"
        got, want = _by_id({k: v for k, v in state.items() if k != "optimizer"}), _by_id({"ids": ids, **given})
        assert all(torch.equal(got[k], want[k]) for k in want)
        assert rows.num_rows() == 100  # the pulled rows went
        ops = [s["table_ops"]["1"] for s in c.stats().result()]
        for server, counted in enumerate(ops):  # ~50 rows per server, 8 per request, each way
            held = int((ids % 2 == server).sum())
            assert counted["WRITE_SPARSE_ROWS"] == math.ceil(held / 8)
            assert counted["EXPORT_SPARSE"] == math.ceil(held / 8)
        # Given rows on a table with rows: set, optimizer state fresh, other rows kept
        c.write_sparse_rows(1, ids[:3], {"rows": torch.zeros(3, 4)}).result()
        again = _by_id({k: v for k, v in rows.rows_state().items() if k != "optimizer"})
        assert rows.num_rows() == 100 and int((again["rows"] == 0).all(1).sum()) == 3
        assert int((again["state.exp_avg"] == 0).all(1).sum()) == 3
        # A write over the limits (one the client would have split) is refused, naming them
        raw = raw_socket(ctx, srvs[0].endpoint)
        blob = json.dumps({"names": ["rows"]}).encode()
        msg = Message(
            Op.WRITE_SPARSE_ROWS, table=1, request_id=1, blob=blob, tensors=[torch.arange(9) * 2, torch.ones(9, 4)]
        )
        reply = ask(raw, encode(msg))
        assert reply.status == Status.ERROR and "WRITE_SPARSE_ROWS of table 1 carries 9 ids" in reply.text()
        assert "max_request_ids = 8" in reply.text()
        raw.close()
    ctx.term()
