"""Checkpoints of a model with a fleet.nn.SparseEmbedding (mode="sharding" and "collective") keep the tables'
rows and their optimizer state: a job resumed from one trains exactly as the job that saved it, and both
equal one process on the union of the batches; ``model.state_dict()``/``load_state_dict`` round-trip the
(sharded) model exactly. A save keeps the workers' replicas of a table alike (max_rows breaks ties between
equal eviction scores by slot, and reading the rows puts them in id order)."""

from __future__ import annotations

import pytest
import torch

from dist_harness import run_workers

NAME = "adam+life+cap"  # Adam on the dense layers and the rows (per-row state); admission, TTL, max_rows, clicks
SAVE_AT, MORE = 3, 3


def _whole(value: torch.Tensor) -> torch.Tensor:
    return (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()


def _snapshot(model) -> dict[str, torch.Tensor]:
    """The rows of every id the data uses and the whole dense parameters (gathered from the shards)."""
    from ps_jobs import all_ids

    model.eval()
    with torch.no_grad():
        rows = model.emb(all_ids())
    model.train()
    out = {k: _whole(v) for k, v in model.mlp.state_dict().items()}
    return {**out, "rows": rows, "num_rows": torch.tensor(model.emb.num_rows())}


def _step(model, opt, step: int, rank: int) -> float:
    from ps_jobs import batch, feed_clicks

    ids, dense, label = batch(step, rank)
    opt.zero_grad()
    loss = torch.nn.functional.binary_cross_entropy_with_logits(model(ids, dense), label)
    loss.backward()
    feed_clicks(NAME, model, label)
    opt.step()
    return loss.item()


def _round_trip(model, opt, rank: int) -> dict:
    """``state_dict()``, a step that changes everything, ``load_state_dict``: the same state dict and outputs."""
    from ps_jobs import batch

    ids, dense, _ = batch(999, rank)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}  # DTensors: this worker's shards
    with torch.no_grad():
        want = model(ids, dense)
    _step(model, opt, 998, rank)
    stepped = _local(model.state_dict())
    model.load_state_dict(state)
    with torch.no_grad():
        got = model(ids, dense)
    return {"before": _local(state), "stepped": stepped, "after": _local(model.state_dict()), "want": want, "got": got}


def _local(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone() for k, v in state.items()}


def worker(rank: int, mode: str, ckpt: str, resume: bool) -> dict:
    """Train SAVE_AT steps and save, then MORE steps; or, resuming, load and train the same MORE steps."""
    import fleet
    from ps_jobs import make_model, make_optimizer

    fleet.init()
    torch.manual_seed(100 + rank + (50 if resume else 0))  # a resumed job starts elsewhere: the load must win
    model = make_model(NAME)
    opt = fleet.distributed_optimizer(make_optimizer(NAME, model.parameters()), fleet.DistributedStrategy(mode=mode))
    if resume:
        resumed = fleet.load_checkpoint(ckpt, model, opt)
        assert resumed is not None and resumed.step == SAVE_AT
    else:
        for step in range(SAVE_AT):
            _step(model, opt, step, rank)
        fleet.save_checkpoint(ckpt, model, opt, SAVE_AT)
    losses = [_step(model, opt, step, rank) for step in range(SAVE_AT, SAVE_AT + MORE)]
    out = {"losses": losses, "snapshot": _snapshot(model), "round_trip": _round_trip(model, opt, rank)}
    fleet.stop_worker()
    return out


