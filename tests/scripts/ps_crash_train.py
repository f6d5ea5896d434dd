"""A PS sync job in which one worker dies once at a given step (restarted by fleetrun or not).

ps_crash_train.py STEPS CRASH_STEP VICTIM_WORKER
"""

import os
import sys

import torch

import fleet

steps, crash_step, victim = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(1)
fleet.init()
restart = os.environ.get("FLEET_RESTART_COUNT", "0")
torch.manual_seed(0)
embedding = fleet.nn.SparseEmbedding(4, seed=1)
head = torch.nn.Linear(8, 1)
model = torch.nn.ModuleDict({"embedding": embedding, "head": head})
opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
print(f"worker {fleet.worker_index()} joined (restart {restart})", flush=True)
for step in range(steps):
    if fleet.worker_index() == victim and step == crash_step and restart == "0":
        os._exit(9)
    ids = torch.randint(0, 1000, (16, 2), generator=torch.Generator().manual_seed(step))
    opt.zero_grad()
    head(embedding(ids).flatten(1)).pow(2).mean().backward()
    opt.step()
print(f"worker {fleet.worker_index()} done", flush=True)
fleet.stop_worker()
