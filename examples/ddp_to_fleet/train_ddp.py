"""A small DDP trainer, written for torchrun: the "before" of docs/migrating-from-ddp.md.

torchrun --nproc_per_node 2 examples/ddp_to_fleet/train_ddp.py --snapshot /tmp/ddp.pt
"""

import argparse
import contextlib
import os

import common
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--accumulate", type=int, default=2)
parser.add_argument("--snapshot", default="snapshot.pt")
args = parser.parse_args()

dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
local_rank = int(os.environ["LOCAL_RANK"])
rank, world_size = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")

torch.manual_seed(0)
data = common.dataset()
sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
loader = DataLoader(data, batch_size=16, sampler=sampler)
model = DDP(common.model().to(device), device_ids=[local_rank] if device.type == "cuda" else None)
optimizer = torch.optim.AdamW(common.param_groups(model.module, 0.01), lr=3e-3)

for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    for i, (x, y) in enumerate(loader):
        x, y = x.to(device), y.to(device)
        last = (i + 1) % args.accumulate == 0 or i + 1 == len(loader)
        with contextlib.nullcontext() if last else model.no_sync():  # all-reduce once per optimizer step
            loss = torch.nn.functional.mse_loss(model(x), y)
            (loss / args.accumulate).backward()
        if last:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        print(f"LOSS rank={rank} epoch={epoch} batch={i} {loss.item():.8f}")
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}, args.snapshot)

dist.destroy_process_group()
