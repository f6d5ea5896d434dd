"""Workers that build different models in a parameter-server job: must fail at distributed_optimizer, naming it."""

import torch

import fleet

fleet.init()
w = fleet.worker_index()
model = fleet.distributed_model(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2 + w)))
opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
print("created", flush=True)
fleet.stop_worker()
