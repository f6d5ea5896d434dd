"""W6 (DLRM) on TorchRec 1.8.0 and on plain DDP: the peers of ``benchmarks/w6_dlrm.py``.

    benchmarks/peers/.venvs/torchrec/bin/python benchmarks/peers/w6_torchrec.py --config tw-fused [--steps 100]
    python benchmarks/peers/w6_torchrec.py --config ddp      # plain PyTorch: any interpreter with torch

Configurations (``--config``), all over 2 processes (``torch.distributed.run``, gloo, 127.0.0.1),
batch 256 per rank, the model and data of ``dlrm_workload.py`` (the same tensors as fleet's workers):

- ``tw-fused``: TorchRec's ``EmbeddingBagCollection`` (one table per feature, sum pooling) under
  ``DistributedModelParallel``, tables sharded table-wise (table i on rank i % 2), FBGEMM's fused
  CPU kernel with the SGD update inside the backward (``apply_optimizer_in_backward``);
- ``rw-fused``: the same, every table sharded row-wise over both ranks;
- ``auto``: the same, the plan chosen by TorchRec's ``EmbeddingShardingPlanner`` for 2 CPU ranks;
- ``dp``: every table replicated (data parallel), its dense gradient all-reduced (1 GB a step at
  the ``full`` sizes: not in w6_dlrm.py's default configurations);
- ``ddp``: no TorchRec: plain ``DistributedDataParallel`` over the model with ``nn.EmbeddingBag``
  tables (sum, ``sparse=True``: each replica holds every table, the sparse gradients are averaged by
  DDP) and ``torch.optim.SGD``.

The dense part is replicated with DDP (gradients averaged). The sharded tables' fused SGD runs
with lr 0.5 / 2: a sharded table's gradient is the sum of both ranks' (each the gradient of its
own mean loss), twice the gradient of the mean loss over both batches, which fleet's synchronous
PS and DDP apply; so every configuration makes the same update from the same gradients.

Without ``--role`` this is the driver: it runs torchrun on this file, bounded by ``--timeout``, and
prints each rank's JSON line ``{"worker", "losses", "samples_per_s"}`` (also appended to ``--report``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import dlrm_workload as W
from peer_procs import TimedWindow, kill_group, read_report
from w2_torchrec import free_port

WORKERS = 2
CONFIGS = ("tw-fused", "rw-fused", "auto", "dp", "ddp")


def drive(args: argparse.Namespace) -> int:
    folder = tempfile.mkdtemp(prefix="w6-torchrec-")
    report = args.report or os.path.join(folder, "report.jsonl")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(WORKERS)]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(free_port()), os.path.abspath(__file__)]
    cmd += ["--role", "member", "--config", args.config, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmd += ["--sizes", args.sizes, "--batch", str(args.batch), "--init", args.init, "--report", report]
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
        rc = 0  # every rank reported; one was aborted in gloo's teardown at exit (see w2_torchrec.py)
    if rc != 0 or len(results) != WORKERS:
        print(
            f"w6 {args.config}: failed (rc {rc}, {len(results)} of {WORKERS} ranks reported,"
            f" {time.perf_counter() - started:.0f} s)\n{out[-4000:]}",
            file=sys.stderr,
        )
        return rc or 1
    for r in results:
        print(json.dumps(r), flush=True)
    shutil.rmtree(folder, ignore_errors=True)
    return 0


def _torchrec_model(spec: W.Spec, config: str, rank: int, world: int):
    """(DistributedModelParallel over an EBC + the dense part, the dense optimizer, the KJT maker)."""
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, data_parallel, row_wise, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    names = spec.names

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dense = W.dense_part(spec)
            self.ebc = EmbeddingBagCollection(
                tables=[
                    EmbeddingBagConfig(
                        name=name,
                        embedding_dim=dim,
                        num_embeddings=rows,
                        feature_names=[name],
                        pooling=PoolingType.SUM,
                        init_fn=lambda w: W.init_table_(w, spec),
                    )
                    for name, (rows, dim) in zip(names, spec.tables, strict=True)
                ],
                device=torch.device("meta"),  # materialized by DistributedModelParallel on its shards
            )

        def forward(self, dense: torch.Tensor, kjt) -> torch.Tensor:
            pooled = self.ebc(kjt)
            return self.dense(dense, [pooled[name] for name in names])

    model = Model()
    sharder = EmbeddingBagCollectionSharder()
    if config != "dp":  # the tables' SGD inside FBGEMM's backward, on the rows it touched
        apply_optimizer_in_backward(torch.optim.SGD, model.ebc.parameters(), {"lr": W.LR / world})
    if config == "auto":
        from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

        planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"))
        plan = planner.collective_plan(model, [sharder], torch.distributed.GroupMember.WORLD)
    else:
        choose = {
            "tw-fused": lambda i: table_wise(rank=i % world),
            "rw-fused": lambda i: row_wise(),
            "dp": lambda i: data_parallel(),
        }[config]
        per_table = {name: choose(i) for i, name in enumerate(names)}
        plan = ShardingPlan(
            {
                "ebc": construct_module_sharding_plan(
                    model.ebc, per_table, sharder=sharder, local_size=world, world_size=world, device_type="cpu"
                )
            }
        )
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    opt = torch.optim.SGD([p for _, p in in_backward_optimizer_filter(dmp.named_parameters())], lr=W.LR)
    tables = plan.plan["ebc"]
    layout = {name: f"{tables[name].sharding_type} {_ranks(tables[name])}" for name in names}

    def kjt(feats: list) -> KeyedJaggedTensor:
        lengths = [torch.diff(offsets, append=torch.tensor([ids.numel()])) for ids, offsets in feats]
        return KeyedJaggedTensor(
            keys=names,
            values=torch.cat([ids for ids, _ in feats]),
            lengths=torch.cat(lengths).to(torch.int32),
        )

    return dmp, opt, kjt, layout


def _ranks(sharding) -> str:
    """The ranks that hold a table's shards ('all' when it is replicated)."""
    placements = getattr(sharding, "ranks", None)
    return "all" if not placements else "on " + ",".join(str(r) for r in sorted(set(placements)))


