"""W2's no-distribution limit: the W2 MLP alone, in as many processes as W2 has workers.

Each process trains train_ctr.py's MLP (26 x 16 embedding columns + 13 dense -> 400-400-400-1,
BCE, SGD lr 0.1, batch 512, one torch thread) on inputs made once before the timed part, with
no table, no server and no communication: what the machine does when distribution costs
nothing. ``w2_ctr.py --peers`` runs it beside fleet and the peers and prints
``ratio vs limit: Z`` (fleet's PS async over this configuration's samples/s).

    python benchmarks/peers/w2_limit.py --workers 2 --steps 300 --report FILE
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time

from peer_procs import TimedWindow

SLOTS, DIM, DENSE = 26, 16, 13


def worker(rank: int, steps: int, batch: int, warmup: int, queue) -> None:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers, width = [], SLOTS * DIM + DENSE
    for _ in range(3):
        layers += [torch.nn.Linear(width, 400), torch.nn.ReLU()]
        width = 400
    mlp = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))
    opt = torch.optim.SGD(mlp.parameters(), lr=0.1)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    g = torch.Generator().manual_seed(1 + rank)
    w_true = torch.randn(DENSE, generator=torch.Generator().manual_seed(0))
    inputs = []
    for _ in range(8):  # a few batches, cycled: making them is not timed
        dense = torch.randn(batch, DENSE, generator=g)
        rows = torch.empty(batch, SLOTS * DIM).uniform_(-0.01, 0.01, generator=g)
        inputs.append((torch.cat([rows, dense], 1), (dense @ w_true > 0).float()))
    first = last = float("nan")
    start = time.perf_counter()
    window = TimedWindow()
    for step in range(steps):
        if step == warmup:
            start = time.perf_counter()
            window.start()
        x, y = inputs[step % len(inputs)]
        opt.zero_grad()
        loss = loss_fn(mlp(x).squeeze(1), y)
        loss.backward()
        opt.step()
        first = float(loss) if step == 0 else first
        last = float(loss)
    rate = batch * (steps - warmup) / (time.perf_counter() - start)
    timed = window.fields(batch * (steps - warmup))
    queue.put({"worker": rank, "samples_per_s": rate, "first_loss": first, "loss": last, **timed})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--report", required=True)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(r, args.steps, args.batch, args.warmup, queue)) for r in range(args.workers)
    ]
    for p in procs:
        p.start()
    results = [queue.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join(60)
    with open(args.report, "w") as f:
        for r in sorted(results, key=lambda r: r["worker"]):
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
