"""A tiny parameter-server job (dense + sparse) that prints a checksum of its final dense parameters.

With ``--no-stop`` the script simply ends, without fleet.stop_worker(), as most scripts do.
"""

import sys

import torch

import fleet

fleet.init()  # on a server this serves until the workers are done, then exits
torch.manual_seed(0)
embedding = fleet.nn.SparseEmbedding(4, seed=1)
head = torch.nn.Linear(8, 1)
model = torch.nn.ModuleDict({"embedding": embedding, "head": head})
opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
for step in range(6):
    generator = torch.Generator().manual_seed(100 * step + fleet.worker_index())
    ids = torch.randint(0, 1000, (16, 2), generator=generator)
    opt.zero_grad()
    head(embedding(ids).flatten(1)).pow(2).mean().backward()
    opt.step()
fleet.barrier_worker()
checksum = sum(float(p.detach().double().sum()) for p in head.parameters())
print(f"worker {fleet.worker_index()} of {fleet.worker_num()} checksum {checksum:.10f}")
if "--no-stop" not in sys.argv:
    fleet.stop_worker()
