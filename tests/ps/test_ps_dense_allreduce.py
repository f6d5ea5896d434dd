"""Dense layers all-reduced beside the servers: ``DistributedStrategy(mode="ps", dense_placement="allreduce")``.

The servers hold only the sparse table; the MLP stays on the workers, averaged every step through
the workers' own process group. Sync: the job equals one process on the union of the workers'
batches. Async and geo: every worker's dense parameters are identical after every step. Backup
workers and restarts are refused with the reason; save_persistables/load_persistables carry the
dense parameters in worker 0's file.
"""

from __future__ import annotations

import io
import json
import secrets

import pytest
import torch

import fleet
from dist_harness import describe, free_port, run_processes
from ps_jobs import batch, make_model, make_optimizer, one_step, reference, run_job, snapshot

HYBRID = {"dense_placement": "allreduce"}


def run_hybrid(fn, servers: int, workers: int, strategy: dict, *args, extra_env=None, **options) -> list:
    """A PS job (ps_jobs.run_job) with the dense layers all-reduced, and the rendezvous address the workers'
    group needs."""
    env = {"FLEET_MASTER": f"127.0.0.1:{free_port()}", **(extra_env or {})}
    return run_job(fn, servers, workers, {**HYBRID, **strategy}, *args, extra_env=env, **options)


def _shift(rank: int, fn, servers: int, *args):
    """A server's index or a worker's, from the harness's process number (servers first)."""
    return fn(rank - servers if rank >= servers else rank, *args)


def _dense(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.mlp.parameters()]


def train(rank: int, opt_name: str, steps: int) -> dict:
    """Train; record the dense parameters after every step; report the servers' tables."""
    try:
        fleet.init()
    except SystemExit as stop:
        return {"served": stop.code}
    torch.manual_seed(100 + fleet.worker_index())  # differs per worker: worker 0's values must win
    model = make_model(opt_name)
    opt = fleet.distributed_optimizer(make_optimizer(opt_name, model.parameters()))
    after = []
    for step in range(steps):
        one_step(opt_name, model, opt, step, fleet.worker_index())
        after.append(_dense(model))
    fleet.barrier_worker()
    opt.refresh()  # geo: the servers' rows
    out = {
        "dense": after,
        "snapshot": snapshot(model),
        "tables": [t["kind"] for s in opt.client.stats().result() for t in s["tables"].values()],
        "group": torch.distributed.get_world_size() if torch.distributed.is_initialized() else 0,
    }
    fleet.stop_worker()
    return out


def _assert_same_dense_every_step(results: list[dict], steps: int) -> None:
    for step in range(steps):
        first = results[0]["dense"][step]
        for worker, result in enumerate(results[1:], start=1):
            for a, b in zip(first, result["dense"][step], strict=True):
                assert torch.equal(a, b), (step, worker)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("opt_name", "servers", "workers"), [("sgd", 1, 2), ("adam", 1, 2), ("sgd", 2, 3), ("adam", 1, 1)]
)
def test_sync_equals_one_process_on_the_union_of_the_batches(opt_name: str, servers: int, workers: int) -> None:
    steps = 4
    results = run_hybrid(train, servers, workers, {"update": "sync"}, opt_name, steps, timeout=110)
    for result in results:
        assert result["tables"] == ["sparse"] * servers, result["tables"]  # no dense table on any server
        # the workers' group: the servers are not ranks of it (one worker makes none)
        assert result["group"] == (workers if workers > 1 else 0)
    _assert_same_dense_every_step(results, steps)
    expected = reference(opt_name, steps, workers)
    for worker, result in enumerate(results):
        for name, value in result["snapshot"].items():
            torch.testing.assert_close(
                value, expected[name], rtol=0, atol=1e-6, msg=lambda m, n=name, w=worker: f"worker {w} {n}: {m}"
            )


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("update", ["async", "geo"])
def test_async_and_geo_keep_the_dense_layers_identical_after_every_step(update: str) -> None:
    steps = 6
    strategy = {"update": update, **({"k_steps": 2} if update == "geo" else {})}
    results = run_hybrid(train, 1, 2, strategy, "adam", steps, timeout=110)
    for result in results:
        assert result["tables"] == ["sparse"], result["tables"]
    _assert_same_dense_every_step(results, steps)
    start = make_model("adam")  # the dense layers trained (they are not worker 0's initial values)
    assert not torch.equal(results[0]["dense"][-1][0], _dense(start)[0])
    if update == "async":  # geo workers keep their cached rows (their own changes since the last sync)
        rows = [r["snapshot"]["rows"] for r in results]
        assert torch.equal(rows[0], rows[1]) and rows[0].abs().sum() > 0  # the servers' rows, after the barrier


