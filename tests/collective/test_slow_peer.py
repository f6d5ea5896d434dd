"""Slow is not dead: a worker busy alone (rank-0-only evaluation) is waited for while its heartbeat beats, and
reported as alive and late past the wait; a stopped worker is still named within the heartbeat's bound."""

from __future__ import annotations

import io
import os
import time

import pytest
import torch

from dist_harness import fleetrun_env, free_port, run_processes

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # waits out timeouts: the slow set (.ci/run)


def _worker(rank: int, timeout_s: float | None, shared_memory: bool, busy: str) -> tuple[str, str, float]:
    import signal

    import fleet

    options = {"shared_memory": shared_memory} if timeout_s is None else {"timeout_s": timeout_s}
    options["shared_memory"] = shared_memory
    fleet.init(strategy=fleet.DistributedStrategy(**options))
    model = torch.nn.Linear(4, 4)
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    started = time.monotonic()
    try:
        for step in range(3):
            if step == 1 and busy == "evaluate" and rank == 0:
                time.sleep(8)  # worker 0 evaluates alone; its heartbeat thread beats on
            if step == 1 and busy == "stop" and rank == 1:
                os.kill(os.getpid(), signal.SIGSTOP)
            if step == 1 and busy == "pause" and rank == 0:  # off the CPU for 9 s, heartbeat included
                import subprocess

                subprocess.Popen(["sh", "-c", f"kill -STOP {os.getpid()}; sleep 9; kill -CONT {os.getpid()}"])
                time.sleep(1)
            opt.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
    except fleet.PeerError as error:
        return ("PeerError", str(error), time.monotonic() - started)
    return ("finished", "", time.monotonic() - started)


def _run(timeout_s, shared_memory, busy, wait_for, **extra):
    port = free_port()
    envs = [fleetrun_env(r, 2, port, **extra) for r in range(2)]
    outcome = run_processes(_worker, envs, timeout_s, shared_memory, busy, timeout=60, wait_for=wait_for)
    return [torch.load(io.BytesIO(v), weights_only=False) if s == "ok" else (s, v, 0) for s, v in outcome]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("shared_memory", [True, False])
def test_a_worker_evaluating_alone_is_waited_for_by_default(shared_memory):
    for kind, message, seconds in _run(None, shared_memory, "evaluate", [0, 1]):
        assert kind == "finished", message
        assert seconds > 7  # worker 1 waited out worker 0's 8 s, asking the heartbeats on the way


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["field", "env"])
def test_past_the_timeout_a_live_worker_is_reported_alive_and_late(how):
    extra = {"FLEET_TIMEOUT_S": "3"} if how == "env" else {}
    kind, message, seconds = _run(3 if how == "field" else None, True, "evaluate", [1], **extra)[1]
    assert kind == "PeerError"
    assert "worker 0 is alive but has not reached the next collective for 3 s" in message, message
    assert "rank-0-only evaluation or saving? raise timeout_s (strategy field, or FLEET_TIMEOUT_S)" in message
    assert seconds < 8  # not the whole evaluation: the deadline, then one look at the heartbeats


@pytest.mark.timeout(90)
def test_a_stopped_worker_is_named_within_the_heartbeats_bound_whatever_the_default_wait():
    kind, message, seconds = _run(None, True, "stop", [0])[0]
    assert kind == "PeerError" and "worker 1 stopped answering" in message, message
    assert seconds < 20  # the collective wait is 30 minutes; the heartbeats name it first


@pytest.mark.timeout(90)
def test_a_worker_paused_for_longer_than_one_heartbeat_window_is_waited_for():
    """Issue 34: worker 0 stopped for 9 s (the 5 s probe and one 2.5 s window of a standing heartbeat) was judged
    dead by worker 1, which gave up and exited, and worker 0, alive, then reported worker 1's death. A peer is dead
    only when its heartbeat stands still in two windows in a row."""
    for kind, message, seconds in _run(None, True, "pause", [0, 1]):
        assert kind == "finished", message
        assert seconds > 8
