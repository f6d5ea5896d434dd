"""A parameter-server job for emulated hosts (tests/launch/test_multinode.py, test_host_failures.py): a 0.5 MB
dense layer on the servers, so its pulls and pushes are what crosses the link, and a checksum of the final dense
parameters and the first and last losses. The update mode is the strategy's (FLEET_STRATEGY or ``--strategy``).

    hosts_ps_train.py STEPS SLEEP_S MARKS_DIR [OUT]   # MARKS_DIR/worker-<i>-step-<s> is touched after each step;
                                                      # OUT: the dense layer's outputs (default 512)
"""

import sys
import time
from pathlib import Path

import torch

import fleet

steps, sleep_s, marks = int(sys.argv[1]), float(sys.argv[2]), Path(sys.argv[3])
out_features = int(sys.argv[4]) if len(sys.argv) > 4 else 512
fleet.init()  # on a server this serves until the workers are done, then exits
torch.manual_seed(0)
embedding = fleet.nn.SparseEmbedding(128, seed=1)
head = torch.nn.Linear(256, out_features)
model = torch.nn.ModuleDict({"embedding": embedding, "head": head})
opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
losses = []
for step in range(steps):
    generator = torch.Generator().manual_seed(100 * step + fleet.worker_index())
    ids = torch.randint(0, 1000, (16, 2), generator=generator)
    opt.zero_grad()
    loss = head(embedding(ids).flatten(1)).pow(2).mean()
    loss.backward()
    losses.append(float(loss))
    opt.step()
    (marks / f"worker-{fleet.worker_index()}-step-{step}").touch()
    if sleep_s:
        time.sleep(sleep_s)
fleet.barrier_worker()
checksum = sum(float(p.detach().double().sum()) for p in head.parameters())
print(
    f"worker {fleet.worker_index()} of {fleet.worker_num()} checksum {checksum!r} loss {losses[0]!r} {losses[-1]!r}",
    flush=True,
)
fleet.stop_worker()
