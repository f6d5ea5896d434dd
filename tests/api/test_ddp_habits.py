"""DDP habits under fleet: ``no_sync()`` on the model and on the optimizer (gradient accumulation equal to a
single process's), and ``model.module``."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from dist_harness import run_workers
from ps_jobs import run_job

WORKERS, STEPS, MICRO = 2, 3, 3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(4, 6, generator=g), torch.randint(0, 2, (4,), generator=g)


def _reference() -> list[torch.Tensor]:
    """One process, accumulating MICRO micro-batches per step, each the union of the workers' micro-batches."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(MICRO):
            x, y = (torch.cat(t) for t in zip(*(_batch(r, step, micro) for r in range(WORKERS)), strict=True))
            (torch.nn.functional.cross_entropy(model(x), y) / MICRO).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _worker(rank: int, where: str) -> dict:
    import fleet
    import fleet.api

    try:
        fleet.init()
    except SystemExit as stop:  # a parameter server: served, then exited
        return {"served": stop.code}
    model = fleet.distributed_model(_model())
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    holder = model if where == "model" else opt
    sync = getattr(fleet.runtime.context.strategy(), "sync", None)
    rounds = []
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(MICRO):
            x, y = _batch(fleet.worker_index(), step, micro)
            loss = torch.nn.functional.cross_entropy(model(x), y) / MICRO
            if micro < MICRO - 1:
                with holder.no_sync():  # DDP's idiom: no communication until the last micro-batch
                    loss.backward()
            else:
                loss.backward()
        opt.step()
        if callable(sync):
            rounds.append(sync().rounds)
    sharded = fleet.runtime.context.strategy().name == "sharding"
    out = {
        "params": [(p.full_tensor() if sharded else p).detach().clone() for p in model.parameters()],
        "rounds": rounds,
        "module_is_model": model.module is model,
        "keys": list(model.module.state_dict()),
        # (FSDP2's dynamic classes are not picklable in the first place)
        "picklable": sharded or (len(pickle.dumps(model)) > 0 and copy.deepcopy(model).module is not model),
    }
    fleet.stop_worker()
    return out


def _check(results: list[dict]) -> None:
    reference = _reference()
    for result in results:
        for ours, theirs in zip(result["params"], reference, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
        assert result["module_is_model"] and result["picklable"]
        assert result["keys"] == ["0.weight", "0.bias", "2.weight", "2.bias"]  # no "module." prefix


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["model", "optimizer"])
def test_collective_no_sync_accumulates_like_one_process_and_communicates_once_per_step(where):
    results = run_workers(_worker, WORKERS, where)
    _check(results)
    for result in results:
        assert result["rounds"] == list(range(1, STEPS + 1))  # one gradient round per step, not per micro-batch


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_parameter_server_no_sync_accumulates_like_one_process():
    _check(run_job(_worker, 1, WORKERS, {"update": "sync"}, "model"))


def test_one_process_has_the_habits_too():
    import fleet
    import fleet.api

    fleet.api._reset_for_tests()
    fleet.init()
    try:
        model = fleet.distributed_model(_model())
        assert model.module is model
        with model.no_sync():
            pass
        own = torch.nn.Module()
        own.module = torch.nn.Linear(1, 1)  # a model with its own submodule called "module" keeps it
        assert isinstance(fleet.distributed_model(own).module, torch.nn.Linear)
    finally:
        fleet.stop_worker()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_sharding_no_sync_accumulates_like_one_process():
    _check(run_workers(_worker, WORKERS, "model", FLEET_STRATEGY='{"mode": "sharding"}'))
