"""W2 on TorchRec 1.8.0 (CPU, FBGEMM's CPU kernels): the peer of ``benchmarks/w2_ctr.py --peers``.
Runs in its own venv (``bash benchmarks/peers/setup.sh torchrec``):

    benchmarks/peers/.venvs/torchrec/bin/python benchmarks/peers/w2_torchrec.py [--config tw-fused]
        [--steps 300] [--report FILE]

Configurations (``--config``; ``--list`` prints them):

- ``tw-fused``: DistributedModelParallel over 2 processes (gloo), the table sharded table-wise (whole
  on rank 0), FBGEMM's fused CPU kernel with the SGD update inside the backward
  (``apply_optimizer_in_backward``); pooled embeddings exchanged by all-to-all; the MLP replicated
  (DDP, gradients all-reduced).
- ``rw-fused``: the same, the table sharded row-wise over both ranks (ids and pooled embeddings
  exchanged by all-to-all / reduce-scatter).
- ``dp``: the table replicated on both ranks (data parallel, dense kernel), its gradient all-reduced
  with the MLP's.

Without ``--role`` this is the driver: it runs ``python -m torch.distributed.run --nproc-per-node 2``
on this file with a free port on 127.0.0.1, bounded by ``--timeout``, and prints each rank's JSON
line ``{"worker", "loss", "first_loss", "samples_per_s"}`` (as examples/single_to_multi/train_ctr.py
does for fleet; also appended to ``--report``).

The workload is W2 (benchmarks/README.md): 26 slots of uniform ids in [0, 1e6) as 26 features of
one EmbeddingBagCollection table (dimension 16, sum pooling of one id per bag = a lookup; rows
initialized uniform in [-0.01, 0.01] like fleet's; TorchRec tables are allocated whole, 64 MB,
not row by row on first touch), 13 dense features, MLP 429-400-400-400-1 with ReLU, BCE with
logits, SGD lr 0.1 for the table and the MLP, batch 512 per rank, 2 ranks; the data is fleet's
own generator (torch, seeded 1 + rank, the same tensors as train_ctr.py's). One intra-op thread
per process, like fleet's workers. TorchRec's training is synchronous (model parallel + DDP).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from peer_procs import TimedWindow, kill_group, member_argv, read_report, report_result

SLOTS, DIM, DENSE, ID_SPACE = 26, 16, 13, 1_000_000
WORKERS = 2
CONFIGS = {
    "tw-fused": ("table_wise", True),
    "rw-fused": ("row_wise", True),
    "dp": ("data_parallel", False),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ready(worker: int) -> None:
    """Past the warm-up: tell benchmarks/peers/profile_w2.py (W2_READY names a file prefix) it may sample now."""
    if os.environ.get("W2_READY"):
        with open(f"{os.environ['W2_READY']}.{worker}", "w") as f:
            f.write(str(os.getpid()))


# --------------------------------------------------------------------------- driver


def drive(args: argparse.Namespace) -> int:
    folder = tempfile.mkdtemp(prefix="w2-torchrec-")
    report = args.report or os.path.join(folder, "report.jsonl")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(WORKERS),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        *member_argv(__file__, args, report, "--config", args.config),
    ]
    started = time.perf_counter()
    log = open(os.path.join(folder, "torchrun.out"), "w+")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        rc = 124
    finally:
        kill_group(proc, settle_s=0.2)
        log.seek(0)
        out = log.read()
        log.close()
    results = read_report(report)
    if rc != 0 and len(results) == WORKERS and "terminate called without an active exception" in out:
        # Every rank finished and reported; one was aborted by gloo while tearing down at exit (PyTorch's
        # teardown abort, seen in fleet's own jobs too): the measurement stands, the abort is said.
        print(f"torchrec {args.config}: a rank aborted in gloo's teardown after reporting (rc {rc})", file=sys.stderr)
        rc = 0
    if rc != 0 or len(results) != WORKERS:
        print(
            f"torchrec {args.config}: failed (rc {rc}, {len(results)} of {WORKERS} ranks reported,"
            f" {time.perf_counter() - started:.0f} s)\n{out[-4000:]}",
            file=sys.stderr,
        )
        return rc or 1
    for r in results:
        print(json.dumps(r), flush=True)
    shutil.rmtree(folder, ignore_errors=True)
    return 0


# --------------------------------------------------------------------------- one rank


def batches(worker: int, batch: int):
    """examples/single_to_multi/train_ctr.py's generator, unchanged (same seeds, same tensors)."""
    import torch

    w_true = torch.randn(DENSE, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1 + worker)
    while True:
        ids = torch.randint(0, ID_SPACE, (batch, SLOTS), generator=g)
        dense = torch.randn(batch, DENSE, generator=g)
        yield ids, dense, (dense @ w_true > 0).float()


def build_model():
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

    features = [f"s{i}" for i in range(SLOTS)]

    class CTR(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(
                tables=[
                    EmbeddingBagConfig(
                        name="t",
                        embedding_dim=DIM,
                        num_embeddings=ID_SPACE,
                        feature_names=features,
                        pooling=PoolingType.SUM,
                        init_fn=lambda w: torch.nn.init.uniform_(w, -0.01, 0.01),
                    )
                ],
                device=torch.device("meta"),  # materialized by DistributedModelParallel on its shards
            )
            layers, width = [], SLOTS * DIM + DENSE
            for _ in range(3):
                layers += [torch.nn.Linear(width, 400), torch.nn.ReLU()]
                width = 400
            self.mlp = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))

        def forward(self, kjt, dense):
            pooled = self.ebc(kjt).values()  # [batch, 26 * 16], feature by feature
            return self.mlp(torch.cat([pooled, dense], 1)).squeeze(1)

    return CTR(), features


