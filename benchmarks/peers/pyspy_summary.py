"""Where one W2 worker's time goes, from a py-spy profile (benchmarks/README.md, W2 "where the time goes").

    py-spy record --idle --nonblocking --format raw -r 100 -d 10 -o prof.txt --pid PID   # a running worker
    python benchmarks/peers/pyspy_summary.py fleet prof.txt                  # or torchrec / paddle

Only the training thread's samples count (the stacks through the training loop: train_ctr.py's
``main``, or the peers' ``member``); each is put in the first category whose pattern its stack
matches (the rules below, most specific first), and the shares are printed as percentages of
the training thread's wall time (record with ``--idle`` so that its waits are sampled too).
Other threads (heartbeats, I/O pollers) are listed apart, by their busy (not waiting) samples.
Standard library only: runs in any of the venvs.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

# (category, regex over the ';'-joined stack); first match wins
RULES = {
    "fleet": [
        ("data generation", r"batches \(train_ctr\.py|SlotDataset|slot_data"),
        ("step metrics file (fleet.telemetry.timing write)", r"StepMetrics\.write|write_atomic"),
        (
            "sparse pull: wait for the server",
            r"SparseEmbedding\.forward.*(RemoteRows\.pull|Future\.result|Condition\.wait)",
        ),
        ("sparse lookup, local (unique, index_select)", r"SparseEmbedding\.forward"),
        ("push gradients + pull dense (opt.step)", r"PSOptimizer\.step|WrappedOptimizer|fleet/ps/"),
        ("MLP backward (autograd)", r"Tensor\.backward|_engine_run_backward"),
        ("MLP forward + loss", r"Linear\.forward|ReLU|relu|CTRModel\.forward|binary_cross_entropy|BCEWithLogits"),
        ("zero_grad", r"zero_grad"),
    ],
    "torchrec": [
        ("data generation", r"batches \(w2_torchrec\.py"),
        (
            "input KJT / distribution of ids (all-to-all)",
            r"to_kjt|input_dist|KJTAllToAll|_kjt_all_to_all|KeyedJaggedTensor",
        ),
        (
            "embedding backward + fused SGD (FBGEMM)",
            r"backward.*(split_embedding|embedding_codegen|SplitTableBatched|lookup_function|_fused|batched_embedding|fbgemm)",
        ),
        (
            "pooled embeddings all-to-all / reduce-scatter (output dist)",
            r"output_dist|PooledEmbeddingsAllToAll|alltoall_pooled|reduce_scatter|all_to_all",
        ),
        (
            "DDP all-reduce of the MLP gradients",
            r"allreduce|all_reduce|Reducer|reducer|_sync_params|DistributedDataParallel.*backward",
        ),
        (
            "embedding lookup forward (FBGEMM)",
            r"ShardedEmbeddingBagCollection|EmbeddingBagCollection|compute_and_output_dist|split_embedding|fbgemm|BatchedFusedEmbedding|lookup",
        ),
        ("MLP backward (autograd)", r"Tensor\.backward|_engine_run_backward"),
        ("MLP forward + loss", r"Linear\.forward|ReLU|relu|CTR\.forward|binary_cross_entropy|BCEWithLogits"),
        ("optimizer step (MLP)", r"SGD\.step|Optimizer\.step|_single_tensor_sgd|_multi_tensor_sgd"),
        ("zero_grad", r"zero_grad"),
    ],
    "paddle": [
        ("data generation", r"batches \(w2_paddle\.py|write_slots"),
        ("dense pull after each step (_pull_all_dense)", r"_pull_all_dense|_dense_puller|pull_dense"),
        (
            "executor run (forward, backward, sparse pull/push in C++)",
            r"Executor\.run|_run_impl|_run_program|train_from_dataset|libpaddle",
        ),
    ],
}
MAIN = {
    "fleet": r"main \(train_ctr\.py",
    "torchrec": r"member \(w2_torchrec\.py",
    "paddle": r"member \(w2_paddle\.py",
}
# a stack whose innermost frame is one of these is waiting, not working (with py-spy --idle)
IDLE = r"(poll|wait|sleep|select|futex|recv_multipart|acquire|garbage\.py|accept)[^;]*(;0x[0-9a-f]+ \([^;]*)*$"


def read(path: str) -> Counter:
    stacks: Counter = Counter()
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            stack, _, count = line.rpartition(" ")
            if stack and count.isdigit():
                stacks[stack] += int(count)
    return stacks


def summarize(system: str, stacks: Counter) -> tuple[Counter, int, Counter]:
    rules = [(name, re.compile(pattern)) for name, pattern in RULES[system]]
    main = re.compile(MAIN[system])
    idle = re.compile(IDLE)
    shares: Counter = Counter()
    others: Counter = Counter()
    total = 0
    for stack, n in stacks.items():
        if not main.search(stack):
            if not idle.search(stack):
                frames = [f for f in stack.split(";") if "(" in f and "threading.py" not in f and "libc" not in f]
                others[frames[min(3, len(frames) - 1)] if frames else stack[:80]] += n
            continue
        total += n
        for name, pattern in rules:
            if pattern.search(stack):
                shares[name] += n
                break
        else:
            shares["other (Python glue, framework overhead)"] += n
    return shares, total, others


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("system", choices=sorted(RULES))
    parser.add_argument("profile", help="py-spy record --format raw output")
    parser.add_argument("--others", type=int, default=5, help="busy frames of other threads to list")
    args = parser.parse_args()
    shares, total, others = summarize(args.system, read(args.profile))
    print(f"{args.system}: {total} samples of the training thread")
    for name, n in shares.most_common():
        print(f"  {100 * n / max(total, 1):5.1f} %  {name}")
    if others and args.others:
        print("  other threads, busy samples (share of the training thread's count):")
        for frame, n in others.most_common(args.others):
            print(f"  {100 * n / max(total, 1):5.1f} %  {frame}")


if __name__ == "__main__":
    main()
