"""Sync without backup workers drops nothing: every worker's gradient is in every step, the last one too.

The model is DLRM-shaped in miniature: several tables (``SparseEmbedding`` and
``SparseEmbeddingBag``), one used only on some steps, one whose bags are sometimes all empty on
one worker, one added to the optimizer after step 0 (then a save and load of the persistables, after
which every table must go on at its own version), and dense layers. Worker 0 stops right
after its last step while worker 1's sparse pushes of that step are still on their way (worker 1
takes its gradients late): the servers must still wait for them. The workers' parameters must
equal one process (plain PyTorch: ``nn.Embedding`` / ``nn.EmbeddingBag`` and ``torch.optim.SGD``)
on the union of the workers' batches, and no push may be dropped as stale.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from fleet.ps.server import aggregator as agg
from ps_jobs import run_job

VOCAB, DIM, BATCH, DENSE, STEPS, LATE_STEP, RELOAD_STEP, LR = 12, 4, 6, 5, 6, 2, 4, 0.3
LATE_S = 0.5  # worker 1 takes its last step's row gradients this late: worker 0 has stopped by then
TABLES = ("user", "hist", "tags", "rare", "late")


def _bags(g: torch.Generator, empty: bool) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.zeros(BATCH, dtype=torch.int64) if empty else torch.randint(0, 4, (BATCH,), generator=g)
    ids = torch.randint(0, VOCAB, (int(lengths.sum()),), generator=g)
    return ids, torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])


def batch(step: int, rank: int) -> dict[str, torch.Tensor]:
    """One worker's batch; ``hist`` has no id at all on some steps of one worker or the other."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    hist, hist_off = _bags(g, empty=(step + rank) % 3 == 0)
    tags, tags_off = _bags(g, empty=False)
    rare, rare_off = _bags(g, empty=False)
    return {
        "user": torch.randint(0, VOCAB, (BATCH, 2), generator=g),
        "hist": hist,
        "hist_off": hist_off,
        "tags": tags,
        "tags_off": tags_off,
        "tags_w": torch.rand(tags.numel(), generator=g),
        "rare": rare,
        "rare_off": rare_off,
        "late": torch.randint(0, VOCAB, (BATCH,), generator=g),
        "dense": torch.randn(BATCH, DENSE, generator=g),
        "label": torch.randint(0, 2, (BATCH,), generator=g).float(),
    }


def union(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The workers' batches as one (bags' offsets shifted past the bags before them)."""
    out = {}
    for key in parts[0]:
        if key.endswith("_off"):
            ids = key.removesuffix("_off")
            shifts = [0] + [int(p[ids].numel()) for p in parts[:-1]]
            out[key] = torch.cat([p[key] + sum(shifts[: i + 1]) for i, p in enumerate(parts)])
        else:
            out[key] = torch.cat([p[key] for p in parts])
    return out


def uses(step: int) -> set[str]:
    """The tables a step's forward looks up (the same on every worker: it is the model's structure)."""
    used = {"user", "hist", "tags"}
    if step % 2 == 1:
        used.add("rare")
    if step >= LATE_STEP:
        used.add("late")
    return used


class Model(nn.Module):
    """The same dense layers and loss for the fleet model and the plain PyTorch reference."""

    def __init__(self, tables: dict[str, nn.Module]) -> None:
        super().__init__()
        torch.manual_seed(100)
        self.tables = nn.ModuleDict(tables)
        self.bottom = nn.Linear(DENSE, DIM)
        self.top = nn.Linear(DIM * (1 + len(TABLES)), 1)

    def forward(self, b: dict[str, torch.Tensor], step: int) -> torch.Tensor:
        t, used = self.tables, uses(step)
        zeros = torch.zeros(b["dense"].shape[0], DIM)
        features = [
            self.bottom(b["dense"]),
            t["user"](b["user"]).sum(1),
            t["hist"](b["hist"], b["hist_off"]),
            t["tags"](b["tags"], b["tags_off"], per_sample_weights=b["tags_w"]),
            t["rare"](b["rare"], b["rare_off"]) if "rare" in used else zeros,
            t["late"](b["late"]) if "late" in used else zeros,
        ]
        return self.top(torch.cat(features, 1)).squeeze(1)

    def loss(self, b: dict[str, torch.Tensor], step: int) -> torch.Tensor:
        return nn.functional.binary_cross_entropy_with_logits(self(b, step), b["label"])


def fleet_model() -> Model:
    import fleet

    class LateRows(fleet.nn.SparseEmbeddingBag):
        """Takes its row gradients ``late_s`` late: the step's sparse pushes leave after the dense one."""

        late_s = 0.0

        def take_gradients(self):
            time.sleep(self.late_s)
            return super().take_gradients()

    return Model(
        {
            "user": fleet.nn.SparseEmbedding(DIM, seed=1),
            "hist": LateRows(DIM, mode="sum", seed=2),
            "tags": fleet.nn.SparseEmbeddingBag(DIM, mode="sum", seed=3),
            "rare": fleet.nn.SparseEmbeddingBag(DIM, mode="mean", seed=4),
            "late": fleet.nn.SparseEmbedding(DIM, seed=5),
        }
    )


def values(model: Model) -> dict[str, torch.Tensor]:
    """Dense parameters, and every table's rows of ids 0 .. VOCAB-1 (pulled from the servers in PS mode)."""
    out = {n: p.detach().clone() for n, p in model.named_parameters() if not n.startswith("tables.")}
    for name, table in model.tables.items():
        plain = isinstance(table, nn.Embedding | nn.EmbeddingBag)
        out[name] = table.weight.detach().clone() if plain else table.dense_weight(VOCAB)
    return out


