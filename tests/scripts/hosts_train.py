"""A collective or sharding job for emulated hosts (tests/launch/test_multinode.py, test_host_failures.py): a
0.5 MB model, so its gradients are what crosses the link, and a checksum of the final parameters and the first
and last losses. The mode is the launch configuration's strategy (collective unless ``--strategy`` says else).

    hosts_train.py STEPS SLEEP_S MARKS_DIR [OUT]   # MARKS_DIR/worker-<i>-step-<s> is touched after each step;
                                                   # OUT: the layer's outputs (default 512: Linear(256, 512))
"""

import sys
from pathlib import Path

import torch

import fleet

steps, sleep_s, marks = int(sys.argv[1]), float(sys.argv[2]), Path(sys.argv[3])
out_features = int(sys.argv[4]) if len(sys.argv) > 4 else 512
fleet.init()
torch.manual_seed(fleet.worker_index())  # different initial weights: fleet broadcasts worker 0's
model = torch.nn.Linear(256, out_features)
opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
losses = []
for step in range(steps):
    generator = torch.Generator().manual_seed(100 * step + fleet.worker_index())
    x = torch.randn(16, 256, generator=generator)
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    losses.append(float(loss))
    opt.step()
    (marks / f"worker-{fleet.worker_index()}-step-{step}").touch()
    if sleep_s:
        import time

        time.sleep(sleep_s)
full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]  # sharding: DTensors
checksum = sum(float(p.detach().double().sum()) for p in full)
print(
    f"worker {fleet.worker_index()} of {fleet.worker_num()} checksum {checksum!r} loss {losses[0]!r} {losses[-1]!r}",
    flush=True,
)
fleet.stop_worker()
