"""Requests for several sparse tables at once (PULL_SPARSE_MANY, PUSH_SPARSE_GRAD_MANY).

- One composite request per server gives what one-table requests give: the same rows, the same
  updates (sync and async, clicks, several dims), the versions, the stale counts.
- A sync pull of several tables waits for each table's step, and is answered once all are there.
- A malformed composite changes no table; a part that fails fails the composite, naming its table.
- Parts over the request limits go in more requests (the result is the same).
"""

from __future__ import annotations

import pytest
import torch
import zmq

from fleet.ps.client.client import PSClient
from fleet.ps.protocol.errors import PSRemoteError
from fleet.ps.protocol.limits import RequestLimits
from fleet.ps.protocol.wire import Message, Op, SparsePush, Status, encode
from ps_servers import SECRET, SGD, ask, client, raw_socket, run_workers, servers

DIMS = {1: 4, 2: 8, 3: 1, 4: 16}  # table -> dim; each table has a twin (table + 10) updated one table at a time
ADAGRAD = {"kind": "adagrad", "lr": 0.1}


def create(c, update: str, workers: int = 1) -> None:
    for table, dim in DIMS.items():
        for t in (table, table + 10):
            config = {"dim": dim, "optimizer": ADAGRAD if dim == 8 else SGD, "update": update, "seed": table}
            c.create_sparse(t, config).result()


def batch(step: int, worker: int, table: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 100 * worker + table)
    ids = torch.randint(-50, 50, (30,), generator=g)  # repeats, negative ids, both servers
    return ids, torch.randn(30, DIMS[table], generator=g), torch.rand(30, generator=g)


def all_ids() -> torch.Tensor:
    return torch.arange(-50, 50)


@pytest.mark.parametrize("update", ["sync", "async"])
def test_one_request_per_server_equals_one_request_per_table(update: str) -> None:
    workers, steps = (2 if update == "sync" else 1), 3  # async: two workers' pushes interleave as they come
    with servers(2, workers) as srvs:
        clients = [client(srvs, w) for w in range(workers)]
        create(clients[0], update)
        for c in clients[1:]:
            create(c, update)

        def work(w: int) -> None:
            c = clients[w]
            for step in range(steps):
                version = step if update == "sync" else 0
                pulls = [(t, torch.unique(batch(step, w, t)[0]), version) for t in DIMS]
                many = c.pull_sparse_many(pulls).result()
                for (t, ids, _), rows in zip(pulls, many, strict=True):
                    alone = c.pull_sparse(t + 10, ids, version).result()
                    assert torch.equal(rows, alone), (w, step, t)
                    if update == "sync":
                        assert rows.ps_version == alone.ps_version == version
                pushes = [SparsePush(t, *batch(step, w, t)[:2], version, 0.1, batch(step, w, t)[2]) for t in DIMS]
                c.push_sparse_grads_many(pushes).result()
                for p in pushes:
                    c.push_sparse_grad(p.table + 10, p.ids, p.grads, p.step, p.lr, p.clicks).result()

        run_workers(work, workers)
        c = clients[0]
        for t in DIMS:
            assert torch.equal(
                c.pull_sparse(t, all_ids(), steps if update == "sync" else 0).result(),
                c.pull_sparse(t + 10, all_ids()).result(),
            ), t
        stats = c.stats().result()
        for info in stats:
            ops = info["ops"]
            assert ops["PUSH_SPARSE_GRAD_MANY"] == workers * steps, ops  # 4 tables, one request
            for t in DIMS:  # the composite's parts count under their tables, as one-table requests do
                assert info["table_ops"][str(t)]["PUSH_SPARSE_GRAD"] == workers * steps
            for t in DIMS:
                assert info["tables"][str(t)]["rows"] == info["tables"][str(t + 10)]["rows"]
        for cl in clients:
            cl.close()


def test_a_sync_pull_of_several_tables_waits_for_each_tables_step() -> None:
    with servers(1, 2) as srvs:
        a, b = client(srvs, 0), client(srvs, 1)
        create(a, "sync")
        create(b, "sync")
        pushes = [SparsePush(t, *batch(0, 0, t)[:2], 0, 0.1) for t in DIMS]
        a.push_sparse_grads_many(pushes).result()
        waiting = a.pull_sparse_many([(t, all_ids(), 1) for t in DIMS])
        assert not waiting.done()
        b.push_sparse_grads_many([SparsePush(t, torch.empty(0, dtype=torch.int64), torch.empty(0, DIMS[t]), 0, 0.1)
                                  for t in list(DIMS)[:2]]).result()  # fmt: skip
        with pytest.raises(TimeoutError):
            waiting.result(timeout=0.3)  # tables 3 and 4 still wait for worker 1
        b.push_sparse_grads_many([SparsePush(t, torch.empty(0, dtype=torch.int64), torch.empty(0, DIMS[t]), 0, 0.1)
                                  for t in list(DIMS)[2:]]).result()  # fmt: skip
        rows = waiting.result(timeout=5)
        assert [r.ps_version for r in rows] == [1] * len(DIMS)
        a.close()
        b.close()