def save_then_resume(rank: int, dirname: str, phase: str) -> dict:
    """``phase="save"``: 3 steps, save, 2 more steps. ``"load"``: a fresh start loads the save, then the same 2 steps."""
    try:
        fleet.init()
    except SystemExit as stop:
        return {"served": stop.code}
    torch.manual_seed(7 + fleet.worker_index() + (50 if phase == "load" else 0))
    model = make_model("adam")
    opt = fleet.distributed_optimizer(make_optimizer("adam", model.parameters()))
    if phase == "save":
        for step in range(3):
            one_step("adam", model, opt, step, fleet.worker_index())
        fleet.save_persistables(dirname)
    else:
        fleet.load_persistables(dirname)
    for step in range(3, 5):
        one_step("adam", model, opt, step, fleet.worker_index())
    fleet.barrier_worker()
    out = {"snapshot": snapshot(model)}
    fleet.stop_worker()
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_save_and_load_persistables_carry_the_dense_layers(tmp_path) -> None:
    dirname = str(tmp_path / "ckpt")
    saved = run_hybrid(save_then_resume, 1, 2, {"update": "sync"}, dirname, "save", timeout=70)
    resumed = run_hybrid(save_then_resume, 1, 2, {"update": "sync"}, dirname, "load", timeout=70)
    for name, value in saved[0]["snapshot"].items():  # the same 2 steps from the same state: the same result
        torch.testing.assert_close(resumed[0]["snapshot"][name], value, rtol=0, atol=1e-6)
        torch.testing.assert_close(resumed[1]["snapshot"][name], value, rtol=0, atol=1e-6)


def load_into_servers_placement(rank: int, dirname: str) -> dict:
    try:
        fleet.init()
    except SystemExit as stop:
        return {"served": stop.code}
    model = make_model("adam")
    opt = fleet.distributed_optimizer(make_optimizer("adam", model.parameters()))  # noqa: F841 - held: it saves
    try:
        fleet.load_persistables(dirname)
    except fleet.FleetError as error:
        out = {"error": str(error)}
    else:
        out = {"error": None}
    fleet.stop_worker()
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_save_loads_only_under_the_placement_it_was_written_with(tmp_path) -> None:
    from ps_jobs import run_job

    dirname = str(tmp_path / "ckpt")
    run_hybrid(save_then_resume, 1, 2, {"update": "sync"}, dirname, "save", timeout=70)
    results = run_job(load_into_servers_placement, 1, 2, {"update": "sync"}, dirname, timeout=70)
    for result in results:
        assert "was saved with dense_placement='allreduce'" in result["error"], result
        assert "this job has dense_placement='servers'" in result["error"], result


def test_backup_workers_and_other_modes_are_refused_with_the_reason() -> None:
    with pytest.raises(
        fleet.StrategyError,
        match=r"backup_workers=1 cannot be combined with dense_placement='allreduce': the dense layers' all-reduce waits for every worker",
    ):
        fleet.DistributedStrategy(mode="ps", update="sync", backup_workers=1, dense_placement="allreduce")
    with pytest.raises(fleet.StrategyError, match=r"dense_placement applies to mode='ps' only"):
        fleet.DistributedStrategy(mode="collective", dense_placement="allreduce")
    with pytest.raises(fleet.StrategyError, match=r"dense_placement = 'workers' is not allowed"):
        fleet.DistributedStrategy(mode="ps", dense_placement="workers")


def init_only(rank: int) -> dict:
    try:
        fleet.init()
    except SystemExit as stop:
        return {"served": stop.code}
    except fleet.StrategyError as error:
        return {"error": str(error)}
    fleet.stop_worker()
    return {"error": None}


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_restarts_are_refused_at_init_on_every_process_with_the_reason() -> None:
    outcome = run_processes(
        _shift,
        [
            {
                "FLEET_SECRET": "ab" * 16,
                "FLEET_SERVER_NUM": "1",
                "FLEET_SERVER_ENDPOINTS": f"127.0.0.1:{free_port()}",
                "FLEET_WORKER_NUM": "2",
                "FLEET_MASTER": f"127.0.0.1:{free_port()}",
                "FLEET_MAX_RESTARTS": "2",
                "FLEET_STRATEGY": json.dumps({"mode": "ps", "update": "async", **HYBRID}),
                "FLEET_ROLE": role,
                **({"FLEET_SERVER_INDEX": "0"} if role == "server" else {"FLEET_WORKER_INDEX": str(index)}),
            }
            for role, index in [("server", 0), ("worker", 0), ("worker", 1)]
        ],
        init_only,
        1,
        timeout=50,
    )
    assert all(status == "ok" for status, _ in outcome), outcome
    for _, value in outcome:
        error = torch.load(io.BytesIO(value), weights_only=False)["error"]
        assert "dense_placement='allreduce' cannot run with restarts (FLEET_MAX_RESTARTS=2" in error, error
        assert "cannot rejoin the workers' process group" in error, error


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_under_torchrun_variables_the_first_rank_serves_and_the_workers_group_leaves_it_out() -> None:
    """A rank-only launch (torchrun's variables, ``servers=1``): rank 0 is the server and hosts the store."""
    common = {
        "FLEET_SECRET": secrets.token_hex(16),
        "WORLD_SIZE": "3",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "FLEET_STRATEGY": json.dumps({"mode": "ps", "servers": 1, "update": "sync", "timeout_s": 30, **HYBRID}),
    }
    envs = [{**common, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(3)]
    outcome = run_processes(train, envs, "sgd", 3, timeout=100)
    assert all(status == "ok" for status, _ in outcome), describe(outcome, ["server 0", "worker 0", "worker 1"])
    values = [torch.load(io.BytesIO(value), weights_only=False) for _, value in outcome]
    assert values[0] == {"served": 0}
    workers = values[1:]
    assert [w["group"] for w in workers] == [2, 2] and workers[0]["tables"] == ["sparse"]
    _assert_same_dense_every_step(workers, 3)
    expected = reference("sgd", 3, 2)
    for name, value in workers[1]["snapshot"].items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6)


