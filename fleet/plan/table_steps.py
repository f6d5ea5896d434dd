"""The tables' step under each placement, measured: what the placement model cannot derive from rates.

Sharding a collection's tables across the workers adds per step what no row rate predicts: the
routing of each id, the fixed cost of every exchange and of the tensors it builds, the holders'
pooling of the union batch (table-wise). On W6 the model's estimate from lookup rates (two row
lookups per routed id) saw a sixth of what sharding rows cost a worker and ranked table-wise and
row-wise within its resolution, where table-wise measured 1.26 x faster. So the calibration's
planner runs this file as a two-worker job per placement (a job trains under one strategy)::

    fleetrun --workers 2 fleet/plan/table_steps.py --tables collection:16:1500:2560:1,... \
        --batch 256 --placement table_wise --out steps.json

It builds a stand-in of the script's tables (the same kind of module, widths, features, ids and
unique ids per step, as the probe saw them), trains it a few steps alone on each worker
(``local``, before ``fleet.init()``: the tables as the probe timed them), then placed that way across both
workers, and worker 0 writes the median seconds per step of each. The placement model charges a
sharded candidate the difference (:func:`fleet.plan.placement.measured_extra_s`).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # run as a file: this package's own directory must not shadow top-level modules

import argparse
import json
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

PLACEMENTS = ("replicated", "sharded", "table_wise")
WARMUP_STEPS = 3  # the rows exist after these (the ids come from a space a few steps fill)
LR = 0.01


@dataclass(frozen=True)
class TableShape:
    """One table as the probe saw it: how it is looked up, its width, features, and ids per worker-step."""

    kind: str  # "collection" (a SparseFeatureCollection's FeatureTable), "bag" or "embedding"
    dim: int
    unique: int  # unique ids per step
    lookups: int  # ids per step, repeats included
    features: int = 1

    def encode(self) -> str:
        return f"{self.kind}:{self.dim}:{self.unique}:{self.lookups}:{self.features}"

    @classmethod
    def decode(cls, text: str) -> TableShape:
        kind, dim, unique, lookups, features = text.split(":")
        if kind not in ("collection", "bag", "embedding"):
            raise ValueError(f"table shape {text!r}: kind must be collection, bag or embedding")
        shape = cls(kind, int(dim), int(unique), int(lookups), int(features))
        if min(shape.dim, shape.lookups, shape.features) < 1 or shape.unique < 0:
            raise ValueError(f"table shape {text!r}: width, lookups and features must be at least 1")
        return shape


def encode_all(shapes: list[TableShape]) -> str:
    return ",".join(s.encode() for s in shapes)


def decode_all(text: str) -> list[TableShape]:
    return [TableShape.decode(part) for part in text.split(",") if part]


def id_space(draws: int, unique: int) -> int:
    """The size of a uniform id space in which ``draws`` ids give about ``unique`` distinct ones."""
    unique = min(max(1, unique), draws)
    if unique >= 0.999 * draws:
        return 1 << 40
    lo, hi = float(unique), float(unique) * 1e6
    for _ in range(100):  # s (1 - exp(-draws / s)) grows with s: bisect
        mid = (lo + hi) / 2
        if mid * -math.expm1(-draws / mid) < unique:
            lo = mid
        else:
            hi = mid
    return max(unique, round(hi))


class _StandIn(torch.nn.Module):
    """The tables, looked up as the script looks them up, summed into a scalar loss."""

    def __init__(self, shapes: list[TableShape], batch: int, seed: int):
        from fleet.nn import FeatureTable, SparseEmbedding, SparseEmbeddingBag, SparseFeatureCollection

        super().__init__()
        self.shapes, self.batch = shapes, batch
        self.generator = torch.Generator().manual_seed(seed)
        grouped = [(i, s) for i, s in enumerate(shapes) if s.kind == "collection"]
        self.collection = (
            SparseFeatureCollection(
                [FeatureTable(f"t{i}", s.dim, [f"t{i}f{f}" for f in range(s.features)], seed=i) for i, s in grouped]
            )
            if grouped
            else None
        )
        self.single = torch.nn.ModuleDict(
            {
                f"t{i}": SparseEmbeddingBag(s.dim, mode="sum", seed=i)
                if s.kind == "bag"
                else SparseEmbedding(s.dim, seed=i)
                for i, s in enumerate(shapes)
                if s.kind != "collection"
            }
        )
        self.spaces = [id_space(s.lookups, s.unique) for s in shapes]

    def _bag_length(self, s: TableShape) -> int:
        return max(1, round(s.lookups / (self.batch * s.features)))

    def batch_input(self) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]]:
        g, features, single = self.generator, {}, {}
        for i, s in enumerate(self.shapes):
            if s.kind == "collection":
                length = self._bag_length(s)
                for f in range(s.features):
                    ids = torch.randint(self.spaces[i], (self.batch * length,), generator=g)
                    features[f"t{i}f{f}"] = (ids, torch.full((self.batch,), length, dtype=torch.int64))
            elif s.kind == "bag":
                single[f"t{i}"] = torch.randint(self.spaces[i], (self.batch, self._bag_length(s)), generator=g)
            else:
                single[f"t{i}"] = torch.randint(self.spaces[i], (s.lookups,), generator=g)
        return features, single

    def forward(self, features: dict, single: dict) -> torch.Tensor:
        loss = torch.zeros(())
        if self.collection is not None:
            loss = loss + sum(v.sum() for v in self.collection(features).values())
        for name, ids in single.items():
            loss = loss + self.single[name](ids).sum()
        return loss


def seconds_per_step(shapes: list[TableShape], batch: int, steps: int, placement: str | None, seed: int) -> float:
    """Median seconds of a training step of the stand-in: ``placement`` None trains it alone in this process,
    else sharded that way across the job's workers (collective mode)."""
    import fleet
    from fleet.strategy import DistributedStrategy

    model = _StandIn(shapes, batch, seed)
    opt: Any = torch.optim.SGD(model.parameters(), lr=LR)
    if placement is not None:
        opt = fleet.distributed_optimizer(opt, DistributedStrategy(mode="collective", table_placement=placement))
    inputs = [model.batch_input() for _ in range(WARMUP_STEPS + steps)]
    times = []
    for i, (features, single) in enumerate(inputs):
        started = time.perf_counter()
        opt.zero_grad()
        model(features, single).backward()
        opt.step()
        if i >= WARMUP_STEPS:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tables", required=True, help="KIND:DIM:UNIQUE:LOOKUPS:FEATURES,... (TableShape)")
    parser.add_argument("--batch", type=int, default=256, help="samples per worker-step")
    parser.add_argument("--placement", required=True, choices=PLACEMENTS)
    parser.add_argument("--steps", type=int, default=15, help="timed steps (after the warm-up)")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    try:
        shapes = decode_all(args.tables)
    except ValueError as error:
        parser.error(str(error))
    if not shapes:
        parser.error("--tables names no table")
    import fleet

    torch.set_num_threads(1)
    # alone first, before the job's strategy takes the tables (each worker on its own core, at once)
    local = seconds_per_step(shapes, args.batch, args.steps, None, seed=0)
    fleet.init()
    placed = seconds_per_step(shapes, args.batch, args.steps, args.placement, seed=fleet.worker_index())
    if fleet.worker_index() == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps({"local": local, args.placement: placed, "batch": args.batch}))
        os.replace(tmp, args.out)
    fleet.stop_worker()


if __name__ == "__main__":
    main()
