"""train_ddp.py converted to fleet: the "after" of docs/migrating-from-ddp.md.

fleetrun --workers 2 examples/ddp_to_fleet/train_fleet.py --snapshot /tmp/fleet.pt
torchrun --nproc_per_node 2 examples/ddp_to_fleet/train_fleet.py     # unchanged under torchrun
python examples/ddp_to_fleet/train_fleet.py                          # and as one process
"""

import argparse
import contextlib

import common
import torch
from torch.utils.data import DataLoader

import fleet

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--accumulate", type=int, default=2)
parser.add_argument("--snapshot", default="snapshot.pt")
args = parser.parse_args()

fleet.init()  # replaces init_process_group; the role comes from any launcher's variables
local_rank = fleet.local_rank()  # int(os.environ["LOCAL_RANK"]) works too, under fleetrun as under torchrun
device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")

torch.manual_seed(0)
data = common.dataset()
loader = fleet.distributed_loader(DataLoader(data, batch_size=16, shuffle=True))  # replaces DistributedSampler
model = fleet.distributed_model(common.model().to(device))  # replaces DDP(...); model.module still works
optimizer = fleet.distributed_optimizer(torch.optim.AdamW(common.param_groups(model, 0.01), lr=3e-3))

for epoch in range(args.epochs):
    loader.set_epoch(epoch)  # optional: every pass over the loader is a new epoch anyway
    for i, (x, y) in enumerate(loader):
        x, y = x.to(device), y.to(device)
        last = (i + 1) % args.accumulate == 0 or i + 1 == len(loader)
        with contextlib.nullcontext() if last else model.no_sync():
            loss = torch.nn.functional.mse_loss(model(x), y)
            (loss / args.accumulate).backward()
        if last:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        print(f"LOSS rank={fleet.worker_index()} epoch={epoch} batch={i} {loss.item():.8f}")
    if fleet.is_first_worker():
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}, args.snapshot)

fleet.stop_worker()  # replaces destroy_process_group (optional: fleet stops at exit too)
