"""A one-process sharding run saves and loads its checkpoint without torch's warning about assuming a
single process (fleet means it): no stray warnings from fleet's own calls (issue 27)."""

from __future__ import annotations

import warnings

import torch

import fleet


def test_one_process_sharding_checkpoint_warns_nothing(fresh_fleet, tmp_path) -> None:
    fleet.init()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = fleet.distributed_optimizer(torch.optim.Adam(model.parameters()), fleet.DistributedStrategy(mode="sharding"))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fleet.save_checkpoint(str(tmp_path), model, opt, step=1)
        assert fleet.load_checkpoint(str(tmp_path), model, opt).step == 1
