"""Everyday training code equals single-process training on the union of the batches (issue 8's table).

Each job runs every scenario of :mod:`patterns` with SGD (momentum, weight decay) and Adam in
one set of processes, so the whole table costs a few process starts. Each scenario starts
every worker from different initial values (worker 0's must win) and is compared, parameter
by parameter, within 1e-5, together with which gradients are ``None`` at the end.
"""

from __future__ import annotations

import functools

import pytest
import torch

import patterns
from dist_harness import run_workers
from ps_jobs import run_job

CASES = [(name, kind) for name, s in patterns.SCENARIOS.items() for kind in s.kinds]
PS_CASES = [(name, kind) for name, kind in CASES if kind in patterns.SCENARIOS[name].ps_kinds]


def collective_worker(rank: int, cases: list, workers: int) -> dict:
    import fleet

    fleet.init()
    strategy = fleet.DistributedStrategy(bucket_mb=0.0005, timeout_s=60)  # several buckets per model
    out = {}
    for name, kind in cases:
        out[name, kind] = patterns.distributed(
            name, kind, rank, workers, lambda opt: fleet.distributed_optimizer(opt, strategy)
        )
    fleet.stop_worker()
    return out


def ps_worker(rank: int, cases: list, workers: int) -> dict:
    import fleet

    try:
        fleet.init()
    except SystemExit as stop:  # a server: fleet.init served, then exited the process
        return {"served": stop.code}
    out = {}
    for name, kind in cases:
        try:
            out[name, kind] = patterns.distributed(name, kind, rank, workers, fleet.distributed_optimizer)
        except fleet.FleetError as error:  # refused (every worker at the same step, before pushing anything)
            out[name, kind] = {"refused": str(error)}
        fleet.barrier_worker()
    fleet.stop_worker()
    return out


@functools.cache
def collective_results(workers: int) -> list[dict]:
    return run_workers(collective_worker, workers, CASES, workers, timeout=240)


@functools.cache
def ps_results(workers: int) -> list[dict]:
    return run_job(ps_worker, 1, workers, {"update": "sync"}, PS_CASES, workers, timeout=240)


def _check(results: list[dict], name: str, kind: str, workers: int, grads: bool = True) -> None:
    refused = None if grads else patterns.SCENARIOS[name].ps_refused
    if refused is not None:  # the parameter server cannot do it as one process would: it must say so
        for rank, result in enumerate(results):
            assert refused in result[name, kind].get("refused", ""), f"worker {rank}, {name} with {kind}: {result}"
        return
    want = patterns.reference(name, kind, workers)
    if not grads:  # parameter server: a worker's .grad is its own; the servers average them
        want = {k: v for k, v in want.items() if not k.endswith((".grad_is_none", ".grad"))}
    for rank, result in enumerate(results):
        problems = patterns.compare(result[name, kind], want)
        assert not problems, f"worker {rank} of {workers}, {name} with {kind}: " + "; ".join(problems)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize(("name", "kind"), CASES)
def test_collective_equals_single_process(workers: int, name: str, kind: str) -> None:
    _check(collective_results(workers), name, kind, workers)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("name", "kind"), PS_CASES)
def test_ps_sync_equals_single_process(name: str, kind: str) -> None:
    _check(ps_results(2), name, kind, 2, grads=False)


def test_reference_sees_the_patterns() -> None:
    """The scenarios exercise what they claim: gradients stay None where nobody used a parameter."""
    branch = patterns.reference("unused_branch", "sgd", 2)
    assert branch["head_c.weight.grad_is_none"] and not branch["head_a.weight.grad_is_none"]
    frozen = patterns.reference("frozen_mid_training", "sgd", 2)
    assert frozen["trunk.weight.grad_is_none"]
    torch.manual_seed(patterns.SEED)
    untouched = patterns.SCENARIOS["unused_branch"].build("sgd")
    assert torch.equal(branch["head_c.weight"], untouched.head_c.weight.detach())


