"""A PS job whose server 1 dies once (restarted by fleetrun or not); checkpoints every few steps.

    ps_server_crash_train.py STEPS SAVE_EVERY CRASH_STEP FLAG_FILE CHECKPOINT_DIR

Server 1 (first run only) exits with status 9 as soon as FLAG_FILE exists; worker 0
creates it at step CRASH_STEP. Each worker prints its mean loss over the first and
the last 10 steps.
"""

import os
import sys
import threading
import time

import torch

import fleet

steps, save_every, crash_step = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
flag, checkpoint = sys.argv[4], sys.argv[5]
restart = os.environ.get("FLEET_RESTART_COUNT", "0")
if os.environ.get("FLEET_ROLE") == "server" and os.environ.get("FLEET_SERVER_INDEX") == "1" and restart == "0":

    def _crash_on_flag() -> None:
        while not os.path.exists(flag):
            time.sleep(0.02)
        print("server 1 crashing", flush=True)
        os._exit(9)

    threading.Thread(target=_crash_on_flag, daemon=True).start()

torch.set_num_threads(1)
fleet.init()
torch.manual_seed(0)
embedding = fleet.nn.SparseEmbedding(4, seed=1)
head = torch.nn.Linear(4 + 8, 1)
model = torch.nn.ModuleDict({"embedding": embedding, "head": head})
opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.05))
truth = torch.randn(8, 1, generator=torch.Generator().manual_seed(7))
worker = fleet.worker_index()
print(f"worker {worker} joined", flush=True)
losses = []
for step in range(steps):
    if worker == 0 and step == crash_step:
        open(flag, "w").close()
    gen = torch.Generator().manual_seed(1000 * worker + step)
    ids = torch.randint(0, 50, (32,), generator=gen)
    x = torch.randn(32, 8, generator=gen)
    y = x @ truth
    opt.zero_grad()
    loss = (head(torch.cat([embedding(ids), x], dim=1)) - y).pow(2).mean()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    if (step + 1) % save_every == 0:
        fleet.save_persistables(checkpoint)
    time.sleep(0.02)
first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
print(f"worker {worker} done: loss {first:.4f} -> {last:.4f}", flush=True)
fleet.stop_worker()
