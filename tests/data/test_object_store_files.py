"""Data files in a bucket (moto's S3 server, tests/s3_server.py): fleet.file_shard and fleet.SlotDataset take
lists of s3:// URLs, check that each one is there through the store, and read them as they read local files."""

from __future__ import annotations

import pytest
import torch

import fleet
from fleet.data.slot_dataset import generate


def uploaded(bucket: str, tmp_path, binary: bool) -> tuple[list[str], list[str]]:
    """Four parts written locally, then copied into the bucket: (local paths, their URLs)."""
    import fsspec

    local = generate(tmp_path / ("bin" if binary else "txt"), files=4, samples=[40, 30, 30, 20], binary=binary)
    fs = fsspec.filesystem("s3")
    urls = []
    for path in local:
        url = f"{bucket}/data/{path.rsplit('/', 1)[-1]}"
        fs.put_file(path, url)
        urls.append(url)
    return local, urls


def test_file_shard_takes_urls_and_names_the_one_that_is_missing(bucket: str, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FLEET_ROLE", "worker")
    monkeypatch.setenv("FLEET_WORKER_INDEX", "1")
    monkeypatch.setenv("FLEET_WORKER_NUM", "2")
    monkeypatch.setenv("FLEET_MASTER", "127.0.0.1:29999")
    _, urls = uploaded(bucket, tmp_path, binary=False)
    assert fleet.file_shard(urls) == urls[2:]  # worker 1 of 2: the second half, as for local files
    missing = f"{bucket}/data/part-00009.txt"
    with pytest.raises(FileNotFoundError, match=f"data file '{missing}' does not exist"):
        fleet.file_shard([*urls, missing])


@pytest.mark.parametrize("binary", [False, True])
def test_slot_dataset_reads_a_bucket_as_it_reads_local_files(bucket: str, tmp_path, binary: bool) -> None:
    local, urls = uploaded(bucket, tmp_path, binary)
    from_disk = list(fleet.SlotDataset(local, batch_size=16, shard=False, chunk_bytes=1 << 10))
    from_bucket = fleet.SlotDataset(urls, batch_size=16, shard=False, chunk_bytes=1 << 10)
    assert from_bucket.samples == 120 and len(from_bucket) == len(from_disk) == 7
    for got, want in zip(from_bucket, from_disk, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
