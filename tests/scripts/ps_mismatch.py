"""Workers that build different models in a parameter-server job: must fail at distributed_optimizer, naming it.

With ``--no-distributed-model`` the model is never given to fleet: the name comes from the
module that owns the optimizer's parameters.
"""

import sys

import torch

import fleet

fleet.init()
w = fleet.worker_index()
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2 + w))
if "--no-distributed-model" not in sys.argv:
    model = fleet.distributed_model(model)
opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
print("created", flush=True)
fleet.stop_worker()
