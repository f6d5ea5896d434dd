"""W6's workload (benchmarks/w6_dlrm.py, benchmarks/peers/dlrm_workload.py) at tiny sizes.

The benchmark's comparisons only mean something if every system trains the same model on the
same tensors: the batches are a pure function of (worker, step), fleet's model in one process
equals the nn.EmbeddingBag model (same initial rows), and fleet's PS sync equals one process
on the union of the workers' batches.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))

import dlrm_workload as W  # noqa: E402
import w6_dlrm  # noqa: E402


def test_batches_are_a_pure_function_of_worker_and_step_and_dlrm_shaped() -> None:
    spec = W.spec("full")
    assert len(spec.tables) >= 8
    assert min(r for r, _ in spec.tables) == 10_000 and max(r for r, _ in spec.tables) == 10_000_000
    assert {d for _, d in spec.tables} <= set(range(16, 65))
    dense, feats, label = W.make_batch(spec, 1, 7)
    again = W.make_batch(spec, 1, 7)
    other = W.make_batch(spec, 0, 7)
    assert torch.equal(dense, again[0]) and torch.equal(label, again[2])
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(feats, again[1], strict=True))
    assert not torch.equal(feats[0][0], other[1][0][0])
    assert dense.shape == (256, W.DENSE) and 0.2 < float(label.mean()) < 0.8
    lengths = []
    for (ids, offsets), (rows, _) in zip(feats, spec.tables, strict=True):
        assert offsets.shape == (256,) and int(offsets[0]) == 0 and bool((offsets.diff() >= 1).all())
        assert 0 <= int(ids.min()) and int(ids.max()) < rows
        lengths.append(ids.numel() / 256)
        assert torch.unique(ids).numel() < ids.numel()  # Zipf: popular ids repeat
    assert 9.0 < sum(lengths) / len(lengths) < 11.0  # mean pooling factor about 10
    both = W.union([other, (dense, feats, label)])
    assert torch.equal(both[1][2][0], torch.cat([other[1][2][0], feats[2][0]]))
    assert torch.equal(both[1][2][1][256:], feats[2][1] + other[1][2][0].numel())


@pytest.mark.parametrize("fleet_model", ["bags", "collection"])
def test_fleet_model_in_one_process_equals_the_nn_embedding_bag_model(fresh_fleet, tmp_path, fleet_model) -> None:
    """With the same initial rows (zeros), fleet's models (a SparseEmbeddingBag per table, or one
    SparseFeatureCollection) and nn.EmbeddingBag's lose alike."""
    losses, threads = {}, torch.get_num_threads()
    for system in ("torch", "fleet"):
        report = tmp_path / f"{system}.jsonl"
        args = argparse.Namespace(
            steps=5,
            warmup=1,
            batch=8,
            sizes="tiny",
            init="zeros",
            system=system,
            fleet_model=fleet_model,
            report=report,
        )
        try:
            w6_dlrm.local_main(args)
        finally:
            torch.set_num_threads(threads)  # local_main takes one thread, as a benchmark process
        losses[system] = json.loads(report.read_text())["losses"]
    assert len(losses["fleet"]) == 5 and losses["fleet"][-1] != losses["fleet"][0]
    assert losses["fleet"] == pytest.approx(losses["torch"], abs=1e-6)


@pytest.mark.slow  # tens of seconds: run by .ci/run after the main suite (docs/development.md)
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_benchmark_runs_and_ps_sync_equals_one_process(tmp_path) -> None:
    """One small run of the driver: fleet and PyTorch in one process, fleet's PS sync (1 server + 2 workers), with
    the dense layers on the server and all-reduced among the workers."""
    out = tmp_path / "w6.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "w6_dlrm.py"), "--sizes", "tiny", "--batch", "8"]
    configs = "fleet-1p,torch-1p,fleet-ps-sync,fleet-ps-sync-dense-ar"
    cmd += ["--steps", "5", "--warmup", "1", "--rounds", "1", "--configs", configs]
    cmd += ["--timeout", "200", "--no-record", "--json", str(out)]
    env = {**os.environ, "FLEET_BENCH_RESULTS": str(tmp_path / "results")}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "ratio vs PyTorch one-process: " in done.stdout and "ratio vs TorchRec best: " in done.stdout
    configs = {c["name"]: c for c in json.loads(out.read_text())["configs"]}
    assert all(c["samples"] and not c["failures"] for c in configs.values()), configs

    def curve(name: str) -> list[float]:
        workers = configs[name]["samples"][0]["workers"]
        return [sum(step) / len(step) for step in zip(*(w["losses"] for w in workers), strict=True)]

    assert len(configs["fleet-ps-sync"]["samples"][0]["workers"]) == 2
    one = curve("fleet-1p")
    assert len(one) == 5 and one[-1] != one[0]
    assert curve("fleet-ps-sync") == pytest.approx(one, abs=1e-5)
    assert curve("fleet-ps-sync-dense-ar") == pytest.approx(one, abs=1e-5)  # the MLPs all-reduced, the same math
