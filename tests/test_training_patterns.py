"""Everyday training code equals single-process training on the union of the batches (issue 8's table).

Each job runs every scenario of :mod:`patterns` with SGD (momentum, weight decay) and Adam in
one set of processes, so the whole table costs a few process starts. Each scenario starts
every worker from different initial values (worker 0's must win) and is compared, parameter
by parameter, within 1e-5, together with which gradients are ``None`` at the end.
"""

from __future__ import annotations

import functools

import patterns
import pytest
import torch
from ps_jobs import run_job

from dist_harness import run_workers

CASES = [(name, kind) for name, s in patterns.SCENARIOS.items() for kind in s.kinds]
PS_CASES = [(name, kind) for name, kind in CASES if patterns.SCENARIOS[name].ps]


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
        out[name, kind] = patterns.distributed(name, kind, rank, workers, fleet.distributed_optimizer)
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
    want = patterns.reference(name, kind, workers)
    if not grads:  # parameter server: a worker's .grad is its own; the servers average them
        want = {k: v for k, v in want.items() if not k.endswith(".grad_is_none")}
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