def reference(steps: int, workers: int) -> dict[str, torch.Tensor]:
    """One process on the union of the batches, taking a state dict where the jobs save: that puts the
    rows in id order, which breaks ties between equal eviction scores (``max_rows``) from then on."""
    from ps_jobs import batch, feed_clicks, make_model, make_optimizer, snapshot

    torch.manual_seed(100)
    model = make_model(NAME)
    opt = make_optimizer(NAME, model.parameters())
    for step in range(steps):
        if step == SAVE_AT:
            model.state_dict()
        parts = [batch(step, r) for r in range(workers)]
        ids, dense, label = (torch.cat([p[i] for p in parts]) for i in range(3))
        opt.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(model(ids, dense), label).backward()
        feed_clicks(NAME, model, label)
        opt.step()
    return {**snapshot(model), "num_rows": torch.tensor(model.emb.num_rows())}


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["sharding", "collective"])
def test_a_resumed_job_trains_its_tables_exactly_as_the_one_that_saved(tmp_path, mode: str) -> None:
    ckpt = str(tmp_path / "ckpt")
    saved = run_workers(worker, 2, mode, ckpt, False, timeout=120)
    resumed = run_workers(worker, 2, mode, ckpt, True, timeout=120)
    want = reference(SAVE_AT + MORE, 2)
    for rank in range(2):
        assert resumed[rank]["losses"] == saved[rank]["losses"], (rank, resumed[rank]["losses"], saved[rank]["losses"])
        for name, expected in want.items():
            for job, result in (("saving", saved[rank]), ("resumed", resumed[rank])):
                got = result["snapshot"][name]
                assert torch.equal(got, resumed[rank]["snapshot"][name]), (job, rank, name)
                assert torch.allclose(got, expected, atol=1e-5), (job, rank, name, (got - expected).abs().max())
        for job, result in (("saving", saved[rank]), ("resumed", resumed[rank])):
            trip = result["round_trip"]
            assert any(k.startswith("emb.rows.") for k in trip["before"]), sorted(trip["before"])
            assert trip["before"].keys() == trip["after"].keys(), (job, rank)
            changed = [k for k, v in trip["before"].items() if not torch.equal(trip["stepped"][k], v)]
            assert "emb.rows.values" in changed and "mlp.0.weight" in changed, (job, rank, changed)
            for key, value in trip["before"].items():
                assert torch.equal(trip["after"][key], value), (job, rank, key)
            assert torch.equal(trip["got"], trip["want"]), (job, rank)


@pytest.mark.timeout(60)
def test_one_process_sharding_checkpoint_rows_and_the_mistakes(fresh_fleet, tmp_path) -> None:
    """In one process too; a checkpoint without the rows part warns, one without a table's rows names it."""
    import os

    import fleet
    from fleet.storage import checksums
    from ps_jobs import make_model, make_optimizer

    fleet.init()
    model = make_model(NAME)
    opt = fleet.distributed_optimizer(
        make_optimizer(NAME, model.parameters()), fleet.DistributedStrategy(mode="sharding")
    )
    for step in range(SAVE_AT):
        _step(model, opt, step, 0)
    ckpt = str(tmp_path / "ckpt")
    fleet.save_checkpoint(ckpt, model, opt, SAVE_AT)
    want = _local(model.state_dict())
    _step(model, opt, SAVE_AT, 0)
    assert fleet.load_checkpoint(ckpt, model, opt).step == SAVE_AT
    got = _local(model.state_dict())
    assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())

    save = os.path.join(ckpt, f"step-{SAVE_AT:09d}")
    rows = torch.load(os.path.join(save, "rows.pt"), weights_only=True)
    torch.save({k.replace("emb.", "other."): v for k, v in rows.items()}, os.path.join(save, "rows.pt"))
    sums = checksums.read_manifest(save)  # a file of the wrong model, not a damaged one: its checksum re-recorded
    sums["rows.pt"] = checksums.file_sum(os.path.join(save, "rows.pt"))
    checksums.write_manifest(save, sums)
    with pytest.raises(
        fleet.FleetError, match=r"no rows of the model's SparseEmbedding 'emb'; its tables are \['other'\]"
    ):
        fleet.load_checkpoint(ckpt, model, opt)
    os.remove(os.path.join(save, "rows.pt"))
    _step(model, opt, SAVE_AT, 0)
    before = model.emb.backend().export()
    with pytest.warns(UserWarning, match="holds no rows of the model's SparseEmbedding tables \\('emb'\\)"):
        fleet.load_checkpoint(ckpt, model, opt)
    after = model.emb.backend().export()
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1]), "the tables keep their rows"
