"""The IO thread's bulk connection: a same-host worker's pulls and pushes over the server's direct socket.

Checked here: once on the server's Unix socket, rows and gradients go over the direct socket the IO
thread opens itself (one connection, authenticated like any direct one) and give what ZeroMQ gives;
a pull sent while the push before it is unanswered sees that push, large requests and answers
included; a request that must go through ZeroMQ (STATS) waits for the bulk requests before it, and
the pull after it waits for it.
"""

from __future__ import annotations

import torch

from fleet.ps.client.client import PSClient
from ps_servers import SECRET, on_ipc, servers

SGD = {"optimizer": {"kind": "sgd", "lr": 1.0}, "update": "async"}


def test_pushes_and_the_pulls_behind_them_go_in_order_over_the_bulk_connection() -> None:
    with servers(1, 1, timeout_s=5.0) as (srv,):
        client = PSClient([srv.endpoint], SECRET, 0, timeout_s=10.0)
        try:
            client.create_sparse(2, {"dim": 16, **SGD}).result()
            client.create_sparse(3, {"dim": 4, **SGD}).result()
            on_ipc(client)
            # 20k ids of 16 floats: 1.3 MB of rows each way (pieces over the request limits, many reads)
            ids = torch.arange(20000) * 7 - 5000
            expected = client.pull_sparse(2, ids).result().clone()
            small = torch.tensor([3, 11])
            expected_small = client.pull_sparse(3, small).result().clone()
            for i in range(8):
                pushed = client.push_sparse_grad(2, ids, torch.full((ids.numel(), 16), 0.5), i, 1.0)
                pushed_small = client.push_sparse_grad(3, small, torch.ones(2, 4), i, 0.25)
                rows, rows_small = client.pull_sparse_many([(2, ids, 0), (3, small, 0)]).result()
                pushed.result()
                pushed_small.result()
                expected -= 0.5
                expected_small -= 0.25
                assert torch.equal(rows, expected), i
                assert torch.equal(rows_small, expected_small), i
            stats = srv.stats()
            assert stats["direct_admitted"] == 1  # the IO thread's one connection (no caller made its own)
            assert stats["direct_rejected"] == 0
        finally:
            client.close()


def test_a_request_through_zeromq_waits_for_the_bulk_requests_before_it() -> None:
    with servers(1, 1, timeout_s=5.0) as (srv,):
        client = PSClient([srv.endpoint], SECRET, 0, timeout_s=10.0)
        try:
            client.create_sparse(2, {"dim": 8, **SGD}).result()
            on_ipc(client)
            ids = torch.arange(5000)
            expected = client.pull_sparse(2, ids).result().clone()
            for i in range(5):
                pushed = client.push_sparse_grad(2, ids, torch.ones(ids.numel(), 8), i, 1.0)  # bulk
                counted = client.stats()  # ZeroMQ: served after the push
                rows = client.pull_sparse(2, ids)  # bulk again: served after the stats
                expected -= 1.0
                assert counted.result()[0]["ops"]["PUSH_SPARSE_GRAD"] == i + 1
                assert torch.equal(rows.result(), expected)
                pushed.result()
        finally:
            client.close()
