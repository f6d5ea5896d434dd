"""Sparse tables placed across emulated hosts (tests/launch/test_multinode_tables.py): a feature collection of two
tables and a head, trained under ``fleet.launch`` with the tables sharded row-wise or table-wise (the launch's
``--strategy``), or, with ``reference`` as the last argument, in one process on both workers' batches. Prints a
checksum of every row (gathered from the owners) and of the head, per worker.

    hosts_tables_train.py STEPS [reference]
"""

import sys

import torch

import fleet
from fleet.nn import FeatureTable, SparseFeatureCollection

BATCH, BAG, DIM, VOCAB = 64, 8, 128, 5000


def batch(step: int, worker: int) -> tuple[dict, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + worker)
    bags = {f: {"ids": torch.randint(0, VOCAB, (BATCH * BAG,), generator=g), "lengths": torch.full((BATCH,), BAG)}
            for f in ("a", "b")}  # fmt: skip
    return bags, torch.rand(BATCH, generator=g)


def union(parts: list[tuple[dict, torch.Tensor]]) -> tuple[dict, torch.Tensor]:
    bags = {f: {k: torch.cat([p[0][f][k] for p in parts]) for k in ("ids", "lengths")} for f in ("a", "b")}
    return bags, torch.cat([p[1] for p in parts])


steps = int(sys.argv[1])
alone = sys.argv[-1] == "reference"
fleet.init()
torch.manual_seed(0)
tables = SparseFeatureCollection([FeatureTable("a", DIM, seed=1), FeatureTable("b", DIM, seed=2)])
head = torch.nn.Linear(2 * DIM, 1)
opt = fleet.distributed_optimizer(torch.optim.SGD([*tables.parameters(), *head.parameters()], lr=0.5))
for step in range(steps):
    bags, target = union([batch(step, w) for w in range(2)]) if alone else batch(step, fleet.worker_index())
    opt.zero_grad()
    pooled = tables(bags)
    loss = (head(torch.cat([pooled["a"], pooled["b"]], 1)).squeeze(1) - target).pow(2).mean()
    loss.backward()
    opt.step()
checksum = sum(float(p.detach().double().sum()) for p in head.parameters())
for table in tables:
    rows = table.state_dict()  # every owner's rows, gathered
    checksum += float(rows["rows.values"].double().sum())
print(f"worker {fleet.worker_index()} of {2 if alone else fleet.worker_num()} checksum {checksum!r}", flush=True)
fleet.stop_worker()
