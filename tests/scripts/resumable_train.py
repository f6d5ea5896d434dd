"""Collective training that checkpoints every step and can crash once, to test restart + resume.

resumable_train.py CHECKPOINT_DIR CRASH_STEP VICTIM_WORKER   (CRASH_STEP -1: never crash)
"""

import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

import fleet

checkpoint_dir, crash_step, victim = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
fleet.init()
torch.manual_seed(0)
data = TensorDataset(torch.randn(96, 6), torch.randint(0, 3, (96,)))
loader = fleet.distributed_loader(DataLoader(data, batch_size=8, shuffle=True))
model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 3))
optimizer = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
resumed = fleet.load_checkpoint(checkpoint_dir, model, optimizer)
step = resumed.step if resumed else 0
first_life = os.environ.get("FLEET_RESTART_COUNT", "0") == "0"
print(f"worker {fleet.worker_index()} starts at step {step} (restart {os.environ.get('FLEET_RESTART_COUNT')})")
total = 3 * len(loader)
while step < total:
    loader.set_epoch(step // len(loader))
    for x, y in loader:
        optimizer.zero_grad()
        noisy = x + 0.01 * torch.randn_like(x)  # uses the RNG, which the checkpoint must restore
        torch.nn.functional.cross_entropy(model(noisy), y).backward()
        if first_life and fleet.worker_index() == victim and step == crash_step:
            os._exit(17)  # killed in the middle of a step
        optimizer.step()
        step += 1
        fleet.save_checkpoint(checkpoint_dir, model, optimizer, step, note="every step")
checksum = sum(float(p.double().sum()) for p in model.parameters())
print(f"worker {fleet.worker_index()} final step {step} checksum {checksum:.12f}")
fleet.stop_worker()
