"""Saves written before the storage seam (issue 37) load after it: ``tests/storage/legacy/v1`` was written by
that code (``tests/storage/legacy/make_legacy.py``) and is committed as it came out."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import fleet
import fleet.api
from fleet.ps.worker.persistables import load_servers
from ps_servers import SGD, client, servers

FIXTURE = Path(__file__).parent / "legacy" / "v1"


@pytest.fixture
def saves(tmp_path: Path, monkeypatch) -> Iterator[Path]:
    """A copy of the fixture (a load must not be able to change the committed files), in a one-process job."""
    for name in ("FLEET_ROLE", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    shutil.copytree(FIXTURE, tmp_path / "v1")
    fleet.api._reset_for_tests()
    try:
        yield tmp_path / "v1"
    finally:
        fleet.api._reset_for_tests()


def expected() -> dict[str, torch.Tensor]:
    return torch.load(FIXTURE / "expected.pt", weights_only=True)


def test_a_collective_checkpoint_an_export_and_a_fleet_save_from_before_load(saves: Path) -> None:
    fleet.init()
    torch.manual_seed(1)  # other values, every one replaced by the load
    model = torch.nn.Linear(3, 2)
    opt = fleet.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=0.1))
    resumed = fleet.load_checkpoint(str(saves / "collective"), model, opt, missing_ok=False)
    want = expected()
    assert resumed == (3, {"note": "v1"})
    assert torch.equal(model.weight, want["weight"]) and torch.equal(model.bias, want["bias"])
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], want["exp_avg"])
    served = fleet.load_for_inference(str(saves / "export"), torch.nn.Linear(3, 2))
    assert torch.equal(served.weight, want["weight"])
    assert torch.equal(torch.load(saves / "saved.pt", weights_only=True)["weight"], want["weight"])


def test_a_sharding_checkpoint_with_table_rows_from_before_loads(saves: Path) -> None:
    from ps_jobs import batch, make_model, make_optimizer

    fleet.init()
    torch.manual_seed(1)
    model = make_model("adam")
    opt = fleet.distributed_optimizer(
        make_optimizer("adam", model.parameters()), fleet.DistributedStrategy(mode="sharding")
    )
    assert fleet.load_checkpoint(str(saves / "sharding"), model, opt, missing_ok=False).step == 2
    with torch.no_grad():
        ids, dense, _ = batch(0, 0)
        assert torch.equal(model(ids, dense), expected()["sharding_predictions"])


def test_a_parameter_server_save_from_before_loads(saves: Path) -> None:
    ids = torch.arange(-4, 4)
    with servers(1, 1) as srvs, client(srvs, 0) as c:
        c.create_dense(0, torch.zeros(6), {"optimizer": SGD, "update": "async"}).result()
        c.create_sparse(1, {"dim": 4, "optimizer": SGD, "update": "async", "seed": 3}).result()
        load_servers(c, str(saves / "ps" / "save-000001"))
        want = expected()
        assert torch.equal(c.pull_dense(0).result(), want["ps_dense"])
        assert torch.equal(c.pull_sparse(1, ids).result(), want["ps_rows"])
