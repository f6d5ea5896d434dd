"""Streaming CTR data: fleet.file_shard, the MultiSlot text and binary formats, SlotDataset's equal batch counts."""

from __future__ import annotations

import json
import os
import subprocess
import warnings

import numpy as np
import pytest
import torch

import fleet
import fleet.api
from dist_harness import LAUNCHER_NAMES, LAUNCHER_PREFIXES, clean_env, fleetrun_command
from fleet.data import files as job_files
from fleet.data.slot_dataset import SlotDataset, ctr_samples, generate
from fleet.data.slot_format import SlotLayout, convert, count_records, read_chunks, write_binary, write_text

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN_CTR = os.path.join(ROOT, "examples", "single_to_multi", "train_ctr.py")


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    """A plain process: no launcher's variables, no fleet.init."""
    for name in list(os.environ):
        if name.startswith(LAUNCHER_PREFIXES) or name in LAUNCHER_NAMES:
            monkeypatch.delenv(name)
    fleet.api._reset_for_tests()
    yield
    fleet.api._reset_for_tests()


def as_worker(monkeypatch, index: int, workers: int) -> None:
    monkeypatch.setattr(job_files, "worker_position", lambda: (index, workers))


def touch(tmp_path, count: int) -> list[str]:
    names = [str(tmp_path / f"f{k}") for k in range(count)]
    for name in names:
        open(name, "w").close()
    return names


def read_all(path, layout=None, chunk_bytes=4 << 20):
    parts = list(read_chunks(str(path), layout or SlotLayout(), chunk_bytes))
    return [np.concatenate(p) for p in zip(*parts, strict=True)]


# --- file_shard ----------------------------------------------------------------------


