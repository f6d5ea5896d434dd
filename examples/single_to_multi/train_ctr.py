"""CTR model of workload W2 with a fleet.nn.SparseEmbedding: one script for every mode.

    python train_ctr.py                                   # single process (local embedding table)
    fleetrun --workers 2 train_ctr.py                     # collective
    fleetrun --servers 1 --workers 2 --strategy strategies/ps_async.toml train_ctr.py   # parameter server

Options: --steps N, --batch B, --report FILE (worker results as JSON lines, for benchmarks).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import fleet

SLOTS, DIM, DENSE, ID_SPACE = 26, 16, 13, 1_000_000


class CTRModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = fleet.nn.SparseEmbedding(DIM, seed=0)
        layers, width = [], SLOTS * DIM + DENSE
        for _ in range(3):
            layers += [torch.nn.Linear(width, 400), torch.nn.ReLU()]
            width = 400
        self.mlp = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))

    def forward(self, ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([self.embedding(ids).flatten(1), dense], 1)).squeeze(1)


def batches(worker: int, batch: int):
    """Synthetic CTR data: uniform ids, label = dense @ w_true > 0 (w_true fixed by seed 0)."""
    w_true = torch.randn(DENSE, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1 + worker)
    while True:
        ids = torch.randint(0, ID_SPACE, (batch, SLOTS), generator=g)
        dense = torch.randn(batch, DENSE, generator=g)
        yield ids, dense, (dense @ w_true > 0).float()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--report", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)

    fleet.init()  # on a parameter server this serves, then exits
    torch.manual_seed(0)
    model = CTRModel()
    optimizer = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    loss_fn = torch.nn.BCEWithLogitsLoss()
    data = batches(fleet.worker_index(), args.batch)
    start = time.perf_counter()
    for step in range(args.steps):
        if step == args.warmup:
            start = time.perf_counter()
        ids, dense, label = next(data)
        optimizer.zero_grad()
        loss = loss_fn(model(ids, dense), label)
        loss.backward()
        optimizer.step()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"worker {fleet.worker_index()} step {step} loss {loss.item():.4f}", flush=True)
    elapsed = time.perf_counter() - start
    timed = max(args.steps - args.warmup, 0)
    result = {"worker": fleet.worker_index(), "loss": loss.item(), "samples_per_s": timed * args.batch / elapsed}
    print(json.dumps(result), flush=True)
    if args.report:
        with open(args.report, "a") as f:
            f.write(json.dumps(result) + "\n")
    fleet.stop_worker()


if __name__ == "__main__":
    main()
