"""Writes the committed fixture ``tests/storage/legacy/v1/``: saves written by fleet before the storage seam
(issue 37), which every later fleet must still load (``tests/storage/test_legacy_saves.py``).

Run once, by the code of that time: ``PYTHONPATH=.:tests python tests/storage/legacy/make_legacy.py DIR``.
Kept so that the fixture's origin is readable; it is not run by the tests.
"""

from __future__ import annotations

import os
import sys

import torch

import fleet
import fleet.api
from fleet.ps.worker.persistables import save_servers
from ps_servers import SGD, client, servers


def linear_job(root: str) -> dict[str, torch.Tensor]:
    """A one-process collective job's checkpoint (model, Adam state, step 3, an extra) and an export."""
    fleet.api._reset_for_tests()
    fleet.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = fleet.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=0.1))
    for _ in range(3):
        opt.zero_grad()
        model(torch.ones(4, 3)).sum().backward()
        opt.step()
    fleet.save_checkpoint(os.path.join(root, "collective"), model, opt, 3, note="v1")
    fleet.export_for_inference(os.path.join(root, "export"), model)
    fleet.save({"weight": model.weight.detach().clone()}, os.path.join(root, "saved.pt"))
    expected = {"weight": model.weight.detach().clone(), "bias": model.bias.detach().clone()}
    expected["exp_avg"] = opt.state_dict()["state"][0]["exp_avg"].clone()
    fleet.api._reset_for_tests()
    return expected


def ps_save(root: str) -> dict[str, torch.Tensor]:
    """A parameter-server save (one server in a thread): a dense and a sparse table."""
    ids = torch.arange(-4, 4)
    with servers(1, 1) as srvs, client(srvs, 0) as c:
        c.create_dense(0, torch.arange(6.0), {"optimizer": SGD, "update": "async"}).result()
        c.create_sparse(1, {"dim": 4, "optimizer": SGD, "update": "async", "seed": 3}).result()
        c.pull_sparse(1, ids).result()
        c.push_dense_grad(0, torch.full((6,), 0.5), 0, 1.0).result()
        c.push_sparse_grad(1, ids, torch.full((ids.numel(), 4), 0.25), 0, 1.0).result()
        save_servers(c, os.path.join(root, "ps"), {"optimizers": []})
        return {"dense": c.pull_dense(0).result().clone(), "rows": c.pull_sparse(1, ids).result().clone()}


def sharding_job(root: str) -> dict[str, torch.Tensor]:
    """A one-process sharding job's checkpoint: torch.distributed.checkpoint's folder and the table's rows.pt."""
    from ps_jobs import batch, make_model, make_optimizer

    fleet.api._reset_for_tests()
    fleet.init()
    torch.manual_seed(0)
    model = make_model("adam")
    strategy = fleet.DistributedStrategy(mode="sharding")
    opt = fleet.distributed_optimizer(make_optimizer("adam", model.parameters()), strategy)
    for step in range(2):
        ids, dense, label = batch(step, 0)
        opt.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(model(ids, dense), label).backward()
        opt.step()
    fleet.save_checkpoint(os.path.join(root, "sharding"), model, opt, 2)
    with torch.no_grad():
        ids, dense, _ = batch(0, 0)
        predictions = model(ids, dense).clone()
    fleet.api._reset_for_tests()
    return {"sharding_predictions": predictions}


def main(root: str) -> None:
    expected = {**linear_job(root), **{f"ps_{k}": v for k, v in ps_save(root).items()}, **sharding_job(root)}
    torch.save(expected, os.path.join(root, "expected.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