def to_kjt(ids, features):
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    # KeyedJaggedTensor is key-major: all samples of slot 0, then slot 1, ...; one id per bag
    return KeyedJaggedTensor(
        keys=features,
        values=ids.t().reshape(-1),
        lengths=torch.ones(ids.numel(), dtype=torch.int32),
    )


# torch.profiler op names -> where the time goes (first group with a matching substring wins)
OP_GROUPS = [
    ("embedding lookup + fused SGD backward (FBGEMM)", "fbgemm embedding"),
    (
        "communication (gloo all-to-all, all-reduce, waits)",
        "c10d gloo all_to_all alltoall all2all awaitable allreduce all_reduce wait reduce_scatter",
    ),
    ("MLP matmuls (forward + backward)", "addmm aten::mm aten::matmul aten::linear aten::t mmbackward"),
    (
        "MLP elementwise, loss, SGD (ReLU, BCE, add_, ...)",
        "relu threshold binary_cross sigmoid aten::add aten::mul aten::sub sgd foreach aten::sum aten::mean aten::div aten::neg aten::exp aten::log expand fill_ zero_",
    ),
    ("data generation (randint, randn)", "randint randn random_ normal_"),
    (
        "ids/KJT and tensor glue (cat, copy, index, permute, ...)",
        "cat copy index permute split view reshape empty aten::to aten::_to clone contiguous narrow select slice stack cumsum ones",
    ),
]


def _op_group(name: str) -> str:
    name = name.lower()
    for group, needles in OP_GROUPS:
        if any(n in name for n in needles.split()):
            return group
    return "other ops"


def _write_profile(path: str, profiler, wall_s: float, steps: int) -> None:
    """The op table (self CPU time) and its sums by group, as shares of the profiled wall time."""
    events = profiler.key_averages()
    groups: dict[str, float] = {}
    for e in events:
        group = _op_group(e.key)
        groups[group] = groups.get(group, 0.0) + e.self_cpu_time_total / 1e6
    lines = [f"torch.profiler, rank 0, {steps} steps, {1e3 * wall_s / steps:.1f} ms/step wall"]
    for group, seconds in sorted(groups.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {100 * seconds / wall_s:5.1f} %  {group}")
    outside = wall_s - sum(groups.values())
    lines.append(f"  {100 * outside / wall_s:5.1f} %  outside any op (Python, DMP/KJT glue, waiting)")
    lines.append("")
    lines.append(events.table(sort_by="self_cpu_time_total", row_limit=30))
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[: len(groups) + 3]), flush=True)


def member(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, data_parallel, row_wise, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    sharding, fused = CONFIGS[args.config]
    model, features = build_model()
    if fused:  # the table's SGD runs inside FBGEMM's backward kernel, on the rows it touched
        apply_optimizer_in_backward(torch.optim.SGD, model.ebc.parameters(), {"lr": 0.1})
    generator = {"table_wise": lambda: table_wise(rank=0), "row_wise": row_wise, "data_parallel": data_parallel}
    sharder = EmbeddingBagCollectionSharder()
    plan = ShardingPlan(
        {
            "ebc": construct_module_sharding_plan(
                model.ebc,
                {"t": generator[sharding]()},
                sharder=sharder,
                local_size=world,
                world_size=world,
                device_type="cpu",
            )
        }
    )
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    opt = torch.optim.SGD([p for _, p in in_backward_optimizer_filter(dmp.named_parameters())], lr=0.1)
    if rank == 0:
        print(f"plan: {plan}", flush=True)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    data = batches(rank, args.batch)
    losses = []
    start = time.perf_counter()
    window = TimedWindow()
    profiler = None
    for step in range(args.steps):
        if step == args.warmup:
            start = time.perf_counter()
            window.start()
            _ready(rank)
        if args.profile and rank == 0 and step == args.warmup:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            profiler.__enter__()
            profiled_from = time.perf_counter()
        if profiler is not None and step == args.warmup + args.profile_steps:
            profiler.__exit__(None, None, None)
            _write_profile(args.profile, profiler, time.perf_counter() - profiled_from, args.profile_steps)
            profiler = None
        ids, dense, label = next(data)
        opt.zero_grad()
        loss = loss_fn(dmp(to_kjt(ids, features), dense), label)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 10 == 0 or step == args.steps - 1:
            print(f"worker {rank} step {step} loss {losses[-1]:.4f}", flush=True)
    report_result(args, rank, losses, time.perf_counter() - start, window, system="torchrec", config=args.config)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="tw-fused")
    parser.add_argument("--list", action="store_true", help="print the configurations and exit")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--report", default=None, help="append each rank's JSON line here")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before the whole job is killed")
    parser.add_argument("--profile", default=None, help="rank 0: torch.profiler op table of --profile-steps steps here")
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--role", choices=["driver", "member"], default="driver", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.list:
        print("\n".join(CONFIGS))
    elif args.role == "member":
        member(args)
    else:
        sys.exit(drive(args))


if __name__ == "__main__":
    main()
