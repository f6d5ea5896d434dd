"""``PSClient.batched()``: requests started together wake the client's IO thread once, and keep their order and
results (async mode's step queues its pushes and its pull inside it)."""

from __future__ import annotations

import pytest
import torch

from fleet.ps.client.client import PSClient
from ps_servers import SECRET, SGD, client, servers

ASYNC = {"optimizer": SGD, "update": "async"}


def _count_wakes(c, monkeypatch) -> list[int]:
    io = c._io
    wakes = [0]
    real = io.wake

    def counted() -> None:
        wakes[0] += 1
        real()

    monkeypatch.setattr(io, "wake", counted)
    return wakes


@pytest.mark.timeout(60)
def test_requests_inside_batched_wake_once_and_apply_in_order(monkeypatch) -> None:
    with servers(1, 1) as srvs, client(srvs, 0) as c:
        c.create_dense(1, torch.zeros(4), ASYNC).result()
        wakes = _count_wakes(c, monkeypatch)
        with c.batched():
            with c.batched():  # nested: only the outermost wakes
                pushes = [c.push_dense_grad(1, torch.ones(4), step, 0.5) for step in range(3)]
            pulled = c.pull_dense(1)
            assert wakes[0] == 0
        assert wakes[0] == 1
        for push in pushes:
            push.result()
        # the pull was queued after the three pushes: it sees all of them (SGD, lr 0.5, gradient 1 each)
        assert torch.equal(pulled.result(), torch.full((4,), -1.5))
        c.pull_dense(1).result()  # outside: one wake per request again
        assert wakes[0] == 2


@pytest.mark.timeout(60)
def test_a_full_queue_inside_batched_wakes_the_io_thread_at_once(monkeypatch) -> None:
    with servers(1, 1) as srvs:
        # a client whose queue holds one job: every request inside but the first finds it full
        with PSClient([s.endpoint for s in srvs], SECRET, 0, 3.0, max_in_flight=1) as c:
            c.create_dense(1, torch.zeros(2), ASYNC).result()
            wakes = _count_wakes(c, monkeypatch)
            with c.batched():
                futures = [c.push_dense_grad(1, torch.ones(2), step, 1.0) for step in range(20)]
                assert wakes[0] > 0  # not left to the IO thread's idle poll (100 ms a full queue)
            for f in futures:
                f.result()
            assert torch.equal(c.pull_dense(1).result(), torch.full((2,), -20.0))
