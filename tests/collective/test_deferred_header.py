"""A round's header travels while backward computes; the agreement still comes before anything it decides.

The round's header exchange starts at the first gradient of a backward and is waited for just
before the first bucket launches, at the end of backward, or before any other collective this
worker starts meanwhile. Each way must keep single-process math, and a disagreement must still
be raised, naming what differs, before any collective that depends on the agreement.
"""

from __future__ import annotations

import pytest
import torch

from dist_harness import run_workers

pytestmark = pytest.mark.multiprocess  # every test here starts processes

BATCH = 8


class Trunk(torch.nn.Module):
    """A constant buffer in the math: a distributed_model broadcasts buffers before each forward."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.lin = torch.nn.Linear(d_in, d_out)
        self.register_buffer("k", torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * self.k


def batch(worker: int, step: int, d_in: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + worker)
    return torch.randn(BATCH, d_in, generator=generator), torch.randint(0, 3, (BATCH,), generator=generator)


def checkpointed_models(seed: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(seed)
    return Trunk(6, 16), torch.nn.Linear(16, 3)


def checkpointed_loss(trunk, head, x, y) -> torch.Tensor:
    from torch.utils.checkpoint import checkpoint

    # The trunk's forward runs again inside backward, after the head's gradients started the round:
    # its buffer broadcast is a collective started while the round's header is in flight.
    return torch.nn.functional.cross_entropy(head(checkpoint(trunk, x, use_reentrant=False)), y)


def checkpointed_worker(rank: int, shared_memory: bool) -> dict:
    import fleet

    fleet.init(strategy=fleet.DistributedStrategy(shared_memory=shared_memory, timeout_s=30))
    trunk, head = checkpointed_models(seed=rank)  # different initial weights: worker 0's win
    trunk = fleet.distributed_model(trunk)
    opt = fleet.distributed_optimizer(torch.optim.SGD([*trunk.parameters(), *head.parameters()], lr=0.1))
    for step in range(2):
        opt.zero_grad()
        checkpointed_loss(trunk, head, *batch(rank, step, 6)).backward()
        opt.step()
    params = [p.detach().clone() for p in [*trunk.parameters(), *head.parameters()]]
    # Worker 1 waits in barrier_worker() while worker 0 runs backward: worker 0's header is in flight when
    # the recomputed forward wants to broadcast buffers, and the disagreement must come first.
    error = ""
    try:
        x, y = batch(rank, 2, 6)
        if rank == 0:
            checkpointed_loss(trunk, head, x, y).backward()
        else:
            with torch.no_grad():
                trunk(x)  # the forward's buffer broadcast pairs with worker 0's
            fleet.barrier_worker()
    except fleet.PeerError as caught:
        error = str(caught)
    fleet.stop_worker()
    return {"params": params, "error": error}


def checkpointed_reference(workers: int) -> list[torch.Tensor]:
    trunk, head = checkpointed_models(seed=0)
    opt = torch.optim.SGD([*trunk.parameters(), *head.parameters()], lr=0.1)
    for step in range(2):
        opt.zero_grad()
        xs, ys = zip(*(batch(w, step, 6) for w in range(workers)), strict=True)
        torch.nn.functional.cross_entropy(head(trunk(torch.cat(xs))), torch.cat(ys)).backward()
        opt.step()
    return [p.detach() for p in [*trunk.parameters(), *head.parameters()]]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shared_memory", [False, True], ids=["process-group", "shm"])
def test_a_collective_started_while_the_header_is_in_flight_waits_for_the_agreement(shared_memory):
    results = run_workers(checkpointed_worker, 2, shared_memory, timeout=90)
    expected = checkpointed_reference(2)
    for result in results:
        for got, want in zip(result["params"], expected, strict=True):
            assert torch.allclose(got, want, atol=1e-6), (got, want)
    for result in results:
        message = result["error"]
        # Both name the round and the barrier: worker 0 did not pair its buffer broadcast with anything.
        assert message.startswith("Workers issued different collectives"), message
        assert "worker 0 about to all-reduce gradients (backward)" in message, message
        assert "worker 1 about to wait in fleet.barrier_worker()" in message, message


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3)
    )


def buckets_worker(rank: int) -> dict:
    import fleet

    # ~4 KB buckets: the last two layers fill the first bucket, which is ready while layer 0's gradient is
    # still to come, so the round's agreement is waited for inside backward, at that bucket.
    fleet.init(strategy=fleet.DistributedStrategy(bucket_mb=0.004, shared_memory=False, timeout_s=30))
    model = _mlp(seed=rank)
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for step in range(2):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(batch(rank, step, 32)[0]), batch(rank, step, 32)[1]).backward()
        opt.step()
    params = [p.detach().clone() for p in model.parameters()]
    if rank == 1:
        model[0].requires_grad_(False)  # only worker 1 freezes the first layer
    error = ""
    try:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(batch(rank, 2, 32)[0]), batch(rank, 2, 32)[1]).backward()
    except fleet.PeerError as caught:
        error = str(caught)
    fleet.stop_worker()
    return {"params": params, "error": error}


@pytest.mark.timeout(120)
def test_a_disagreement_found_at_the_first_bucket_names_the_parameter_and_the_workers():
    results = run_workers(buckets_worker, 2, timeout=90)
    model = _mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        opt.zero_grad()
        xs, ys = zip(*(batch(w, step, 32) for w in range(2)), strict=True)
        torch.nn.functional.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    for result in results:
        for got, want in zip(result["params"], model.parameters(), strict=True):
            assert torch.allclose(got, want.detach(), atol=1e-6)
        message = result["error"]
        assert "'0.weight' requires grad on worker 0 but is frozen on worker 1" in message, message
