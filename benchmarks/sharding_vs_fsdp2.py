"""fleet's sharding against raw FSDP2 on the same transformer, alternately in one run.

    python benchmarks/sharding_vs_fsdp2.py [--workers 2] [--rounds 40] [--steps 1] [--no-shared-memory]

A GPT-style model (token embedding, 4 blocks of attention + MLP in an ``nn.ModuleList``, head;
dim 256, sequence 64, batch 8 per worker, AdamW) trained in the same two processes over the same
gloo group, one intra-op thread each: once through ``fleet.distributed_optimizer(opt,
DistributedStrategy(mode="sharding"))`` with its default units, once as FSDP2's own recipe
(``fully_shard`` on every block, then the root) with the same optimizer. Steps alternate
(fleet, FSDP2, FSDP2, fleet, ...) so drift in the machine's load hits both alike. Prints the
median step time of each and the ratio fleet / FSDP2 (issue 27's target: at most 1.0). Fleet's
collectives go through shared memory (the workers share this host); ``--no-shared-memory`` sends
them through gloo as FSDP2's do, as workers on several hosts would (a secondary figure).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp
from _common import become_local_worker, record_result
from torch import nn

DIM, HEADS, BLOCKS, VOCAB, SEQ, BATCH = 256, 4, 4, 2048, 64, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def worker(rank: int, workers: int, port: int, args: argparse.Namespace, out: str) -> None:
    become_local_worker(rank, workers, port)
    torch.set_num_threads(1)
    from torch.distributed.fsdp import fully_shard

    import fleet

    fleet.init()
    generator = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator) for _ in range(4)]

    fleet_model = GPT()
    fleet_opt = fleet.distributed_optimizer(
        torch.optim.AdamW(fleet_model.parameters(), lr=1e-3),
        fleet.DistributedStrategy(mode="sharding", shared_memory=not args.no_shared_memory),
    )
    raw_model = GPT()
    for block in raw_model.layers:
        fully_shard(block)
    fully_shard(raw_model.tok)
    fully_shard(raw_model.head)
    fully_shard(raw_model)
    raw_opt = torch.optim.AdamW(raw_model.parameters(), lr=1e-3)
    runs = {"fleet": (fleet_model, fleet_opt), "fsdp2": (raw_model, raw_opt)}
    times: dict[str, list[float]] = {"fleet": [], "fsdp2": []}
    losses: dict[str, list[float]] = {"fleet": [], "fsdp2": []}

    def run(name: str, steps: int, record: bool) -> None:
        model, opt = runs[name]
        for step in range(steps):
            ids = batches[step % len(batches)]
            started = time.perf_counter()
            opt.zero_grad()
            logits = model(ids[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            if record:
                times[name].append(time.perf_counter() - started)
                losses[name].append(float(loss.detach()))

    run("fleet", args.warmup, False)
    run("fsdp2", args.warmup, False)
    order = ["fleet", "fsdp2"]
    for round_index in range(args.rounds):
        for name in order if round_index % 2 == 0 else order[::-1]:
            run(name, args.steps, True)
    if rank == 0:
        with open(out, "w") as handle:
            json.dump({"times": times, "losses": losses}, handle)
    fleet.stop_worker()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=40, help="alternations (fleet then FSDP2, then the reverse)")
    parser.add_argument("--steps", type=int, default=1, help="steps of each in one alternation")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--no-shared-memory",
        action="store_true",
        help="fleet's collectives through gloo (shared_memory=False), as workers on several hosts do",
    )
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = f"/tmp/fleet_sharding_vs_fsdp2_{os.getpid()}.json"
    mp.start_processes(worker, args=(args.workers, port, args, out), nprocs=args.workers, start_method="spawn")
    with open(out) as handle:
        result = json.load(handle)
    os.unlink(out)
    times = result["times"]
    fleet_ms = statistics.median(times["fleet"]) * 1000
    raw_ms = statistics.median(times["fsdp2"]) * 1000
    params = sum(p.numel() for p in GPT().parameters())
    path = "gloo (shared_memory=False)" if args.no_shared_memory else "shared memory"
    print(
        f"sharding vs FSDP2: GPT {params / 1e6:.1f} M params ({BLOCKS} blocks in a ModuleList, dim {DIM}), "
        f"batch {BATCH}x{SEQ}/worker, {args.workers} workers, 1 thread each, gloo; fleet through {path}"
    )
    print(f"{'':10}{'median ms/step':>16}{'steps':>8}")
    for name, ms in (("fleet", fleet_ms), ("FSDP2", raw_ms)):
        print(f"{name:10}{ms:16.1f}{len(times[name.lower()]):8d}")
    ratio = fleet_ms / raw_ms
    print(f"ratio fleet/FSDP2 (median step time): {ratio:.3f}  (target <= 1.0) {'PASS' if ratio <= 1.0 else 'MISS'}")
    same = all(abs(a - b) < 1e-4 for a, b in zip(result["losses"]["fleet"], result["losses"]["fsdp2"], strict=True))
    print(f"same losses step by step (1e-4): {same}")
    record_result(
        "sharding_vs_fsdp2",
        variant="GPT, blocks in a ModuleList" + (", gloo" if args.no_shared_memory else ""),
        figure=f"median step time, {args.workers} workers on one host, 1 thread each, alternating every step",
        units="ms",
        fleet=round(fleet_ms, 2),
        peer="FSDP2 (fully_shard per block, then the root)",
        peer_value=round(raw_ms, 2),
        ratio=round(ratio, 4),
        ratio_means="fleet sharding / raw FSDP2 median step time (lower is better)",
        target="<= 1.0",
        summary=f"{ratio:.3f} x FSDP2's step time (fleet {fleet_ms:.1f} ms, FSDP2 {raw_ms:.1f} ms)"
        + (", fleet through gloo" if args.no_shared_memory else ""),
        headline=not args.no_shared_memory,
        details={"rounds": args.rounds, "workers": args.workers, "same_losses": same},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
