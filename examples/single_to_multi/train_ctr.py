"""CTR model of workload W2 with a fleet.nn.SparseEmbedding: one script for every mode.

    python train_ctr.py                                   # single process (local embedding table)
    fleetrun --workers 2 train_ctr.py                     # collective
    fleetrun --servers 1 --workers 2 --strategy strategies/ps_async.toml train_ctr.py   # parameter server

Options: --steps N, --batch B, --report FILE (worker results as JSON lines, for benchmarks),
--no-prefetch (by default each step asks for the next batch's rows early: in PS async mode
they arrive while this step computes; elsewhere prefetch does nothing).

From files instead of the synthetic generator (Paddle's MultiSlot text or fleet's binary
slot files; each worker reads its fleet.file_shard of the list, all the same number of batches):

    python -m fleet.data.slot_dataset generate data/ --files 4 --samples 20000
    fleetrun --workers 2 train_ctr.py --files 'data/part-*' --epochs 2
"""

from __future__ import annotations

import argparse
import glob
import json
import os
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


def file_list(spec: str) -> list[str]:
    """Comma-separated paths or glob patterns, in order (a pattern's matches sorted)."""
    names: list[str] = []
    for part in filter(None, spec.split(",")):
        names += sorted(glob.glob(part)) or [part]  # no match: fleet names the missing file
    return names


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=None, help="default: 50, or every batch of --epochs")
    parser.add_argument("--files", default=None, help="train from these files: comma-separated paths or globs")
    parser.add_argument("--epochs", type=int, default=1, help="passes over --files")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--report", default=None)
    parser.add_argument("--no-prefetch", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)

    fleet.init()  # on a parameter server this serves, then exits
    torch.manual_seed(0)
    model = CTRModel()
    optimizer = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    loss_fn = torch.nn.BCEWithLogitsLoss()
    if args.files:
        files = file_list(args.files)
        dataset = fleet.SlotDataset(files, args.batch)
        print(
            f"worker {fleet.worker_index()} reads {len(fleet.file_shard(files))} of {len(files)} files: "
            f"{len(dataset)} batches per epoch, {dataset.dropped} samples left unread",
            flush=True,
        )
        data = (batch for _ in range(args.epochs) for batch in dataset)
        steps = args.steps if args.steps is not None else args.epochs * len(dataset)
    else:
        data = batches(fleet.worker_index(), args.batch)
        steps = args.steps if args.steps is not None else 50
    start = time.perf_counter()
    window = (time.time(), time.process_time())  # the timed steps' bounds and this process's CPU, for benchmarks
    first_loss = None
    data = iter(data)
    upcoming = next(data, None)
    done = 0
    for step in range(steps):
        if upcoming is None:
            break
        ids, dense, label = upcoming
        upcoming = next(data, None) if step + 1 < steps else None
        if step == args.warmup:
            start = time.perf_counter()
            window = (time.time(), time.process_time())
        optimizer.zero_grad()
        loss = loss_fn(model(ids, dense), label)
        if (
            upcoming is not None and not args.no_prefetch
        ):  # PS async: the next batch's rows arrive while this one computes
            model.embedding.prefetch(upcoming[0])
        loss.backward()
        optimizer.step()
        done += 1
        first_loss = loss.item() if first_loss is None else first_loss
        if step % 10 == 0 or step == steps - 1:
            print(f"worker {fleet.worker_index()} step {step} loss {loss.item():.4f}", flush=True)
    elapsed = time.perf_counter() - start
    timed = max(done - args.warmup, 0)
    result = {
        "worker": fleet.worker_index(),
        "loss": loss.item(),
        "first_loss": first_loss,
        "steps": done,
        "samples_per_s": timed * args.batch / elapsed,
        # benchmarks/job_cpu.py: this worker's CPU (all its threads) over the timed steps, and their bounds
        "pid": os.getpid(),
        "cpu_s": time.process_time() - window[1],
        "window": [window[0], time.time()],
        "timed_samples": timed * args.batch,
    }
    print(json.dumps(result), flush=True)
    if args.report:
        with open(args.report, "a") as f:
            f.write(json.dumps(result) + "\n")
    fleet.stop_worker()


if __name__ == "__main__":
    main()