def train(rank: int, steps: int, ckpt: str) -> dict:
    import fleet

    try:
        fleet.init()
    except SystemExit as stop:
        return {"served": stop.code}
    me = fleet.worker_index()
    model = fleet_model()
    late = model.tables["late"]
    params = [p for n, p in model.named_parameters() if not n.startswith("tables.late.")]
    opt = fleet.distributed_optimizer(torch.optim.SGD(params, lr=LR))
    losses = []
    for step in range(steps):
        if step == LATE_STEP:  # a table that joins after step 0: its versions start behind the others'
            opt.add_param_group({"params": list(late.parameters())})
        if step == RELOAD_STEP:  # a round trip that changes nothing; every worker then pulls every table again
            fleet.save_persistables(ckpt)
            fleet.load_persistables(ckpt)
        model.tables["hist"].late_s = LATE_S if me == 1 and step == steps - 1 else 0.0
        opt.zero_grad()
        loss = model.loss(batch(step, me), step)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    out = {"losses": losses, "stale_dropped": opt.stale_dropped, "metrics_dropped": opt.metrics.dropped_stale}
    if me == 1:  # worker 0 stopped at once, without a barrier; worker 1 reads what the servers hold
        model.eval()
        out["values"] = values(model)
        out["stats"] = opt.client.stats().result()
    fleet.stop_worker()
    return out


def reference(steps: int, workers: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, plain PyTorch, on the union of the workers' batches, from the fleet tables' initial rows."""
    initial = fleet_model().tables
    plain = {
        "user": nn.Embedding(VOCAB, DIM),
        "hist": nn.EmbeddingBag(VOCAB, DIM, mode="sum"),
        "tags": nn.EmbeddingBag(VOCAB, DIM, mode="sum"),
        "rare": nn.EmbeddingBag(VOCAB, DIM, mode="mean"),
        "late": nn.Embedding(VOCAB, DIM),
    }
    with torch.no_grad():
        for name, table in plain.items():
            table.weight.copy_(initial[name].dense_weight(VOCAB))
    model = Model(plain)
    late = model.tables["late"]
    opt = torch.optim.SGD([p for n, p in model.named_parameters() if not n.startswith("tables.late.")], lr=LR)
    losses = []
    for step in range(steps):
        if step == LATE_STEP:
            opt.add_param_group({"params": list(late.parameters())})
        opt.zero_grad()
        loss = model.loss(union([batch(step, r) for r in range(workers)]), step)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return values(model), losses


def _sync_shard(workers: int, backup: int = 0) -> agg.SparseShard:
    config = {"dim": 2, "optimizer": {"kind": "sgd", "lr": 1.0}, "update": "sync", "backup_workers": backup}
    return agg.SparseShard(0, config, workers)


def test_a_worker_that_pushed_then_stopped_does_not_close_the_step_without_the_others() -> None:
    shard = _sync_shard(2)
    before = shard.pull(torch.arange(2)).clone()
    assert shard.push_grad(0, 0, torch.tensor([0]), torch.ones(1, 2), 1.0)
    assert not shard.maybe_step({1}, set())  # worker 0 stopped after its push: worker 1's is still to come
    assert shard.push_grad(1, 0, torch.tensor([1]), torch.ones(1, 2), 1.0)  # in time, not stale
    assert shard.maybe_step({1}, set()) and shard.version == 1 and shard.stale_dropped == {}
    torch.testing.assert_close(shard.pull(torch.arange(2)), before - 0.5, rtol=0, atol=0)  # the average of both
    # uneven batch counts: worker 0 stopped without a push for this step, worker 1's closes it alone
    assert shard.push_grad(1, 1, torch.tensor([1]), torch.ones(1, 2), 1.0)
    assert shard.maybe_step({1}, set()) and shard.version == 2
    # with a backup worker: a stopped worker's push counts, but it is one of the N - b a step needs
    shard = _sync_shard(3, backup=1)
    assert shard.push_grad(0, 0, torch.tensor([0]), torch.ones(1, 2), 1.0)
    assert not shard.maybe_step({2}, set())  # worker 0 pushed and stopped, worker 1 stopped: wait for worker 2
    assert shard.push_grad(2, 0, torch.tensor([1]), torch.ones(1, 2), 1.0)
    assert shard.maybe_step({2}, set()) and shard.stale_dropped == {}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("servers", [1, 2])
def test_sync_without_backup_workers_drops_nothing_and_equals_one_process(servers: int, tmp_path) -> None:
    results = run_job(train, servers, 2, {"update": "sync"}, STEPS, str(tmp_path / "ckpt"), timeout=100)
    for worker, result in enumerate(results):
        assert result["stale_dropped"] == 0, (worker, result["stale_dropped"])
        assert result["metrics_dropped"] == 0, (worker, result["metrics_dropped"])
    stats = results[1]["stats"]
    assert [s["stale_dropped"] for s in stats] == [{}] * servers, stats
    for server in stats:  # each table made one step per step it was in the optimizer
        for table in server["tables"].values():
            assert table["version"] in (STEPS, STEPS - LATE_STEP), table
    expected, losses = reference(STEPS, 2)
    got = results[1]["values"]
    assert sorted(got) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    for step, loss in enumerate(losses):  # the union's mean loss is the mean of the workers' (equal batch sizes)
        mean = (results[0]["losses"][step] + results[1]["losses"][step]) / 2
        assert abs(mean - loss) < 1e-6, (step, mean, loss)
