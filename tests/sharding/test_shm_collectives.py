"""CPU workers on one host run FSDP2's all-gathers and reduce-scatters through shared memory
(fleet.sharding.shm_collectives): the same training as one process, gloo for every worker when
/dev/shm refuses one of them, and a peer dying inside a collective named on the survivor."""

from __future__ import annotations

import io
import os
import time

import pytest
import torch
from tiny_gpt import VOCAB, TinyGPT
from torch import nn

from dist_harness import fleetrun_env, free_port, run_processes, run_workers

pytestmark = pytest.mark.multiprocess

WORKERS, STEPS = 3, 3


def gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(2)


def wide() -> nn.Module:
    """Units bigger than the GPT's: its first collective needs a larger segment."""
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64), nn.Tanh(), nn.Linear(64, 4))


def gpt_loss(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (4, 7), generator=torch.Generator().manual_seed(10 * step + rank))
    return nn.functional.cross_entropy(model(ids[:, :-1]).reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def wide_loss(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return nn.functional.cross_entropy(model(torch.randn(5, 64, generator=g)), torch.randint(0, 4, (5,), generator=g))


def _train(model: nn.Module, opt: torch.optim.Optimizer, loss_of, ranks: list[int]) -> None:
    for step in range(STEPS):
        opt.zero_grad()
        (sum(loss_of(model, step, r) for r in ranks) / len(ranks)).backward()
        opt.step()


def _collectives(model: nn.Module):
    return model._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm


def two_models_worker(rank: int) -> dict:
    import fleet
    from fleet.collective import shm

    fleet.init()
    strategy = fleet.DistributedStrategy(mode="sharding")
    model = gpt()
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), strategy)
    _train(model, opt, gpt_loss, [rank])
    gpt_state = {k: v.full_tensor() for k, v in model.state_dict().items()}
    shared = _collectives(model.layers[0]).collectives
    out = {"gpt": gpt_state, "gpt_comms": type(_collectives(model.layers[0])).__name__, "usable": shared.usable}
    # This worker's segments are mapped by every worker, so their names are gone from /dev/shm.
    out["left"] = [n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"{shared.token}-fsdp-{rank}-")]
    if rank == 1:  # /dev/shm is full here: the wide model's first collective needs a bigger segment

        def refuse(path: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
            raise OSError(28, "No space left on device")

        shm.create = refuse
    second = wide()
    opt2 = fleet.distributed_optimizer(torch.optim.SGD(second.parameters(), lr=0.1), strategy)
    _train(second, opt2, wide_loss, [rank])
    out["wide"] = [p.full_tensor() for p in second.parameters()]
    out["after_refusal"] = shared.usable
    fleet.stop_worker()
    return out


@pytest.mark.timeout(150)
def test_sharded_gpt_through_shared_memory_equals_one_process_and_a_refused_segment_falls_back_to_gloo() -> None:
    results = run_workers(two_models_worker, WORKERS, timeout=120)
    model = gpt()
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), gpt_loss, list(range(WORKERS)))
    second = wide()
    _train(second, torch.optim.SGD(second.parameters(), lr=0.1), wide_loss, list(range(WORKERS)))
    for rank, result in enumerate(results):
        assert result["gpt_comms"] == "SharedMemoryReduceScatter" and result["usable"], rank
        for name, value in model.state_dict().items():
            assert torch.allclose(result["gpt"][name], value, atol=1e-5), (rank, name)
        assert result["left"] == [], result["left"]
        assert result["after_refusal"] is False, "every worker went on through gloo together"
        for got, want in zip(result["wide"], second.parameters(), strict=True):
            assert torch.allclose(got, want, atol=1e-5), (rank, (got - want).abs().max())


def dying_worker(rank: int, victim: int, where: str):
    import fleet
    from fleet.sharding.shm_collectives import SharedMemoryCollectives

    fleet.init()
    model = gpt()
    opt = fleet.distributed_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), fleet.DistributedStrategy(mode="sharding", timeout_s=20)
    )
    step = 0
    if rank == victim:
        original = getattr(SharedMemoryCollectives, where)

        def die_at_step_one(self, *args, **kwargs):
            if step == 1:
                os._exit(3)  # inside the collective, after the announcement before it
            return original(self, *args, **kwargs)

        setattr(SharedMemoryCollectives, where, die_at_step_one)
    started = time.monotonic()
    try:
        for step in range(4):  # noqa: B007 - read by the victim's patched collective
            opt.zero_grad()
            gpt_loss(model, step, rank).backward()
            opt.step()
    except fleet.PeerError as error:
        return ("PeerError", str(error), time.monotonic() - started)
    return ("finished", "", time.monotonic() - started)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "victim, where, what",
    [
        (1, "reduce_scatter", "reduce-scatter of the gradients of sharded module"),
        (0, "all_gather", "all-gather of sharded module"),
    ],
)
def test_a_peer_dying_inside_a_shared_memory_collective_is_named(victim: int, where: str, what: str) -> None:
    port = free_port()
    envs = [fleetrun_env(r, 2, port) for r in range(2)]
    outcome = run_processes(dying_worker, envs, victim, where, timeout=60, wait_for=[1 - victim])
    status, value = outcome[1 - victim]
    assert status == "ok", value
    kind, message, seconds = torch.load(io.BytesIO(value), weights_only=False)
    assert kind == "PeerError", message
    assert what in message and f"worker {victim} died (its process is gone)" in message, message
    assert seconds < 15, "named within about a second, well before timeout_s=20"
