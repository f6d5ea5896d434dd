"""Multi-hot pooling in one process: fleet.nn.SparseEmbeddingBag against the two ways around it.

    python benchmarks/bag_pooling.py [--steps 50] [--repeats 3] [--dims 16 64]

One training step (forward, backward, SGD step) of a sum-pooled multi-hot feature with
per-sample weights, DLRM's shape: 256 bags per batch of 1 to 19 ids (mean 10) drawn from a
Zipf distribution over 100,000 ids. Compared, alternating, on the same batches:

- ``bag``: ``fleet.nn.SparseEmbeddingBag(dim, "sum")(ids, offsets, weights)``: pulls each unique
  id once and pools over the unique rows through the inverse index;
- ``materialised``: ``F.embedding_bag(arange(nnz), SparseEmbedding(dim)(ids), offsets, weights)``,
  what a user wrote before the bag: one row tensor per looked-up id, then pooled;
- ``torch``: ``nn.EmbeddingBag(100_000, dim, mode="sum")`` with ``sparse=True`` gradients and
  ``torch.optim.SGD``, plain PyTorch with a dense table (the peer).

Prints the median milliseconds per step of each, and the bag's speed-up over the materialised path.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from _common import record_result

import fleet

VOCAB, BAGS, MAX_LEN = 100_000, 256, 19


def batches(steps: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    zipf = 1.0 / torch.arange(1, VOCAB + 1, dtype=torch.float64) ** 1.05
    out = []
    for _ in range(steps):
        lengths = torch.randint(1, MAX_LEN + 1, (BAGS,), generator=gen)
        ids = torch.multinomial(zipf, int(lengths.sum()), replacement=True, generator=gen)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
        out.append((ids, offsets, torch.rand(ids.numel(), generator=gen)))
    return out


def run(kind: str, dim: int, data: list) -> float:
    """Median seconds per step of ``kind`` over ``data`` (after one warm-up pass over it)."""
    if kind == "torch":
        module = torch.nn.EmbeddingBag(VOCAB, dim, mode="sum", sparse=True)
    elif kind == "bag":
        module = fleet.nn.SparseEmbeddingBag(dim, mode="sum")
    else:
        module = fleet.nn.SparseEmbedding(dim)
    opt = torch.optim.SGD(module.parameters(), lr=0.01)
    times = []
    for warm in (True, False):
        for ids, offsets, weights in data:
            start = time.perf_counter()
            opt.zero_grad()
            if kind == "materialised":
                rows = module(ids)
                pooled = F.embedding_bag(
                    torch.arange(ids.numel()), rows, offsets, mode="sum", per_sample_weights=weights
                )
            else:
                pooled = module(ids, offsets, weights)
            pooled.square().sum().backward()
            opt.step()
            if not warm:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dims", type=int, nargs="+", default=[16, 64])
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = batches(args.steps)
    nnz = statistics.mean(ids.numel() for ids, _, _ in data)
    unique = statistics.mean(torch.unique(ids).numel() for ids, _, _ in data)
    print(f"{BAGS} bags a step, {nnz:.0f} ids, {unique:.0f} unique; median ms per step over {args.repeats} rounds")
    for dim in args.dims:
        results: dict[str, list[float]] = {"bag": [], "materialised": [], "torch": []}
        for _ in range(args.repeats):  # alternating, so that drift in the machine's load hits all alike
            for kind in results:
                results[kind].append(run(kind, dim, data))
        ms = {kind: 1000 * statistics.median(values) for kind, values in results.items()}
        line = (
            f"dim {dim}: bag {ms['bag']:.2f} ms, materialised {ms['materialised']:.2f} ms "
            f"(bag {ms['materialised'] / ms['bag']:.2f}x faster), torch nn.EmbeddingBag {ms['torch']:.2f} ms"
        )
        print(line)
        record_result(
            "bag_pooling",
            variant=f"dim {dim}",
            figure=f"ms per training step of a sum-pooled weighted multi-hot feature, dim {dim}, one thread",
            units="ms/step",
            fleet=ms["bag"],
            peer="SparseEmbedding rows per looked-up id, then F.embedding_bag",
            peer_value=ms["materialised"],
            ratio=ms["materialised"] / ms["bag"],
            ratio_means="materialised ms / bag ms (above 1: the bag is faster)",
            headline=False,
            summary=line,
            details={"ms": ms, "ids_per_step": nnz, "unique_per_step": unique, "steps": args.steps},
        )


if __name__ == "__main__":
    main()