# --- workers that disagree fail at once, naming the parameter and the workers -----------------------


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def disagreeing_worker(rank: int, what: str) -> tuple[str, str, float]:
    import time

    import fleet

    try:
        fleet.init()  # the strategy comes from FLEET_STRATEGY
    except SystemExit as stop:  # a parameter server
        return ("served", str(stop.code), 0.0)
    torch.manual_seed(patterns.SEED + rank)
    model = _net()
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    started = time.monotonic()
    try:
        for step in range(4):
            if step == 2 and rank == 1:
                if what == "unfreeze":
                    model[0].requires_grad_(False)  # only worker 1 freezes the first layer
                else:  # a new layer whose values differ, added behind the wrapper's back
                    extra = torch.nn.Linear(2, 2)
                    opt.inner.add_param_group({"params": list(extra.parameters())})
            if step == 2 and rank != 1 and what == "inner":
                torch.manual_seed(rank)
                opt.inner.add_param_group({"params": list(torch.nn.Linear(2, 2).parameters())})
            opt.zero_grad()
            x, y = patterns.batch(rank, step)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    except (fleet.PeerError, fleet.FleetError) as error:
        return (type(error).__name__, str(error), time.monotonic() - started)
    return ("finished", "", time.monotonic() - started)


def _outcomes(outcome: list) -> list[tuple[str, str, float]]:
    import io

    return [torch.load(io.BytesIO(value), weights_only=False) for status, value in outcome if status == "ok"]


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("what", "kind", "expected"),
    [
        ("unfreeze", "PeerError", "'0.weight' requires grad on worker 0 but is frozen on worker 1"),
        ("inner", "FleetError", "hold different values on different workers"),  # added behind the wrapper's back
    ],
)
def test_collective_workers_that_disagree_fail_naming_parameter_and_workers(what, kind, expected):
    from dist_harness import fleetrun_env, free_port, run_processes

    port = free_port()
    envs = [fleetrun_env(r, 2, port, FLEET_STRATEGY='{"timeout_s": 60}') for r in range(2)]
    outcome = run_processes(disagreeing_worker, envs, what, timeout=60)
    results = _outcomes(outcome)
    assert len(results) == 2, outcome
    for got, message, seconds in results:
        assert got == kind and expected in message, message
        assert seconds < 20


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
@pytest.mark.parametrize("what", ["unfreeze", "inner"])
def test_ps_sync_workers_that_disagree_fail_naming_the_parameter(what):
    import json
    import secrets

    from dist_harness import free_port, run_processes
    from ps_jobs import _shift

    common = {
        "FLEET_SECRET": secrets.token_hex(16),
        "FLEET_SERVER_NUM": "1",
        "FLEET_SERVER_ENDPOINTS": f"127.0.0.1:{free_port()}",
        "FLEET_WORKER_NUM": "2",
        "FLEET_STRATEGY": json.dumps({"mode": "ps", "update": "sync", "timeout_s": 60}),
    }
    envs = [{**common, "FLEET_ROLE": "server", "FLEET_SERVER_INDEX": "0"}]
    envs += [{**common, "FLEET_ROLE": "worker", "FLEET_WORKER_INDEX": str(r)} for r in range(2)]
    # With differing added values only worker 1 can tell (it compares with worker 0's): wait for it alone.
    outcome = run_processes(
        _shift, envs, disagreeing_worker, 1, what, timeout=60, wait_for=[1, 2] if what == "unfreeze" else [2]
    )
    workers = _outcomes(outcome[1:])
    assert workers, outcome
    if what == "unfreeze":
        for kind, message, seconds in workers:
            assert kind == "FleetError", message
            assert "'0.weight' trains (requires_grad=True) on worker 0 but is frozen on worker 1" in message, message
            assert seconds < 20
    else:  # worker 1 added values that differ from worker 0's: it is told so
        kind, message, _ = workers[-1]
        assert kind == "FleetError" and "hold different values on worker 1 than on worker 0" in message, message
