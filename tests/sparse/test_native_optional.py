"""fleet without its native engine (installed where there was no C++ compiler): collective and sharding jobs
run, and the first thing that needs the engine -- a sparse table, a parameter-server job -- says how to build it.

The engine is hidden here by making its import fail, in this process (monkeypatched) or, where a job must
prove it never even tried to load it, in a fresh one. tests/api/test_install_without_compiler.py installs
fleet for real with the compiler hidden.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

import fleet
import fleet.nn
import fleet.sparse
from dist_harness import clean_env
from fleet.sparse import native

ROOT = Path(fleet.__file__).resolve().parents[1]
BUILD_ADVICE = ("apt-get install g++ python3-dev", "pip install --force-reinstall --no-deps")


@pytest.fixture
def no_engine(monkeypatch):
    """This process as if fleet had been installed without a compiler: importing the compiled module fails."""
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setitem(sys.modules, "fleet.sparse._native", None)  # None in sys.modules: the import raises
    monkeypatch.delattr(fleet.sparse, "_native", raising=False)  # else `from fleet.sparse import _native` finds it


@pytest.mark.parametrize("cls", [fleet.nn.SparseEmbedding, fleet.nn.SparseEmbeddingBag])
def test_a_sparse_table_without_the_engine_says_how_to_build_it(no_engine, cls) -> None:
    with pytest.raises(native.NativeEngineError) as caught:
        cls(8)
    message = str(caught.value)
    assert message.startswith(f"fleet.nn.{cls.__name__} needs fleet's native sparse-table engine, which is not built")
    assert "Collective and sharding jobs without sparse tables run without it" in message
    for advice in BUILD_ADVICE:
        assert advice in message, message
    assert str(ROOT) in message  # this source tree: the command names it
    assert isinstance(caught.value, ImportError) and isinstance(caught.value, fleet.FleetError)


def test_a_feature_collection_without_the_engine_stops_at_construction(no_engine) -> None:
    with pytest.raises(native.NativeEngineError, match="fleet.nn.SparseEmbeddingBag needs fleet's native"):
        fleet.nn.SparseFeatureCollection([fleet.nn.FeatureTable("user", 4, ["user_id"])])


def test_a_kernel_used_without_the_engine_raises_the_same_error(no_engine) -> None:
    kernels = native._Kernels()  # the shared one already holds the functions earlier tests used
    with pytest.raises(native.NativeEngineError, match="This use of a sparse table needs fleet's native"):
        kernels.lookup  # noqa: B018


def test_a_parameter_server_job_without_the_engine_stops_at_init(no_engine, fresh_fleet) -> None:
    with pytest.raises(native.NativeEngineError) as caught:
        fleet.init(strategy=fleet.DistributedStrategy(mode="ps"))
    message = str(caught.value)
    assert message.startswith("A parameter-server job (mode='ps') needs fleet's native sparse-table engine")
    for advice in BUILD_ADVICE:
        assert advice in message, message


def test_a_stale_build_says_to_rebuild(monkeypatch) -> None:
    stale = types.ModuleType("fleet.sparse._native")
    stale.__file__ = "/somewhere/_native.so"
    stale.abi_version = lambda: native.ABI_VERSION - 1  # type: ignore[attr-defined]
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setitem(sys.modules, "fleet.sparse._native", stale)
    monkeypatch.setattr(fleet.sparse, "_native", stale, raising=False)
    with pytest.raises(native.NativeEngineError, match=r"/somewhere/_native.so\) is a stale build \(interface"):
        fleet.nn.SparseEmbedding(4)


def test_the_engine_loads_once_and_its_functions_stay_bound() -> None:
    kernels = native._Kernels()
    assert kernels.abi_version() == native.ABI_VERSION
    assert kernels.__dict__["abi_version"] is native.load().abi_version  # the hot path skips __getattr__


_NO_ENGINE_JOB = textwrap.dedent(
    """
    import importlib.abc
    import sys

    attempts = []

    class NoEngine(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "fleet.sparse._native":
                attempts.append(name)
                raise ImportError("No module named 'fleet.sparse._native' (hidden by the test)")
            return None

    sys.meta_path.insert(0, NoEngine())

    import copy

    import torch

    import fleet
    import fleet.nn
    from fleet.sparse.native import NativeEngineError

    for mode in ("collective", "sharding"):  # one job after the other (stop_worker ends one)
        fleet.init()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        reference = copy.deepcopy(model)
        opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                          fleet.DistributedStrategy(mode=mode))
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        for _ in range(3):
            x, y = torch.randn(16, 4), torch.randn(16, 1)
            losses = []
            for m, o in ((model, opt), (reference, ref_opt)):
                o.zero_grad()
                loss = torch.nn.functional.mse_loss(m(x), y)
                loss.backward()
                o.step()
                losses.append(loss.item())
            assert abs(losses[0] - losses[1]) < 1e-6, (mode, losses)
        fleet.stop_worker()
        print("TRAINED:", mode)
    assert attempts == [], "the job tried to load the native engine"
    try:
        fleet.nn.SparseEmbedding(4)
    except NativeEngineError as error:
        print("REFUSED:", error)
    assert attempts == ["fleet.sparse._native"], attempts
    """
)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_collective_and_sharding_jobs_never_load_the_engine(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(_NO_ENGINE_JOB)
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=170,  # 35-60 s measured at load 15-20 on 2 cores (under 10 s of CPU): the imports are most of it
        cwd=tmp_path,
        env=clean_env(PYTHONPATH=str(ROOT)),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "TRAINED: collective" in done.stdout and "TRAINED: sharding" in done.stdout, done.stdout
    assert "REFUSED: fleet.nn.SparseEmbedding needs fleet's native sparse-table engine" in done.stdout, done.stdout