def test_shares_are_contiguous_cover_every_file_once_and_differ_by_at_most_one():
    for files in range(0, 40):
        names = [f"f{k}" for k in range(files)]
        for workers in range(1, 13):
            shares = job_files.split_files(names, workers)
            assert len(shares) == workers
            assert sum(shares, []) == names  # contiguous, in order, every file exactly once
            sizes = [len(share) for share in shares]
            assert max(sizes) - min(sizes) <= 1
            assert sizes == sorted(sizes, reverse=True)  # the first len % workers get one more
            assert sizes.count(files // workers + 1) == (files % workers if files % workers else 0)


def test_file_shard_follows_paddles_examples(tmp_path, monkeypatch):
    a, b, c, d, e = touch(tmp_path, 5)
    assert fleet.file_shard([a, b, c, d, e]) == [a, b, c, d, e]  # a plain process: every file
    as_worker(monkeypatch, 0, 2)
    assert fleet.file_shard([a, b, c, d, e]) == [a, b, c]
    as_worker(monkeypatch, 1, 2)
    assert fleet.file_shard([a, b, c, d, e]) == [d, e]
    as_worker(monkeypatch, 2, 3)
    with pytest.warns(UserWarning, match="2 files for 3 workers: worker 2 gets no file"):
        assert fleet.file_shard([a, b]) == []


def test_file_shard_reads_the_worker_from_the_launchers_environment_before_init(tmp_path, monkeypatch):
    names = touch(tmp_path, 7)
    monkeypatch.setenv("FLEET_ROLE", "worker")
    monkeypatch.setenv("FLEET_WORKER_NUM", "3")
    monkeypatch.setenv("FLEET_WORKER_INDEX", "1")
    monkeypatch.setenv("FLEET_MASTER", "127.0.0.1:29999")
    assert fleet.file_shard(names) == names[3:5]
    assert fleet.api.context.current() is None  # nothing was started


def test_file_shard_under_torchrun_before_init_asks_for_init(tmp_path, monkeypatch):
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(fleet.FleetError, match=r"torchrun .*Call fleet.init\(\) before"):
        fleet.file_shard(touch(tmp_path, 2))


def test_file_shard_errors(tmp_path):
    with pytest.raises(ValueError, match="empty list"):
        fleet.file_shard([])
    with pytest.raises(FileNotFoundError, match="'nowhere/part-3' does not exist"):
        fleet.file_shard(touch(tmp_path, 1) + ["nowhere/part-3"])
    with pytest.raises(TypeError, match="needs a list of files"):
        fleet.file_shard(str(tmp_path / "f0"))


# --- the formats ---------------------------------------------------------------------


def awkward_samples(n: int = 300):
    ids, dense, label = ctr_samples(n, seed=3)
    ids, dense, label = ids.numpy(), dense.numpy(), label.numpy()
    ids[0, :3] = [0, 2**63 - 1, -1]  # -1 is written as 2**64 - 1, Paddle's uint64 feasign
    dense[1, :4] = [1.5e-7, -3.0e12, 0.0, np.float32(np.pi)]
    dense[2, 0] = np.nan
    label[3] = 0.25
    return ids, dense, label


@pytest.mark.parametrize("writer", [write_text, write_binary])
def test_both_formats_round_trip_exactly(tmp_path, writer):
    ids, dense, label = awkward_samples()
    path = tmp_path / "data"
    writer(path, ids, dense, label)
    assert count_records(str(path), SlotLayout()) == len(label)
    for chunk_bytes in (4 << 20, 997):  # one chunk; lines and records cut across many
        got_ids, got_dense, got_label = read_all(path, chunk_bytes=chunk_bytes)
        assert got_ids.dtype == np.int64 and got_dense.dtype == np.float32 and got_label.dtype == np.float32
        np.testing.assert_array_equal(got_ids, ids)
        np.testing.assert_array_equal(got_dense, dense)  # nan == nan here
        np.testing.assert_array_equal(got_label, label)


def test_text_reads_paddles_multislot_lines_with_tabs_crlf_exponents_and_no_final_newline(tmp_path):
    layout = SlotLayout(sparse=3, dense=2)
    lines = [
        "2 0.0 0.00663349917081 1 371155 1 846239 1 204942 1 0",  # Paddle's CTR example output
        "2\t-1.5e-05  +7 1 0 1 18446744073709551615 1 5 1 1.0\r",
        "2 nan .5 1 1 1 2 1 3 1 1",
    ]
    path = tmp_path / "part-0"
    path.write_bytes("\n".join(lines).encode())
    assert count_records(str(path), layout) == 3
    ids, dense, label = read_all(path, layout)
    assert ids.tolist() == [[371155, 846239, 204942], [0, -1, 5], [1, 2, 3]]
    np.testing.assert_array_equal(dense[:2], np.float32([[0.0, 0.00663349917081], [-1.5e-05, 7.0]]))
    assert np.isnan(dense[2, 0]) and dense[2, 1] == 0.5
    assert label.tolist() == [0.0, 1.0, 1.0]


def test_a_text_file_converts_to_binary(tmp_path):
    ids, dense, label = awkward_samples(50)
    write_text(tmp_path / "a.txt", ids, dense, label)
    assert convert(tmp_path / "a.txt", tmp_path / "a.bin", SlotLayout()) == 50
    for got, want in zip(read_all(tmp_path / "a.bin"), (ids, dense, label), strict=True):
        np.testing.assert_array_equal(got, want)


GOOD = "2 0.5 1.5 1 7 1 8 1 0"  # a dense slot of 2 values, two sparse slots, the label


@pytest.mark.parametrize(
    "bad, message",
    [
        ("2 0.5 1.5 1 7 1 8 1", "the line ends inside the label \\(8 fields where 9 were expected\\)"),
        ("2 0.5 1.5 1 7", "the line ends before the sparse slot 2"),
        ("2 0.5 1.5 1 7 1 8 1 0 9", "10 fields where 9 were expected"),
        ("2 0.5 1.5 2 7 9 1 8 1 0", "sparse slot 1 has 2 ids; SlotDataset reads exactly one id per sparse slot"),
        ("2 0.5 1.5 1 x7 1 8 1 0", "sparse slot 1: 'x7' is not an id"),
        ("2 0.5 1.5 1 -7 1 8 1 0", "sparse slot 1: '-7' is not an id"),
        ("2 0.5 1.5 1 18446744073709551616 1 8 1 0", "sparse slot 1: '18446744073709551616' is not an id"),
        ("2 0.5 zz 1 7 1 8 1 0", "dense: 'zz' is not a number"),
        ("3 0.5 1.5 1 7 1 8 1 0", "the dense count is '3', expected 2"),
        ("2 0.5 1.5 1 7 1 8 1 yes", "label: 'yes' is not a number"),
        ("", "empty line"),
    ],
)
def test_a_malformed_line_names_the_file_and_the_line(tmp_path, bad, message):
    path = tmp_path / "part-7"
    path.write_text("\n".join([GOOD] * 40 + [bad] + [GOOD] * 5) + "\n")
    for chunk_bytes in (4 << 20, 64):  # the bad line in the first chunk, or many chunks in
        with pytest.raises(ValueError, match=rf"part-7, line 41: {message}"):
            read_all(path, SlotLayout(sparse=2, dense=2), chunk_bytes)


def test_binary_files_check_their_header(tmp_path):
    ids, dense, label = ctr_samples(10, seed=1)
    write_binary(tmp_path / "a.bin", ids, dense, label)
    with pytest.raises(ValueError, match="holds 26 sparse slots and 13 dense values .* expects sparse_slots=20"):
        count_records(str(tmp_path / "a.bin"), SlotLayout(sparse=20))
    with open(tmp_path / "a.bin", "ab") as f:
        f.write(b"\0" * 7)
    with pytest.raises(ValueError, match="truncated: 7 bytes after its last whole record"):
        count_records(str(tmp_path / "a.bin"), SlotLayout())


def test_generated_sample_is_w2s_task(tmp_path):
    paths = generate(tmp_path, files=2, samples=[100, 50])
    assert [count_records(p, SlotLayout()) for p in paths] == [100, 50]
    ids, dense, label = read_all(paths[0])
    w_true = torch.randn(13, generator=torch.Generator().manual_seed(0)).numpy()  # as train_ctr.py's batches()
    np.testing.assert_array_equal(label, (dense.astype(np.float64) @ w_true > 0).astype(np.float32))
    assert ids.min() >= 0 and ids.max() < 1_000_000


# --- SlotDataset -----------------------------------------------------------------------


@pytest.mark.parametrize("binary", [False, True])
def test_every_worker_gets_the_same_number_of_batches_from_uneven_files(tmp_path, monkeypatch, binary):
    sizes = [500, 130, 370, 90, 260, 45]
    paths = generate(tmp_path, files=len(sizes), samples=sizes, binary=binary)
    rows = {p: read_all(p) for p in paths}
    batch = 32
    for workers in (1, 2, 3, 4):
        shares = job_files.split_files(paths, workers)
        smallest = min(sum(count_records(p, SlotLayout()) for p in share) for share in shares)
        for index in range(workers):
            as_worker(monkeypatch, index, workers)
            dataset = SlotDataset(paths, batch, chunk_bytes=4096)
            assert dataset.files == shares[index]
            assert len(dataset) == dataset.num_batches == smallest // batch
            got = list(dataset)
            assert len(got) == len(dataset) and all(ids.shape == (batch, 26) for ids, _, _ in got)
            assert dataset.dropped == dataset.samples - len(got) * batch
            # the batches are this worker's samples, in file order, across file boundaries
            mine = [np.concatenate([rows[p][k] for p in shares[index]]) for k in range(3)]
            for k, part in enumerate(zip(*got, strict=True)):
                np.testing.assert_array_equal(torch.cat(part).numpy(), mine[k][: len(got) * batch])
            assert [len(x) for x in got[0]] == [batch] * 3 and got[0][0].dtype == torch.int64
            assert len(list(dataset)) == len(got)  # a second epoch reads again


def test_a_worker_without_a_whole_batch_is_refused_on_every_worker(tmp_path, monkeypatch):
    paths = generate(tmp_path, files=2, samples=[64, 64])
    for index in range(3):
        as_worker(monkeypatch, index, 3)
        with pytest.raises(ValueError, match="worker 2 of 3 gets no file with 0 samples, less than one batch of 16"):
            SlotDataset(paths, 16)


def test_shard_false_reads_every_file(tmp_path, monkeypatch):
    paths = generate(tmp_path, files=3, samples=[40, 40, 40])
    as_worker(monkeypatch, 1, 2)
    dataset = SlotDataset(paths, 10, shard=False)
    assert dataset.files == paths and len(dataset) == 12 and dataset.dropped == 0


def test_a_dataloader_with_one_worker_prefetches_the_same_batches(tmp_path):
    paths = generate(tmp_path, files=2, samples=[50, 30])
    dataset = SlotDataset(paths, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        direct = [ids for ids, _, _ in dataset]
        loaded = [ids for ids, _, _ in torch.utils.data.DataLoader(dataset, batch_size=None)]
    assert len(direct) == 5 and all(torch.equal(a, b) for a, b in zip(direct, loaded, strict=True))


def test_distributed_loader_does_not_split_it_again(tmp_path, monkeypatch):
    paths = generate(tmp_path, files=2, samples=[50, 30])
    as_worker(monkeypatch, 1, 2)
    dataset = SlotDataset(paths, 8)  # worker 1's share: 30 samples, 3 batches (worker 0's 50 make 6)
    loader = fleet.data.loader.ShardedLoader(
        torch.utils.data.DataLoader(dataset, batch_size=None), num_shards=2, shard=1
    )
    assert len(loader) == len(dataset) == 3 and len(list(loader)) == 3


# --- the CTR example from files, two workers ---------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_ctr_example_trains_from_uneven_files_on_two_workers(tmp_path):
    data = tmp_path / "data"
    generate(data, files=3, samples=[1500, 1000, 1300])  # worker 0: 2,500 samples, worker 1: 1,300
    report = tmp_path / "report.jsonl"
    args = ("--files", str(data / "part-*"), "--batch", "32", "--epochs", "3", "--warmup", "1", "--report", str(report))
    cmd = fleetrun_command("--workers", "2", "--log-dir", str(tmp_path / "logs"), script=TRAIN_CTR, args=args)
    done = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=140, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = sorted((json.loads(line) for line in report.read_text().splitlines()), key=lambda r: r["worker"])
    assert [r["worker"] for r in results] == [0, 1]
    assert [r["steps"] for r in results] == [3 * (1300 // 32)] * 2  # the smaller share sets the count
    assert all(r["loss"] < r["first_loss"] - 0.05 for r in results), results
