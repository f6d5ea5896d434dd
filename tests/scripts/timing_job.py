"""A tiny collective training job for tests/telemetry/test_timing.py: STEPS steps of a small MLP.

Usage: timing_job.py STEPS [--progress]. Injection comes from FLEET_INJECT.
"""

import sys

import torch

import fleet

steps = int(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
fleet.init()
opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
fleet.telemetry.timing.set_batch_size(8)
x, y = torch.randn(8, 16), torch.randn(8, 1)
batches = range(steps)
if "--progress" in sys.argv:
    batches = fleet.progress(batches, description="train", every_s=0.0)
for _ in batches:
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
fleet.stop_worker()
print("worker finished")
