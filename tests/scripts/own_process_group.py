"""A script with its own distributed mode, as Facebook's DLRM has: on when torchrun's WORLD_SIZE says so.

fleetrun sets torchrun's variables for every worker, so the script calls init_process_group
itself (``env://``: MASTER_ADDR/MASTER_PORT from fleetrun) before fleet.init(); ``--after``
calls it after. A parameter-server job must refuse it, naming the call and what to remove.
"""

import os
import sys

import torch
import torch.distributed as dist

import fleet

if "--after" in sys.argv:
    fleet.init()
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    dist.init_process_group("gloo")
fleet.init()
model = torch.nn.Linear(4, 1)
opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
print("trained", flush=True)
fleet.stop_worker()