def member(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = W.spec(args.sizes, args.batch, args.init)
    if args.config == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(W.TorchDLRM(spec))
        opt = torch.optim.SGD(model.parameters(), lr=W.LR)

        layout = {name: "replicated (DDP)" for name in spec.names}

        def forward(dense, feats):
            return model(dense, feats)
    else:
        model, opt, kjt, layout = _torchrec_model(spec, args.config, rank, world)

        def forward(dense, feats):
            return model(dense, kjt(feats))

    loss_fn = torch.nn.BCEWithLogitsLoss()
    losses = []
    dist.barrier()
    start = time.perf_counter()
    window = TimedWindow()
    for step in range(args.steps):
        if step == args.warmup:
            start = time.perf_counter()
            window.start()
        dense, feats, label = W.make_batch(spec, rank, step)
        opt.zero_grad()
        loss = loss_fn(forward(dense, feats), label)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    elapsed = time.perf_counter() - start
    timed = max(args.steps - args.warmup, 0)
    result = {
        "worker": rank,
        "losses": losses,
        "samples_per_s": timed * args.batch / elapsed,
        **window.fields(timed * args.batch),
        "config": args.config,
        "plan": layout,
    }
    with open(args.report, "a") as f:
        f.write(json.dumps(result) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=CONFIGS, default="tw-fused")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--sizes", default="full", help="the tables: " + ", ".join(W.SIZES))
    parser.add_argument("--init", default="uniform", choices=["uniform", "zeros"])
    parser.add_argument("--report", default=None, help="append each rank's JSON line here")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before the whole job is killed")
    parser.add_argument("--role", choices=["driver", "member"], default="driver", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "member":
        member(args)
    else:
        sys.exit(drive(args))


if __name__ == "__main__":
    main()
