"""The recipes under examples/recipes/: two workers equal one plain-PyTorch process on the union.

One two-worker job runs all three recipes (bptt columns, sharded evaluation, save once) and a
failing fleet.save; the references are computed here with plain PyTorch on all the data.
"""

from __future__ import annotations

import io
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

import fleet
import fleet.api
from dist_harness import clean_env, fleetrun_command, run_workers

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "examples" / "recipes"
sys.path.insert(0, str(RECIPES))

import bptt_columns  # noqa: E402
import save_once  # noqa: E402
import sharded_eval  # noqa: E402


def _all_recipes(rank: int, tmp: str) -> dict:
    sys.path.insert(0, str(RECIPES))
    import bptt_columns
    import sharded_eval

    result = {"bptt": bptt_columns.train(batch_size=8, bptt=10, epochs=2)}
    result["eval"] = sharded_eval.main(size=203)  # shares of 102 and 101
    result["eval_one"] = sharded_eval.evaluate(sharded_eval.build_model(), sharded_eval.evaluation_set(1))
    padded = fleet.distributed_loader(torch.utils.data.DataLoader(sharded_eval.evaluation_set(203), batch_size=16))
    result["through_loader"] = sum(len(y) for _, y in padded)  # what the recipe warns about
    result["saved"] = save_once.main(f"{tmp}/model.pt")
    try:
        fleet.save({"x": torch.ones(1)}, f"{tmp}/no-such-dir/model.pt")
        result["failed_save"] = None
    except Exception as error:  # noqa: BLE001 - compared below
        result["failed_save"] = f"{type(error).__name__}: {error}"
    return result


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("recipes")
    return run_workers(_all_recipes, 2, str(tmp), timeout=100)


def _bptt_reference() -> dict:
    """word_language_model's loop in one process on all 8 columns (validation on all 5), no fleet."""
    torch.manual_seed(0)
    model = bptt_columns.LanguageModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    data = bptt_columns.batchify(bptt_columns.token_stream(2000), 8)
    validation = bptt_columns.batchify(bptt_columns.token_stream(500, seed=1), 5)
    losses, validation_losses = [], []
    for _ in range(2):
        hidden = model.init_hidden(8)
        for i in range(0, data.size(0) - 1, 10):
            tokens, targets = bptt_columns.get_batch(data, i, 10)
            hidden = tuple(h.detach() for h in hidden)
            optimizer.zero_grad()
            output, hidden = model(tokens, hidden)
            loss = nn.functional.cross_entropy(output.view(-1, bptt_columns.VOCAB), targets)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        with torch.no_grad():  # word_language_model's evaluate: every token of every column, one mean
            hidden, total, count = model.init_hidden(5), 0.0, 0
            for i in range(0, validation.size(0) - 1, 10):
                tokens, targets = bptt_columns.get_batch(validation, i, 10)
                output, hidden = model(tokens, hidden)
                total += nn.functional.cross_entropy(output.view(-1, bptt_columns.VOCAB), targets, reduction="sum")
                count += targets.numel()
            validation_losses.append(float(total) / count)
    return {"losses": losses, "validation": validation_losses, "state": model.state_dict()}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_bptt_columns_over_two_workers_equal_one_process_on_every_column(job):
    reference = _bptt_reference()
    for worker in job:
        got = worker["bptt"]
        assert len(got["losses"]) == len(reference["losses"]) == 50
        assert got["losses"] == pytest.approx(reference["losses"], abs=1e-5)
        assert got["validation"] == pytest.approx(reference["validation"], abs=1e-5)  # 3 and 2 columns
        for name, value in reference["state"].items():
            torch.testing.assert_close(got["state"][name], value, atol=1e-5, rtol=1e-5, msg=name)
    assert reference["losses"][-1] < reference["losses"][0] - 0.3  # it learned: the comparison is not of noise


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_sharded_evaluation_equals_one_process_evaluating_everything(job):
    for size, key in ((203, "eval"), (1, "eval_one")):
        data = sharded_eval.evaluation_set(size)
        with torch.no_grad():
            logits = sharded_eval.build_model()(data.tensors[0])
        loss = nn.functional.cross_entropy(logits, data.tensors[1], reduction="none").double().mean().item()
        accuracy = (logits.argmax(dim=1) == data.tensors[1]).double().mean().item()
        for worker in job:
            assert worker[key]["loss"] == pytest.approx(loss, abs=1e-6), key  # float32 logits per batch
            assert worker[key]["accuracy"] == pytest.approx(accuracy, abs=1e-12), key
    assert [worker["eval"]["examples"] for worker in job] == [102, 101]
    assert [worker["eval_one"]["examples"] for worker in job] == [1, 0]
    # the training loader would have counted 204: one example twice (why the recipe does not use it)
    assert sum(worker["through_loader"] for worker in job) == 204


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_save_once_writes_the_trained_model_and_every_worker_loads_it(job):
    torch.manual_seed(0)  # the same model trained in one process on the union of the workers' batches
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    y = x.sum(dim=1, keepdim=True)
    for start in range(0, 64, 16):  # worker r's k-th batch: examples r, r+2, ... of 16k..16k+15
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[start : start + 16]), y[start : start + 16]).backward()
        optimizer.step()
    for worker in job:
        for name, value in model.state_dict().items():
            torch.testing.assert_close(worker["saved"][name], value, atol=1e-6, rtol=1e-5, msg=name)
    first, second = (worker["failed_save"] for worker in job)
    assert first is not None and "no-such-dir" in first, first
    assert second is not None and second.startswith("FleetError") and "worker 0" in second, second


