"""fleet.export_for_inference: what a serving process loads gives the trained model's predictions."""

from __future__ import annotations

import pytest
import torch

import fleet
from ps_jobs import batch, make_model, make_optimizer, run_job, train_and_export


def _serve(dirname: str, opt_name: str) -> torch.Tensor:
    """A fresh process's view: a model built as for training, filled from the export, no job."""
    torch.manual_seed(12345)  # other initial values, all overwritten by the load
    served = fleet.load_for_inference(dirname, make_model(opt_name))
    with torch.no_grad():
        ids, dense, _ = batch(999, 0)
        return served(ids, dense)


@pytest.mark.parametrize("opt_name", ["adam", "sgd+life+cap"])
def test_single_process_export_serves_the_same_predictions(tmp_path, opt_name: str) -> None:
    torch.manual_seed(0)
    model = make_model(opt_name)
    opt = make_optimizer(opt_name, model.parameters())
    for step in range(6):
        ids, dense, label = batch(step, 0)
        opt.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(model(ids, dense), label).backward()
        opt.step()
    fleet.export_for_inference(str(tmp_path), model)
    model.eval()
    with torch.no_grad():
        ids, dense, _ = batch(999, 0)  # trained ids and unseen ones alike
        want = model(ids, dense)
    assert torch.equal(_serve(str(tmp_path), opt_name), want)
    payload = torch.load(tmp_path / "inference.pt", weights_only=True)
    assert payload["tables"]["emb"]["ids"].numel() == model.emb.num_rows()
    assert not any(k.endswith("placeholder") for k in payload["dense"])


def test_load_for_inference_names_a_model_that_does_not_fit(tmp_path) -> None:
    fleet.export_for_inference(str(tmp_path), make_model("adam"))
    other = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="sparse tables"):
        fleet.load_for_inference(str(tmp_path), other)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("update", "opt_name"), [("async", "adam+life+cap"), ("geo", "sgd")])
def test_parameter_server_export_serves_the_trained_predictions(tmp_path, update: str, opt_name: str) -> None:
    strategy = {"update": update, **({"k_steps": 3} if update == "geo" else {})}
    results = run_job(train_and_export, 2, 2, strategy, opt_name, 8, str(tmp_path))
    served = _serve(str(tmp_path), opt_name)
    for result in results:  # after the export every worker holds the servers' values
        assert torch.allclose(result["predictions"], served, atol=1e-6), (result["predictions"] - served).abs().max()
