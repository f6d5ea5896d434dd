"""Worker 1's loop ends after 2 steps, worker 0's after 5; neither calls fleet.join() or stop_worker()."""

import torch

import fleet

fleet.init()
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
for _ in range(5 if fleet.worker_index() == 0 else 2):
    opt.zero_grad()
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
print("loop done")
