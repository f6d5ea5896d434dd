"""Failures in collective mode surface as clear errors within the strategy's timeout, never hangs."""

from __future__ import annotations

import os
import time

import pytest
import torch

from dist_harness import fleetrun_env, free_port, run_processes

pytestmark = pytest.mark.multiprocess  # every test here starts processes


def dying_worker(rank, victim, how, shared_memory=True):
    import signal

    import fleet

    fleet.init(strategy=fleet.DistributedStrategy(timeout_s=3, shared_memory=shared_memory))
    model = torch.nn.Linear(8, 8)
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    started = time.monotonic()
    try:
        for step in range(50):
            if rank == victim and step == 2:
                if how == "exit":
                    os._exit(3)  # a worker dies in the middle of training
                os.kill(os.getpid(), signal.SIGSTOP)  # or stops answering without dying
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
    except fleet.PeerError as error:
        return ("PeerError", str(error), time.monotonic() - started)
    return ("finished", "", time.monotonic() - started)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "victim, how, shared_memory, named",
    [
        # workers on one host talk through shared memory: a dead peer's process is seen to be gone
        (1, "exit", True, "worker 1 died (its process is gone)"),
        (0, "exit", True, "worker 0 died (its process is gone)"),
        (1, "stop", True, "worker 1 stopped answering"),
        # through the process group (workers on several hosts), the store's heartbeats tell
        (1, "exit", False, "worker 1 stopped answering"),
        (0, "exit", False, "worker 0 (which hosts the rendezvous store) is unreachable"),
        (1, "stop", False, "worker 1 stopped answering"),
        # the store's host falls silent (a cut link, a host gone): the store itself is named, never a hang
        (0, "stop", False, "the rendezvous store at 127.0.0.1:"),
    ],
)
def test_a_dead_or_silent_worker_is_named_on_the_survivor_within_the_timeout(victim, how, shared_memory, named):
    port = free_port()
    envs = [fleetrun_env(r, 2, port) for r in range(2)]
    outcome = run_processes(dying_worker, envs, victim, how, shared_memory, timeout=45, wait_for=[1 - victim])
    survivor = 1 - victim
    status, value = outcome[survivor]
    assert status == "ok", value
    import io

    kind, message, seconds = torch.load(io.BytesIO(value), weights_only=False)
    assert kind == "PeerError", message
    # It fails in the round's header exchange or in a bucket's all-reduce, depending on timing.
    assert "all-reduce of gradient bucket" in message or "agreeing on the next collective" in message, message
    assert named in message, message
    assert seconds < 3 + 10


def optimizer_state_worker(rank):
    import fleet

    fleet.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    inner = torch.optim.Adam(model.parameters(), lr=0.1)
    if rank == 0:  # only worker 0 resumed from a checkpoint: it has Adam moments, the other none
        model(torch.randn(2, 3)).sum().backward()
        inner.step()
    opt = fleet.distributed_optimizer(inner)
    state = opt.state_dict()["state"]
    fleet.stop_worker()
    return {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()} for k, s in state.items()}


@pytest.mark.timeout(60)
def test_optimizer_state_is_broadcast_from_worker_zero():
    port = free_port()
    outcome = run_processes(optimizer_state_worker, [fleetrun_env(r, 2, port) for r in range(2)], timeout=45)
    import io

    states = [torch.load(io.BytesIO(v), weights_only=False) for status, v in outcome if status == "ok"]
    assert len(states) == 2 and states[0].keys() == states[1].keys() and states[0]
    for key in states[0]:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(states[0][key][name], states[1][key][name])