def test_a_malformed_composite_changes_no_table_and_a_failing_part_names_its_table() -> None:
    with servers(1, 1) as srvs:
        c = client(srvs, 0)
        create(c, "async")
        meta = torch.tensor([[1, 0, 2, 0], [2, 0, 1, 0]])
        ids = torch.tensor([5, 6, 7])
        grads = torch.ones(2 * 4 + 1 * 8)
        lrs = torch.tensor([0.1, 0.1], dtype=torch.float64)
        clicks = torch.zeros(3)
        bad = {
            "a table twice": ([torch.tensor([[1, 0, 2, 0], [1, 0, 1, 0]]), lrs, ids, torch.ones(12), clicks], "twice"),
            "counts": ([torch.tensor([[1, 0, 2, 0], [2, 0, 2, 0]]), lrs, ids, grads, clicks], "do not add up"),
            "unknown table": ([torch.tensor([[1, 0, 2, 0], [99, 0, 1, 0]]), lrs, ids, grads, clicks], "table 99"),
            "grads": ([meta, lrs, ids, torch.ones(5), clicks], "grads must be float32, flat, 16 values"),
            "meta": ([meta.float(), lrs, ids, grads, clicks], "meta must be int64"),
            "lrs": ([meta, lrs.float(), ids, grads, clicks], "lrs must be float64"),
            "tensors": ([meta, lrs, ids], "carries 3 tensors, expected 5"),
        }
        ctx = zmq.Context()
        sock = raw_socket(ctx, srvs[0].endpoint)
        try:
            for rid, (what, (tensors, text)) in enumerate(bad.items(), 1):
                reply = ask(sock, encode(Message(Op.PUSH_SPARSE_GRAD_MANY, request_id=rid, tensors=tensors)))
                assert reply.status == Status.ERROR and text in reply.text(), (what, reply.text())
        finally:
            sock.close()
            ctx.term()
        assert c.sparse_rows(1).result() == 0 and c.sparse_rows(2).result() == 0  # nothing was applied
        c.create_sparse(5, {"dim": 2, "optimizer": SGD, "update": "sync", "seed": 0}).result()
        with pytest.raises(PSRemoteError, match="table 5: push for step 3"):
            c.push_sparse_grads_many(
                [SparsePush(1, ids[:1], torch.ones(1, 4), 0, 0.1), SparsePush(5, ids[:1], torch.ones(1, 2), 3, 0.1)]
            ).result()
        c.close()


def test_parts_over_the_limits_go_in_more_requests_with_the_same_result() -> None:
    limits = RequestLimits(max_ids=64, max_bytes=4096)  # ids_per_request: 64 for dim 1 .. 53 for dim 16
    with servers(2, 1, limits=limits) as srvs:
        c = PSClient([s.endpoint for s in srvs], SECRET, 0, 3.0, limits=limits)
        create(c, "async")
        big = torch.arange(-400, 400, 3)  # ~134 ids per server: over the limit alone for every dim
        pulls = [(t, big if t == 2 else torch.unique(batch(0, 0, t)[0]), 0) for t in DIMS]
        many = c.pull_sparse_many(pulls).result()
        for (t, ids, _), rows in zip(pulls, many, strict=True):
            assert torch.equal(rows, c.pull_sparse(t + 10, ids).result()), t
        pushes = []
        for t in DIMS:
            ids, grads, clicks = batch(1, 0, t)
            if t == 2:
                ids = torch.cat([big, big[:7]])  # an id's occurrences stay in one piece
                grads = torch.randn(ids.numel(), DIMS[t])
                clicks = torch.rand(ids.numel())
            pushes.append(SparsePush(t, ids, grads, 0, 0.1, clicks))
        c.push_sparse_grads_many(pushes).result()
        for p in pushes:
            c.push_sparse_grad(p.table + 10, p.ids, p.grads, 0, 0.1, p.clicks).result()
        everything = torch.cat([big, all_ids()]).unique()
        for t in DIMS:
            assert torch.equal(c.pull_sparse(t, everything).result(), c.pull_sparse(t + 10, everything).result()), t
        ops = [info["ops"] for info in c.stats().result()]
        assert all(o["PUSH_SPARSE_GRAD_MANY"] >= 1 and o["PUSH_SPARSE_GRAD"] >= 3 for o in ops), ops
        c.close()
