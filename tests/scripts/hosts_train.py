"""A collective job for emulated hosts (tests/launch/test_multinode.py): a 0.5 MB model, so its gradients are
what crosses the link, and a checksum of the final parameters.

    hosts_train.py STEPS SLEEP_S MARKS_DIR    # MARKS_DIR/worker-<i>-step-<s> is touched after each step
"""

import sys
from pathlib import Path

import torch

import fleet

steps, sleep_s, marks = int(sys.argv[1]), float(sys.argv[2]), Path(sys.argv[3])
fleet.init()
torch.manual_seed(fleet.worker_index())  # different initial weights: fleet broadcasts worker 0's
model = torch.nn.Linear(256, 512)
opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
for step in range(steps):
    generator = torch.Generator().manual_seed(100 * step + fleet.worker_index())
    x = torch.randn(16, 256, generator=generator)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
    (marks / f"worker-{fleet.worker_index()}-step-{step}").touch()
    if sleep_s:
        import time

        time.sleep(sleep_s)
checksum = sum(float(p.double().sum()) for p in model.parameters())
print(f"worker {fleet.worker_index()} of {fleet.worker_num()} checksum {checksum!r}", flush=True)
fleet.stop_worker()
