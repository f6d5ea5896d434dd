"""CPU time of one W6 step of a ``fleet.nn.SparseFeatureCollection`` alone, in one process.

The collection's forward over W6's 8 tables (``benchmarks/peers/dlrm_workload.py``: bags of ~10 Zipf ids,
the union of two workers' batches as fleet-1p trains on), a fixed linear loss on the pooled vectors,
its backward and the row optimizer's step: the per-table fixed cost (Python and torch dispatch) that
W6's fleet-1p and each table-wise holder pay. CPU time (``time.thread_time``), not wall clock, so a
shared machine changes it less; the batches are made before the clock starts.

    python benchmarks/collection_step.py --steps 200 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))

import dlrm_workload as W  # noqa: E402
import torch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, default=20, help="distinct batches cycled through")
    parser.add_argument("--sizes", default="full")
    parser.add_argument("--workers", type=int, default=2, help="batches of this many workers, as one")
    parser.add_argument("--batch", type=int, default=256, help="samples per worker (8: little but the fixed cost)")
    parser.add_argument("--profile", default="", help="write a cProfile of the timed steps here")
    args = parser.parse_args()

    import fleet
    from fleet.nn import FeatureTable

    torch.set_num_threads(1)
    fleet.init()
    spec = W.spec(args.sizes, args.batch)
    names = spec.names
    collection = fleet.nn.SparseFeatureCollection(
        [FeatureTable(n, dim, seed=i) for i, (n, (_, dim)) in enumerate(zip(names, spec.tables, strict=True))]
    )
    weights = [torch.randn(dim, generator=torch.Generator().manual_seed(i)) for i, (_, dim) in enumerate(spec.tables)]
    anchor = torch.zeros(1, requires_grad=True)  # a dense parameter, so the optimizer has one as in W6
    opt = fleet.distributed_optimizer(torch.optim.SGD([anchor, *collection.parameters()], lr=W.LR))
    batches = []
    for s in range(args.batches):
        _, feats, _ = W.union([W.make_batch(spec, w, s) for w in range(args.workers)])
        batches.append({n: {"ids": ids, "offsets": off} for n, (ids, off) in zip(names, feats, strict=True)})

    phases = [0.0, 0.0, 0.0]
    last = [0.0]  # the last step's loss: the same bits before and after a change of the collection's code

    def step(k: int) -> float:
        t0 = time.thread_time()
        opt.zero_grad()
        pooled = collection(batches[k % len(batches)])
        loss = sum((pooled[n] @ w).sum() for n, w in zip(names, weights, strict=True)) + anchor.sum()
        t1 = time.thread_time()
        loss.backward()
        t2 = time.thread_time()
        opt.step()
        t3 = time.thread_time()
        phases[0] += t1 - t0
        phases[1] += t2 - t1
        phases[2] += t3 - t2
        last[0] = loss.item()
        return last[0]

    for k in range(20):  # warm: rows created, caches filled
        step(k)
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
    per_step = []
    phases[:] = [0.0, 0.0, 0.0]
    for _ in range(args.repeats):
        if profiler:
            profiler.enable()
        t0 = time.thread_time()
        for k in range(args.steps):
            step(k)
        per_step.append((time.thread_time() - t0) / args.steps * 1e3)
        if profiler:
            profiler.disable()
    if profiler:
        profiler.dump_stats(args.profile)
    best, med = min(per_step), sorted(per_step)[len(per_step) // 2]
    n = args.steps * args.repeats
    fwd, bwd, opt_step = (x / n * 1e3 for x in phases)
    print(f"phases CPU ms: forward {fwd:.3f} backward {bwd:.3f} step {opt_step:.3f}; last loss {last[0]!r}")
    print(f"collection step CPU ms: min {best:.3f} median {med:.3f} ({' '.join(f'{x:.3f}' for x in per_step)})")


if __name__ == "__main__":
    main()
