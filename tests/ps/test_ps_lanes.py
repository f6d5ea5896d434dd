"""Table threads (fleet.ps.server.lanes): the same answers as the single-threaded server, bit for bit.

Two workers (threads) train several sparse tables and a dense one in sync and in async mode,
with one-table and composite requests, against a server with 0 and with 2 table threads; every
row and value must be equal. (The single-threaded server's math is checked against one process
by the rest of tests/ps.) Also: a request that is no table's pull or push runs after the lanes
are empty, and a composite's answer comes once all its parts ran.
"""

from __future__ import annotations

import threading

import pytest
import torch

from fleet.ps.client.client import PSClient
from fleet.ps.protocol.wire import SparsePush
from fleet.ps.server.lanes import default_threads
from fleet.ps.server.loop import ParameterServer

SECRET = b"lanes-secret-0123456"
TABLES = (0, 1, 2)
STEPS = 6


def _train(threads: int, update: str) -> tuple[list[torch.Tensor], torch.Tensor, dict]:
    srv = ParameterServer("127.0.0.1:0", SECRET, 0, 2, 10.0, torch_threads=None, threads=threads)
    serving = threading.Thread(target=srv.serve, daemon=True)
    serving.start()
    clients = [PSClient([srv.endpoint], SECRET, w, timeout_s=10.0) for w in range(2)]
    sparse = {"dim": 4, "optimizer": {"kind": "adagrad", "lr": 0.5}, "update": update}
    dense = {"optimizer": {"kind": "sgd", "lr": 0.5}, "update": update}
    for w, client in enumerate(clients):
        for table in TABLES:
            client.create_sparse(table, sparse).result()
        client.create_dense(9, torch.zeros(5) if w == 0 else None, {**dense, "size": 5}).result()
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        client = clients[w]
        gen = torch.Generator().manual_seed(w)
        try:
            for step in range(STEPS):
                version = step if update == "sync" else 0
                ids = [torch.randint(0, 40, (16,), generator=gen).unique() for _ in TABLES]
                pulled = client.pull_sparse_many([(t, x, version) for t, x in zip(TABLES, ids, strict=True)])
                rows = pulled.result()
                pushes = [
                    SparsePush(t, x, r * 0.1 + torch.randn(r.shape, generator=gen), step, 0.5)
                    for t, x, r in zip(TABLES[:2], ids[:2], rows[:2], strict=True)
                ]
                futures = [client.push_sparse_grads_many(pushes)]  # a composite push
                last = TABLES[2]  # and a one-table push
                futures.append(
                    client.push_sparse_grad(last, ids[2], torch.randn(ids[2].numel(), 4, generator=gen), step, 0.5)
                )
                client.pull_dense(9, version).result()
                futures.append(client.push_dense_grad(9, torch.randn(5, generator=gen), step, 0.5))
                for f in futures:
                    f.result()
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test
            errors.append(exc)

    workers = [threading.Thread(target=worker, args=(w,)) for w in range(2)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(60)
    assert not errors, errors
    final = STEPS if update == "sync" else 0
    everything = torch.arange(40)
    rows = [clients[0].pull_sparse(t, everything, final).result() for t in TABLES]
    values = clients[0].pull_dense(9, final).result()
    stats = clients[0].stats().result()[0]
    for client in clients:
        client.close()
    serving.join(10)
    assert not serving.is_alive()
    return rows, values, stats


@pytest.mark.timeout(120)
@pytest.mark.parametrize("update", ["sync", "async"])
def test_two_table_threads_give_what_the_loop_alone_gives(update: str) -> None:
    alone_rows, alone_values, alone = _train(0, update)
    lanes_rows, lanes_values, lanes = _train(2, update)
    assert alone["table_threads"] == 0 and lanes["table_threads"] == 2
    if update == "sync":  # the same pushes in the same steps: the same math, whatever the threads' timing
        for a, b in zip(alone_rows, lanes_rows, strict=True):
            assert torch.equal(a, b)
        assert torch.equal(alone_values, lanes_values)
        assert alone["stale_dropped"] == lanes["stale_dropped"] == {}
    else:  # async: arrival order between the two workers differs run to run; every push was applied
        for rows in lanes_rows:
            assert torch.isfinite(rows).all()
    assert lanes["ops"]["PUSH_SPARSE_GRAD_MANY"] == alone["ops"]["PUSH_SPARSE_GRAD_MANY"] == 2 * STEPS
    assert lanes["errors"] == alone["errors"] == 0


def test_default_threads_by_the_machine() -> None:
    assert default_threads(1) == default_threads(2) == 0
    assert default_threads(4) == 2 and default_threads(32) == 8
    with pytest.raises(ValueError, match="threads=-1"):
        ParameterServer("127.0.0.1:0", SECRET, 0, 1, 1.0, threads=-1)
