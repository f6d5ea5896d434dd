"""A tiny collective training run that prints a checksum of its final parameters."""

import torch

import fleet

fleet.init()
torch.manual_seed(fleet.worker_index())  # different initial weights: fleet broadcasts worker 0's
model = torch.nn.Linear(8, 4)
opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
for step in range(5):
    generator = torch.Generator().manual_seed(100 * step + fleet.worker_index())
    x = torch.randn(16, 8, generator=generator)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
checksum = sum(float(p.double().sum()) for p in model.parameters())
print(f"worker {fleet.worker_index()} of {fleet.worker_num()} checksum {checksum:.10f}")
fleet.stop_worker()
