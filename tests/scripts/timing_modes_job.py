"""Jobs for tests/telemetry/test_timing_modes.py: STEPS iterations of a small MLP.

Usage: timing_modes_job.py STEPS sharding|by-hand. ``sharding``: mode="sharding", stepping the
wrapped optimizer (its communication is FSDP2's). ``by-hand``: mode="collective", the weights
updated by hand as pytorch/examples' word_language_model does, the wrapped optimizer never stepped.
"""

import sys

import torch

import fleet

steps, how = int(sys.argv[1]), sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
fleet.init()
mode = "sharding" if how == "sharding" else "collective"
opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.01), fleet.DistributedStrategy(mode=mode))
fleet.telemetry.timing.set_batch_size(8)
g = torch.Generator().manual_seed(fleet.worker_index())
x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
for _ in range(steps):
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    if how == "by-hand":
        with torch.no_grad():
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-0.01)
    else:
        opt.step()
fleet.stop_worker()
print("worker finished")
