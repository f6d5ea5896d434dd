"""A small parameter-server job for the launch tests: the same file on servers and workers.

The strategy comes from the launch (FLEET_STRATEGY, --strategy, or fleetrun's default).
On a server ``fleet.init()`` serves and exits 0; a worker trains a few steps and prints
``RESULT {json}`` with its role, the update mode it ran and its losses.
"""

import json
import os
import sys
import time

import torch

import fleet

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 5
torch.set_num_threads(1)
fleet.init()
assert fleet.is_worker(), "a server process must not get past fleet.init()"
torch.manual_seed(0)
emb = fleet.nn.SparseEmbedding(4, seed=1)
head = torch.nn.Linear(8 + 3, 1)
params = list(emb.parameters()) + list(head.parameters())
opt = fleet.distributed_optimizer(torch.optim.SGD(params, lr=0.2))
losses = []
for step in range(steps):
    g = torch.Generator().manual_seed(100 * step + fleet.worker_index())
    ids = torch.randint(0, 50, (16, 2), generator=g) * 1009
    dense = torch.randn(16, 3, generator=g)
    label = (dense.sum(1) > 0).float()
    opt.zero_grad()
    loss = torch.nn.functional.binary_cross_entropy_with_logits(
        head(torch.cat([emb(ids).flatten(1), dense], 1)).squeeze(1), label
    )
    loss.backward()
    opt.step()
    losses.append(round(loss.item(), 4))
fleet.barrier_worker()
job = fleet.runtime.context.current()
info = {
    "worker": fleet.worker_index(),
    "workers": fleet.worker_num(),
    "servers": fleet.server_num(),
    "endpoints": list(fleet.server_endpoints()),
    "mode": job.strategy.mode,
    "update": job.strategy.update,
    "losses": losses,
}
hold = os.environ.get("HOLD_UNTIL_FILE")  # a test looks at the running job until it creates this file
deadline = time.monotonic() + 60
while hold and not os.path.exists(hold) and time.monotonic() < deadline:
    time.sleep(0.05)
fleet.stop_worker()
# One write (under PIPE_BUF): under torchrun the workers share one stdout, and print() writes twice.
sys.stdout.write("RESULT " + json.dumps(info) + "\n")
sys.stdout.flush()
