"""SlotDataset: CTR samples streamed from files, the same number of batches on every worker.

    files = sorted(glob.glob("data/part-*"))           # the whole job's list, on every worker
    dataset = fleet.SlotDataset(files, batch_size=512)  # this worker reads fleet.file_shard(files)
    for ids, dense, label in dataset:                   # LongTensor [B, 26], float32 [B, 13], float32 [B]
        ...

Files are Paddle's MultiSlot text or fleet's binary record format (``fleet.data.slot_format``
describes both; a file's first bytes say which). Each worker reads its share in list order,
chunk by chunk, and yields full batches that may span files.

**Equal batch counts.** Shares differ in size, and a worker that runs out of batches early
would leave the others waiting in a collective or a sync parameter-server step. Every
worker counts the samples of every file in the list (binary: from the file size; text: by
counting newlines, one read of every file) and so computes every worker's share without
any communication; each epoch then stops after ``min(share) // batch_size`` batches on
every worker. The samples left over (``dataset.dropped`` on this worker) are not read;
the constructor logs the count once. A worker whose share is smaller than one batch
(more workers than files, say) makes the constructor raise on every worker alike.

Iterate the dataset directly, or through ``DataLoader(dataset, batch_size=None,
num_workers=1)`` to parse in a background process. It is sharded already:
``fleet.distributed_loader`` passes such a loader's batches through unsplit.

``python -m fleet.data.slot_dataset generate DIR`` writes a small W2-style sample; ``python -m
fleet.data.slot_dataset convert IN OUT`` turns a text file into the faster binary format.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from fleet.data import files as job_files
from fleet.data.slot_format import (
    DEFAULT_CHUNK_BYTES,
    SlotLayout,
    convert,
    count_records,
    read_chunks,
    write_binary,
    write_text,
)

log = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class SlotDataset(IterableDataset):
    """This worker's batches ``(ids [B, sparse_slots] int64, dense [B, dense] float32, label [B] float32)``.

    ``files``: the whole job's list, the same on every worker (``shard=False``: read all of
    them, no splitting). Attributes: ``files`` (this worker's share), ``samples`` (in it),
    ``num_batches`` (per epoch, equal on every worker; also ``len(dataset)``), ``dropped``
    (samples of this worker's share left unread each epoch).
    """

    shards_itself = True  # fleet.distributed_loader passes its batches through unsplit

    def __init__(
        self,
        files: Sequence[str | os.PathLike],
        batch_size: int,
        *,
        sparse_slots: int = 26,
        dense: int = 13,
        shard: bool = True,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size({batch_size}) must be at least 1")
        names = job_files.check_files(files, "fleet.SlotDataset")
        self.layout = SlotLayout(sparse_slots, dense)
        self.batch_size = batch_size
        self.chunk_bytes = chunk_bytes
        index, workers = job_files.worker_position() if shard else (0, 1)
        if index < 0:
            raise ValueError("fleet.SlotDataset on a parameter server: servers read no data.")
        shares = job_files.split_files(names, workers)
        counts = {name: count_records(name, self.layout) for name in names}
        sizes = [sum(counts[name] for name in share) for share in shares]
        smallest = min(range(workers), key=sizes.__getitem__)
        self.files = shares[index]
        self.samples = sizes[index]
        self.num_batches = sizes[smallest] // batch_size
        if self.num_batches == 0:
            files_there = f"{len(shares[smallest])} files" if shares[smallest] else "no file"
            raise ValueError(
                f"fleet.SlotDataset: worker {smallest} of {workers} gets {files_there} with {sizes[smallest]} samples, "
                f"less than one batch of {batch_size}; every worker must train the same number of batches. "
                f"Use a smaller batch_size, more data, or at least {workers} files of similar size."
            )
        self.dropped = self.samples - self.num_batches * batch_size
        log.info(
            "worker %d of %d reads %d of %d files (%d samples): %d batches of %d per epoch on every worker, "
            "%d samples of this share left unread (the smallest share, worker %d's, has %d)",
            index, workers, len(self.files), len(names), self.samples, self.num_batches, batch_size,
            self.dropped, smallest, sizes[smallest],
        )  # fmt: skip

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        if info is not None and info.num_workers > 1:
            raise RuntimeError(
                f"fleet.SlotDataset is read by {info.num_workers} DataLoader workers, each of which would yield every "
                "batch. Use num_workers=0 or 1 (with batch_size=None)."
            )
        return self._batches()

    def _batches(self) -> Iterator[Batch]:
        size, left = self.batch_size, self.num_batches
        pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        have = 0
        for chunk in self._chunks():
            pending.append(chunk)
            have += len(chunk[2])
            if have < size:
                continue
            ids, dense, label = (
                np.concatenate(part) if len(pending) > 1 else part[0] for part in zip(*pending, strict=True)
            )
            full = min(have // size, left)
            for k in range(full):
                rows = slice(k * size, (k + 1) * size)
                yield torch.from_numpy(ids[rows]), torch.from_numpy(dense[rows]), torch.from_numpy(label[rows])
            left -= full
            if left == 0:
                return
            rest = slice(full * size, None)
            pending, have = [(ids[rest], dense[rest], label[rest])], have - full * size

    def _chunks(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        for name in self.files:
            yield from read_chunks(name, self.layout, self.chunk_bytes)


# --- sample data ---------------------------------------------------------------------


def ctr_samples(samples: int, seed: int, sparse_slots: int = 26, dense: int = 13, id_space: int = 1_000_000):
    """W2's synthetic CTR data: ids uniform in [0, id_space), dense ~ N(0, 1), label = dense @ w_true > 0.

    ``w_true`` is the one of examples/single_to_multi/train_ctr.py (``torch.randn(dense)`` from seed 0).
    """
    w_true = torch.randn(dense, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, id_space, (samples, sparse_slots), generator=g)
    values = torch.randn(samples, dense, generator=g)
    return ids, values, (values @ w_true > 0).float()


def generate(
    directory: str | os.PathLike,
    files: int = 4,
    samples: int | Sequence[int] = 10_000,
    binary: bool = False,
    seed: int = 0,
) -> list[str]:
    """Write a W2-style sample data set (``ctr_samples``) into ``directory``; returns the paths.

    ``samples``: per file, or one count for each file (uneven shares, for tests).
    """
    counts = [samples] * files if isinstance(samples, int) else list(samples)
    os.makedirs(directory, exist_ok=True)
    paths = []
    for k, count in enumerate(counts):
        path = os.path.join(os.fspath(directory), f"part-{k:05d}.{'bin' if binary else 'txt'}")
        ids, dense, label = ctr_samples(count, seed=seed * 100_003 + k + 1)
        (write_binary if binary else write_text)(path, ids, dense, label)
        paths.append(path)
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fleet.data.slot_dataset", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="write a W2-style sample data set")
    gen.add_argument("directory")
    gen.add_argument("--files", type=int, default=4)
    gen.add_argument("--samples", type=int, default=10_000, help="per file")
    gen.add_argument("--binary", action="store_true", help="binary records instead of MultiSlot text")
    gen.add_argument("--seed", type=int, default=0)
    conv = commands.add_parser("convert", help="MultiSlot text file -> binary slot file")
    conv.add_argument("source")
    conv.add_argument("target")
    conv.add_argument("--sparse-slots", type=int, default=26)
    conv.add_argument("--dense", type=int, default=13)
    args = parser.parse_args(argv)
    if args.command == "generate":
        for path in generate(args.directory, args.files, args.samples, args.binary, args.seed):
            print(path)
    else:
        count = convert(args.source, args.target, SlotLayout(args.sparse_slots, args.dense))
        print(f"{args.target}: {count} samples")


__all__ = ["SlotDataset", "ctr_samples", "generate"]

if __name__ == "__main__":
    main()