@pytest.fixture
def one_process(monkeypatch):
    for name in ("FLEET_ROLE", "RANK", "WORLD_SIZE", "PADDLE_TRAINER_ID", "TRAINING_ROLE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    fleet.api._reset_for_tests()
    yield
    fleet.api._reset_for_tests()


def test_save_in_one_process_writes_atomically(one_process, tmp_path):
    path = tmp_path / "state.pt"
    fleet.save({"w": torch.arange(3.0)}, path)
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.arange(3.0))
    assert [p.name for p in tmp_path.iterdir()] == ["state.pt"]  # no temporary file left


def test_save_refuses_a_file_object(one_process):
    with pytest.raises(TypeError, match="file name"):
        fleet.save({}, io.BytesIO())


def test_bptt_columns_refuses_columns_that_do_not_split_evenly(one_process, monkeypatch):
    monkeypatch.setattr(fleet, "worker_num", lambda: 3)
    with pytest.raises(ValueError, match="8 columns do not split evenly over 3 workers"):
        bptt_columns.my_columns(torch.zeros(5, 8))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_save_recipe_runs_as_a_script_under_fleetrun(tmp_path):
    out = tmp_path / "model.pt"
    command = fleetrun_command("--workers", "2", script=str(RECIPES / "save_once.py"), args=("--out", str(out)))
    done = subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=100, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "worker 0: loaded 4 tensors" in done.stdout and "worker 1: loaded 4 tensors" in done.stdout
    assert set(torch.load(out, weights_only=True)["model"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_save_refuses_a_shard_naming_where_it_sits(one_process, monkeypatch, tmp_path):
    class Shard(torch.Tensor):  # stands in for a DTensor: making a real one needs a process group
        pass

    monkeypatch.setitem(sys.modules, "torch.distributed.tensor", types.SimpleNamespace(DTensor=Shard))
    state = {"model": {"fc.weight": torch.zeros(2).as_subclass(Shard)}, "step": 3}
    with pytest.raises(fleet.FleetError, match=r"obj\['model'\]\['fc.weight'\] is a shard .*save_checkpoint"):
        fleet.save(state, tmp_path / "state.pt")
    model = torch.nn.Linear(2, 1)
    model.weight = torch.nn.Parameter(torch.zeros(1, 2).as_subclass(Shard))
    with pytest.raises(fleet.FleetError, match=r"obj\['weight'\] is a shard"):
        fleet.save(model, tmp_path / "model.pt")  # torch.save(model) habits: the module itself
    assert not list(tmp_path.iterdir())
