"""A job that checkpoints as it trains, for the random-kill tests.

kill_train.py collective|ps CHECKPOINT_DIR STEPS
"""

import sys
import time

import torch

import fleet

mode, checkpoint_dir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.set_num_threads(1)
fleet.init()  # a parameter server serves here and exits when the workers are done
torch.manual_seed(0)
if mode == "ps":
    embedding = fleet.nn.SparseEmbedding(4, seed=1)
    head = torch.nn.Linear(8, 1)
    model = torch.nn.ModuleDict({"embedding": embedding, "head": head})
    forward = lambda ids: head(embedding(ids).flatten(1))  # noqa: E731
else:
    model = torch.nn.Sequential(torch.nn.Embedding(1000, 4), torch.nn.Flatten(), torch.nn.Linear(8, 1))
    forward = model
opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
for step in range(1, steps + 1):
    ids = torch.randint(0, 1000, (16, 2), generator=torch.Generator().manual_seed(step))
    opt.zero_grad()
    forward(ids).pow(2).mean().backward()
    opt.step()
    time.sleep(0.02)
    if mode == "ps" and step % 10 == 0:
        fleet.save_persistables(checkpoint_dir)
    elif mode == "collective":
        fleet.save_checkpoint(checkpoint_dir, model, opt, step)
print(f"worker {fleet.worker_index()} finished {steps} steps", flush=True)
fleet.stop_worker()
