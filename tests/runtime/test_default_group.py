"""A script that calls torch.distributed.init_process_group itself inside a fleet job gets a clear answer.

Before fleet.init(): a collective job adopts the group when its ranks are the job's workers (and
trains as one process would), else refuses it naming what to remove; a parameter-server job
refuses it. After fleet.init(): torch's own "twice" error is explained by fleet's exception hook
(the parameter-server side of that order is in tests/ps/test_table_names.py).
"""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fleet
import fleet.api
from dist_harness import clean_env, fleetrun_command, free_port, run_workers
from fleet.errors import UserProcessGroupError
from fleet.runtime import default_group

LAUNCH_VARIABLES = ("FLEET_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "PADDLE_", "TRAINING_ROLE")


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith(LAUNCH_VARIABLES):
            monkeypatch.delenv(name)
    fleet.api._reset_for_tests()
    yield
    fleet.api._reset_for_tests()


def _user_group() -> None:
    """What a script's own distributed mode does: a default group (here of one process)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0)


def _launch(monkeypatch, workers: int, servers: int = 0, strategy: str | None = None) -> None:
    values = {
        "FLEET_ROLE": "worker",
        "FLEET_WORKER_INDEX": "0",
        "FLEET_WORKER_NUM": str(workers),
        "FLEET_SERVER_NUM": str(servers),
        "FLEET_SERVER_ENDPOINTS": ",".join(f"127.0.0.1:{free_port()}" for _ in range(servers)),
        "FLEET_MASTER": f"127.0.0.1:{free_port()}",
        "FLEET_SECRET": "ab" * 16,
    }
    if strategy is not None:
        values["FLEET_STRATEGY"] = strategy
    for key, value in values.items():
        monkeypatch.setenv(key, value)


def test_a_group_fleet_did_not_make_is_found_and_described():
    assert default_group.found() is None
    _user_group()
    found = default_group.found()
    assert found == default_group.FoundGroup(1, 0, "gloo")
    assert found.describe() == "a default process group of world size 1 (this process has rank 0, backend gloo)"
    twice = ValueError("trying to initialize the default process group twice!")
    assert default_group.explain_twice(twice) is None  # the script's own group met the script's own call
    default_group.made_by_fleet("this collective job (mode='collective'; this process is worker 0 of 1 workers)")
    assert default_group.found() is None
    explained = default_group.explain_twice(twice)
    assert "init_process_group was called after fleet.init()" in explained and "mode='collective'" in explained
    assert "Remove the call" in explained and "migrating-from-ddp.md" in explained
    assert default_group.explain_twice(ValueError("another error")) is None


@pytest.mark.timeout(60)
def test_a_collective_job_refuses_a_group_whose_ranks_are_not_its_workers(monkeypatch):
    _user_group()  # one process, but the launch says two workers
    _launch(monkeypatch, workers=2)
    with pytest.raises(UserProcessGroupError) as error:
        fleet.init()
    message = str(error.value)
    assert "torch.distributed.init_process_group was called before fleet.init()" in message
    assert "collective job (mode='collective'; this process is worker 0 of 2 workers)" in message
    assert "world size 1" in message and "this job has 2 worker(s)" in message
    assert "Remove the init_process_group call" in message and "migrating-from-ddp.md" in message


@pytest.mark.timeout(60)
def test_a_parameter_server_job_refuses_a_group_made_before_fleet_init(monkeypatch):
    _user_group()
    _launch(monkeypatch, workers=1, servers=1, strategy='{"mode": "ps", "update": "sync"}')
    with pytest.raises(UserProcessGroupError) as error:
        fleet.init()  # refused before it connects to any server
    message = str(error.value)
    assert "init_process_group was called before fleet.init() in this parameter-server job" in message
    assert "mode='ps', update='sync'" in message and "WORLD_SIZE" in message
    assert "Remove the init_process_group call" in message


# --- a collective job, both orders --------------------------------------------------------------------------

STEPS, BATCH = 3, 8


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(BATCH, 4, generator=g), torch.randn(BATCH, 1, generator=g)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))


def _collective_worker(rank: int, port: int) -> dict:
    out: dict = {}
    # After fleet.init(), which made the default group: torch refuses, fleet's exception hook explains.
    fleet.init()
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank)
    except ValueError as error:
        stderr, sys.stderr = sys.stderr, io.StringIO()
        try:
            sys.excepthook(type(error), error, error.__traceback__)
        finally:
            printed, sys.stderr = sys.stderr.getvalue(), stderr
        out["twice"] = printed
    fleet.stop_worker()
    # Before fleet.init(), its ranks the job's workers: fleet trains over the same ranks.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank)
    fleet.init()
    model = _model(seed=rank)  # worker 0's values win
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for step in range(STEPS):
        x, y = _batch(step, rank)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    out["params"] = [p.detach().clone() for p in model.parameters()]
    out["adopted"] = default_group.found() is not None
    fleet.stop_worker()
    out["kept"] = dist.is_initialized()  # the script's group is the script's to destroy
    dist.destroy_process_group()
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_collective_job_explains_a_second_group_and_adopts_one_made_before_it():
    results = run_workers(_collective_worker, 2, free_port(), timeout=100)
    model = _model(seed=0)  # one process on the union of the workers' batches
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = (torch.cat(t) for t in zip(*(_batch(step, r) for r in range(2)), strict=True))
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    for result in results:
        assert "trying to initialize the default process group twice" in result["twice"]
        assert "fleet: torch.distributed.init_process_group was called after fleet.init()" in result["twice"]
        assert "collective job (mode='collective'" in result["twice"] and "Remove the call" in result["twice"]
        assert result["adopted"] and result["kept"]
        for got, want in zip(result["params"], model.parameters(), strict=True):
            torch.testing.assert_close(got, want.detach(), atol=1e-6, rtol=0)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["ps", "collective-after", "collective-before"])
def test_fleetrun_answers_a_script_whose_own_distributed_mode_torchruns_variables_switch_on(tmp_path, mode):
    """The reported case: fleetrun's WORLD_SIZE/RANK switched a script's own distributed mode on.

    A parameter-server job refuses it in one paragraph (exit status 2, also through the rank-prefixing
    exception hook torch.distributed installs); a collective job explains torch's "twice" error, and
    adopts a group made before fleet.init().
    """
    script = Path(__file__).resolve().parents[1] / "scripts" / "own_process_group.py"
    options = ["--workers", "2", "--log-dir", str(tmp_path / "logs")]
    args: tuple[str, ...] = ()
    if mode == "ps":
        strategy = tmp_path / "ps.toml"
        strategy.write_text('mode = "ps"\nupdate = "async"\ntimeout_s = 20\n')
        options += ["--servers", "1", "--strategy", str(strategy)]
    elif mode == "collective-after":
        args = ("--after",)
    command = fleetrun_command(*options, script=script, args=args)
    done = subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=100)
    output = done.stdout + done.stderr
    if mode == "collective-before":  # env:// on fleetrun's MASTER_ADDR/PORT: fleet adopts it, binds nothing there
        assert done.returncode == 0 and output.count("trained") == 2, output
        return
    assert done.returncode != 0 and "trained" not in output, output
    if mode == "ps":
        assert "UserProcessGroupError: torch.distributed.init_process_group was called before fleet.init()" in output
        assert "parameter-server job (mode='ps', update='async'" in output and "Traceback" not in output, output
        assert "fleetrun: job failed (exit status 2)" in output
    else:
        assert "trying to initialize the default process group twice" in output, output
        assert "fleet: torch.distributed.init_process_group was called after fleet.init()" in output, output
    assert "migrating-from-ddp.md" in output
