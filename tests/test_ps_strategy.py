"""Parameter-server strategy end to end: servers and workers as processes with fleetrun's environment."""

from __future__ import annotations

import pytest
import torch
from ps_jobs import reference, run_job, train


def _assert_matches(results: list, ref: dict) -> None:
    for worker, result in enumerate(results):
        for name, want in ref.items():
            got = result["snapshot"][name]
            assert torch.allclose(got, want, atol=1e-5), f"worker {worker} {name}: {(got - want).abs().max()}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("opt_name", "servers", "workers"), [("sgd", 1, 2), ("adam", 2, 3)])
def test_sync_equals_single_process_on_union(opt_name: str, servers: int, workers: int) -> None:
    results = run_job(train, servers, workers, {"update": "sync"}, opt_name, 6)
    _assert_matches(results, reference(opt_name, 6, workers))
