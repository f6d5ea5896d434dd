"""Parse rate of fleet.SlotDataset on one core: MultiSlot text and binary slot files, W2's samples.

Writes W2-style files (26 sparse slots of one id in [0, 1e6), 13 dense floats, a label; the
text as Paddle's MultiSlotDataGenerator prints it, ~400 bytes a line) into a temporary
directory, then reads them through ``fleet.SlotDataset`` (batches of 512, LongTensor ids)
with one intra-op thread and one BLAS thread. Samples/s are counted per CPU second of this
process (``time.process_time``: what one core delivers, less exposed to other jobs on a
shared machine) and per wall second. The peer in the same run: the plain per-line Python
parser (``line.split()``, ``int``, ``float``) on the same text.

The figure to compare with: W2's training rate, 10,000-17,000 samples/s for 2 workers on this
2-core machine (README; the script divides by 17,000). Data must be read faster than that on one
core, so it never bounds training; the last column is the share of a W2 worker's time (8,500
samples/s each) that reading its data costs when the worker parses it itself. Run: ``python benchmarks/slot_data.py [--samples 200000]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy: one core means one BLAS thread too
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from _common import record_result  # noqa: E402

from fleet.data.slot_dataset import SlotDataset, generate  # noqa: E402
from fleet.data.slot_format import SlotLayout, count_records  # noqa: E402

W2_SAMPLES_PER_S = 17_000  # W2's best training rate, 2 workers together (README): the conservative comparison
W2_WORKERS = 2


def read_rate(paths: list[str], batch: int, repeats: int) -> tuple[float, float]:
    """Median samples per CPU second and per wall second of reading every batch of ``paths``."""
    cpu, wall = [], []
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        dataset = SlotDataset(paths, batch, shard=False)
        samples = sum(len(label) for _, _, label in dataset)
        cpu.append(samples / (time.process_time() - c0))
        wall.append(samples / (time.perf_counter() - w0))
    return statistics.median(cpu), statistics.median(wall)


def python_rate(path: str, lines: int) -> float:
    """The peer: per-line Python parsing of the first ``lines`` lines, samples per CPU second."""
    c0 = time.process_time()
    ids, dense, label = [], [], []
    with open(path) as f:
        for k, line in enumerate(f):
            if k == lines:
                break
            tokens = line.split()
            dense.append([float(t) for t in tokens[1:14]])
            ids.append([int(t) for t in tokens[15:66:2]])
            label.append(float(tokens[67]))
    torch.tensor(ids), torch.tensor(dense), torch.tensor(label)
    return lines / (time.process_time() - c0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=200_000, help="in all, over 4 files")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        per_file = args.samples // 4
        text = generate(os.path.join(tmp, "text"), files=4, samples=per_file)
        binary = generate(os.path.join(tmp, "binary"), files=4, samples=per_file, binary=True)
        size = sum(os.path.getsize(p) for p in text)
        print(f"{4 * per_file:,} samples in 4 files: text {size / 2**20:.0f} MiB "
              f"({size / (4 * per_file):.0f} bytes a sample), binary "
              f"{sum(os.path.getsize(p) for p in binary) / 2**20:.0f} MiB")  # fmt: skip
        c0 = time.process_time()
        for path in text:
            count_records(path, SlotLayout())
        count_s = time.process_time() - c0
        results = {}
        for name, paths in (("text", text), ("binary", binary)):
            results[name] = read_rate(paths, args.batch, args.repeats)
        peer = python_rate(text[0], min(per_file, 20_000))
    per_worker = W2_SAMPLES_PER_S / W2_WORKERS
    print(f"{'format':8s} {'samples/s (1 core, CPU time)':>30s} {'samples/s (wall)':>18s} {'x W2 training':>14s} "
          f"{'of a W2 worker':>15s}")  # fmt: skip
    for name, (cpu, wall) in results.items():
        print(f"{name:8s} {cpu:30,.0f} {wall:18,.0f} {cpu / W2_SAMPLES_PER_S:14.1f} {per_worker / cpu:15.2%}")
    print(f"{'python':8s} {peer:30,.0f} {'':>18s} {peer / W2_SAMPLES_PER_S:14.1f} {per_worker / peer:15.2%}"
          "   (per-line Python parsing, the peer)")  # fmt: skip
    print(f"text / per-line Python: {results['text'][0] / peer:.1f}x; binary / text: "
          f"{results['binary'][0] / results['text'][0]:.0f}x")  # fmt: skip
    print(f"counting the text's samples (every worker, once): {size / 2**20 / count_s:,.0f} MiB/s")
    text_rate, binary_rate = results["text"][0], results["binary"][0]
    record_result(
        "slot_data",
        variant="text / binary",
        figure=f"fleet.SlotDataset reading W2 samples in batches of {args.batch} on one core (samples per CPU second)",
        units="samples/s",
        fleet=round(text_rate, 1),
        peer="per-line Python parsing",
        peer_value=round(peer, 1),
        ratio=round(text_rate / peer, 3),
        ratio_means="fleet text / per-line Python (higher is better)",
        target="> W2's training rate",
        summary=f"{text_rate:,.0f} text / {binary_rate / 1e6:.1f} M binary samples/s "
        f"({text_rate / W2_SAMPLES_PER_S:.1f}x / {binary_rate / W2_SAMPLES_PER_S:,.0f}x W2's {W2_SAMPLES_PER_S:,}); "
        f"per-line Python {peer:,.0f}",
        details={
            "binary_samples_per_s": round(binary_rate, 1),
            "wall": {k: round(v[1], 1) for k, v in results.items()},
            "count_mib_per_s": round(size / 2**20 / count_s, 1),
        },
    )


if __name__ == "__main__":
    main()
