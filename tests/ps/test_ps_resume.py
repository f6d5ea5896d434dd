"""A parameter-server job resumed from the user's own torch.save snapshot follows the uninterrupted run.

model.load_state_dict / optimizer.load_state_dict after fleet.distributed_optimizer reach the servers,
optimizer.state_dict() holds the servers' optimizer state in torch's own format, and parameters the
user writes by hand (clamping) replace the servers' values, all as in a single process.
"""

from __future__ import annotations

import copy

import pytest
import torch

from ps_jobs import run_job

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

WORKERS, STEPS, SAVE_AT = 2, 6, 3


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _optimizer(model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=0.02)
    return torch.optim.SGD(groups, lr=0.05, momentum=0.9)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(8, 5, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def _step(model, opt, step: int, ranks: list[int], clamp: bool) -> float:
    x, y = (torch.cat(parts) for parts in zip(*(_batch(step, r) for r in ranks), strict=True))
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    if clamp:  # a hand-written change to the parameters, as weight clipping does
        with torch.no_grad():
            model[0].weight.clamp_(-0.3, 0.3)
    return loss.item()


def _reference(kind: str, clamp: bool) -> dict:
    torch.manual_seed(0)
    model = _model()
    opt = _optimizer(model, kind)
    losses, saved = [], None
    for step in range(STEPS):
        if step == SAVE_AT:
            saved = copy.deepcopy(opt.state_dict())  # torch's holds the live tensors
        losses.append(_step(model, opt, step, list(range(WORKERS)), clamp))
    return {"losses": losses, "optimizer": saved, "params": [p.detach().clone() for p in model.parameters()]}


def _worker(rank: int, kind: str, snapshot: str, resume: bool, clamp: bool) -> dict:
    import fleet

    try:
        fleet.init()
    except SystemExit as stop:
        return {"served": stop.code}
    torch.manual_seed(0 if fleet.worker_index() == 0 and not resume else 50 + rank)  # a restart starts elsewhere
    model = _model()
    opt = fleet.distributed_optimizer(_optimizer(model, kind))
    start, losses, saved = 0, [], None
    if resume:  # the user's own resume code, on every worker, after distributed_optimizer
        state = torch.load(snapshot, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
    for step in range(start, STEPS):
        if step == SAVE_AT and snapshot and not resume:
            saved = opt.state_dict()
            if fleet.worker_index() == 0:  # rank-0 saving, as DDP scripts do
                torch.save({"model": model.state_dict(), "optimizer": saved, "step": step}, snapshot)
            fleet.barrier_worker()
        losses.append(_step(model, opt, step, [fleet.worker_index()], clamp))
    fleet.barrier_worker()
    out = {"losses": losses, "optimizer": saved, "params": [p.detach().clone() for p in model.parameters()]}
    fleet.stop_worker()
    return out


def _same_optimizer_state(ours: dict, reference: dict) -> None:
    assert ours["param_groups"] == reference["param_groups"]
    assert ours["state"].keys() == reference["state"].keys()
    for index, per_param in reference["state"].items():
        assert per_param.keys() == ours["state"][index].keys(), index
        for name, value in per_param.items():
            torch.testing.assert_close(ours["state"][index][name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_a_users_own_snapshot_resumes_a_sync_job_on_the_same_trajectory(tmp_path, kind):
    snapshot = str(tmp_path / "snapshot.pt")
    strategy = {"update": "sync"}
    reference = _reference(kind, clamp=False)
    first = run_job(_worker, 1, WORKERS, strategy, kind, snapshot, False, False)
    # state_dict() is torch's own, holding the servers' state: equal to a single process's on the union
    _same_optimizer_state(first[0]["optimizer"], reference["optimizer"])
    # the mean of the workers' losses is the single process's loss on the union of their batches
    for step in range(STEPS):
        mean = sum(r["losses"][step] for r in first) / WORKERS
        assert abs(mean - reference["losses"][step]) < 1e-5, (step, mean, reference["losses"][step])
    resumed = run_job(_worker, 1, WORKERS, strategy, kind, snapshot, True, False)
    for before, after in zip(first, resumed, strict=True):
        assert after["losses"] == pytest.approx(before["losses"][SAVE_AT:], abs=1e-6)
        for a, b in zip(after["params"], before["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_parameters_written_by_hand_replace_the_servers_values():
    reference = _reference("adamw", clamp=True)
    assert reference["params"][0].abs().max() <= 0.3 + 1e-7  # the clamp bites
    results = run_job(_worker, 1, WORKERS, {"update": "sync"}, "adamw", "", False, True)
    for result in results:
        for ours, theirs in zip(result["params"], reference["params"], strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