def accumulate(rank: int, steps: int) -> dict:
    """Two micro-batches a step: the first backward inside ``model.no_sync()`` (kept local), the second reduced."""
    try:
        fleet.init()
    except SystemExit as stop:
        return {"served": stop.code}
    torch.manual_seed(100 + fleet.worker_index())
    model = fleet.distributed_model(make_model("sgd"))
    opt = fleet.distributed_optimizer(make_optimizer("sgd", model.parameters()))
    loss_fn = torch.nn.BCEWithLogitsLoss()
    for step in range(steps):
        opt.zero_grad()
        for micro in range(2):
            ids, dense, label = batch(2 * step + micro, fleet.worker_index())
            if micro == 0:
                with model.no_sync():
                    loss_fn(model(ids, dense), label).backward()
            else:
                loss_fn(model(ids, dense), label).backward()
        opt.step()
    fleet.barrier_worker()
    out = {"snapshot": snapshot(model)}
    fleet.stop_worker()
    return out


def accumulated_reference(steps: int, workers: int) -> dict:
    torch.manual_seed(100)
    model = make_model("sgd")
    opt = make_optimizer("sgd", model.parameters())
    loss_fn = torch.nn.BCEWithLogitsLoss()
    for step in range(steps):
        opt.zero_grad()
        for micro in range(2):
            parts = [batch(2 * step + micro, r) for r in range(workers)]
            ids, dense, label = (torch.cat([p[i] for p in parts]) for i in range(3))
            loss_fn(model(ids, dense), label).backward()
        opt.step()
    return snapshot(model)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_micro_batches_under_no_sync_equal_one_process_on_the_union() -> None:
    results = run_hybrid(accumulate, 1, 2, {"update": "sync"}, 3, timeout=100)
    expected = accumulated_reference(3, 2)
    for worker, result in enumerate(results):
        for name, value in result["snapshot"].items():
            torch.testing.assert_close(
                value, expected[name], rtol=0, atol=1e-6, msg=lambda m, n=name, w=worker: f"worker {w} {n}: {m}"
            )


def uneven(rank: int, steps: int) -> dict:
    """``fleet.join()`` is refused; then worker 1 runs one step more than worker 0."""
    try:
        fleet.init()
    except SystemExit as stop:
        return {"served": stop.code}
    model = make_model("sgd")
    opt = fleet.distributed_optimizer(make_optimizer("sgd", model.parameters()))
    try:
        fleet.join()
    except fleet.FleetError as error:
        refused = str(error)
    else:
        refused = None
    try:
        for step in range(steps + fleet.worker_index()):
            one_step("sgd", model, opt, step, fleet.worker_index())
        fleet.stop_worker()
    except fleet.PeerError as error:
        return {"refused": refused, "error": str(error)}
    return {"refused": refused, "error": None}


@pytest.mark.slow  # waits out an uneven end: the slow set keeps the README suite under 10 min
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_uneven_loops_fail_naming_the_worker_that_finished_and_fleet_join_is_refused() -> None:
    results = run_hybrid(uneven, 1, 2, {"update": "async"}, 3, timeout=100, served=1)  # the job failed
    for result in results:
        assert "fleet.join() is not supported with dense_placement='allreduce'" in result["refused"], result
    errors = [r["error"] for r in results if r["error"]]
    assert errors and all("worker 0 (after 3 steps) finished its training loop early" in e for e in errors), results
