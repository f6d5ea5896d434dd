"""fleet.nn.SparseEmbeddingBag in PS async and geo mode, held to what each mode promises, against
nn.EmbeddingBag on the same rows (sum, mean and max bags, per-sample weights, a padding id,
include_last_offset, 2-D input; SGD and Adagrad rows):

- async, one worker: every forward pulls its rows after the worker's earlier pushes were applied (one
  connection, served in order), so a model whose only trained parameters are tables equals one
  process, step by step. (A trained dense layer would not: async trains it on the values of the last
  finished background pull, a step or more old.) A bag with a life cycle feeding ``record_clicks``
  keeps the same rows and show/click statistics on the server as in one process.
- async and geo, two workers: the servers apply every push or delta once, whatever the interleaving.
  With a loss linear in the pooled outputs and SGD rows, no gradient depends on the values, so the
  rows end where one process on the union of the batches ends (order only changes rounding).
- geo, one worker: trains locally as one process would; syncing every ``k_steps`` changes nothing.
- geo, two workers, one round (``k_steps`` = the steps, every forward before the first sync): each
  worker trains alone on its batches, and the servers then hold the initial values plus the sum of
  the workers' changes, rows and dense layer alike.
"""

from __future__ import annotations

import pytest
import torch
from bag_cases import BAGS, DIM, IDS, LR, PAD, SEED, Both, close, make_bags, union
from test_sparse_embedding_bag import ADAGRAD, FEATURES
from torch import nn

import fleet

pytestmark = pytest.mark.multiprocess  # every test here starts processes, but for the one-process reference

# variant -> the features of its model: "frozen" (only the tables train) and "full" (and the dense head)
# use FEATURES; "linear" (loss linear in the pooled outputs, SGD rows) leaves out max pooling.
LINEAR = {
    "a": ({"mode": "sum"}, False, True),
    "b": ({"mode": "mean", "padding_idx": PAD, "include_last_offset": True}, False, False),
    "e": ({"mode": "sum", "padding_idx": PAD}, True, True),
}
LIFE = ({"mode": "sum", "padding_idx": PAD}, False, False)  # "d" in "frozen": admission, TTL and clicks


def features_of(variant: str) -> dict:
    return LINEAR if variant == "linear" else FEATURES


class Net(nn.Module):
    """Multi-hot features pooled into a linear head: fleet's bags, or nn.EmbeddingBag over the same rows."""

    def __init__(self, variant: str, reference: bool = False) -> None:
        from test_sparse_embedding_bag import reference_bag

        super().__init__()
        torch.manual_seed(0)
        self.variant = variant
        self.reference = reference
        features = features_of(variant)
        self.head = nn.Linear(len(features) * DIM, 1)
        self.head.requires_grad_(variant == "full")
        tables = {}
        for name, (kwargs, _, _) in features.items():
            adagrad = name in ADAGRAD and variant != "linear"
            spec = {"optimizer": {"kind": "adagrad", "lr": LR}} if adagrad else {}
            tables[name] = fleet.nn.SparseEmbeddingBag(DIM, seed=SEED, **kwargs, **spec)
            if reference:
                tables[name] = reference_bag(tables[name])
        if variant == "frozen" and not reference:
            life = {"entry": fleet.CountFilterEntry(2), "ttl_steps": 2}
            tables["d"] = fleet.nn.SparseEmbeddingBag(DIM, seed=SEED, **LIFE[0], **life)
        self.bags = nn.ModuleDict(tables)

    def forward(self, batch: dict, target: torch.Tensor, probe: torch.Tensor) -> tuple[torch.Tensor, dict]:
        pooled = {}
        for name, bags in batch.items():
            if name in self.bags:
                ids = bags.dense() if self.reference else bags.input
                pooled[name] = self.bags[name](ids, bags.offsets, bags.weights)
        if self.variant == "linear":  # summed, not averaged: two workers' pushes add up to the union's
            return sum((p * probe).sum() for p in pooled.values()), pooled
        features = [pooled[name] for name in features_of(self.variant)]
        loss = nn.functional.mse_loss(self.head(torch.cat(features, 1)).squeeze(1), target)
        if "d" in pooled:  # its own term: the other tables' gradients do not depend on it
            loss = loss + (pooled["d"] * probe).sum()
        return loss, pooled

    def optimizer(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        if not self.reference:  # the tables' own optimizer overrides the dense one's
            return torch.optim.SGD(params, lr=LR)
        adagrad = [p for name in ADAGRAD if name in self.bags and self.variant != "linear"
                   for p in self.bags[name].parameters()]  # fmt: skip
        sgd = [p for p in params if all(p is not q for q in adagrad)]
        return Both(torch.optim.SGD(sgd, lr=LR), *([torch.optim.Adagrad(adagrad, lr=LR)] if adagrad else []))


def batch_of(variant: str, step: int, rank: int) -> tuple[dict, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bags per feature, the head's target, a probe for the linear terms, each bag's click label)."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    features = dict(features_of(variant))
    if variant == "frozen":
        features["d"] = LIFE
    batch = {
        name: make_bags(gen, two_d, weighted, "padding_idx" in kwargs, kwargs.get("include_last_offset", False))
        for name, (kwargs, two_d, weighted) in features.items()
    }
    target, probe = torch.randn(BAGS, generator=gen), torch.randn(BAGS, DIM, generator=gen)
    return batch, target, probe, (torch.rand(BAGS, generator=gen) < 0.5).float()


def server_rows(bag: fleet.nn.SparseEmbeddingBag) -> tuple[torch.Tensor, torch.Tensor]:
    """The table's rows where they live (the servers in PS mode: also geo's, past the worker's cache), by id."""
    ids, rows = bag.backend().export()
    order = torch.argsort(ids)
    return ids[order], rows[order]


def ps_bag_job(rank: int, variant: str, steps: int, one_round: bool = False) -> dict:
    """A worker (or server): train Net(variant), report each step's pooled outputs and the final tables.

    ``one_round``: every worker finishes the forwards of all steps before the last step (geo's sync) runs.
    """
    try:
        fleet.init()
    except SystemExit as stop:  # a PS server: it served, then exited
        return {"served": stop.code}
    model = Net(variant)
    opt = fleet.distributed_optimizer(model.optimizer())
    outputs = []
    for step in range(steps):
        batch, target, probe, clicks = batch_of(variant, step, fleet.worker_index())
        opt.zero_grad()
        loss, pooled = model(batch, target, probe)
        loss.backward()
        if "d" in model.bags:
            model.bags["d"].record_clicks(clicks)
        if one_round and step == steps - 1:
            fleet.barrier_worker()
        opt.step()
        outputs.append({name: p.detach() for name, p in pooled.items()})
    fleet.barrier_worker()  # every push applied (async: this worker's in flight too)
    if hasattr(opt, "refresh"):
        opt.refresh()  # the servers' dense values (geo: the other workers' deltas)
    out = {
        "outputs": outputs,
        "rows": {name: server_rows(bag) for name, bag in model.bags.items()},
        "head": [p.detach().clone() for p in model.head.parameters()],
        "life": {k: v for k, v in model.bags["d"].state_dict().items() if ".meta" not in k}
        if "d" in model.bags
        else {},
    }
    fleet.stop_worker()
    return out


def reference(variant: str, steps: int, ranks: list[int]) -> dict:
    """One process, nn.EmbeddingBag tables, on the union of ``ranks``' batches."""
    model = Net(variant, reference=True)
    opt = model.optimizer()
    outputs, seen = [], {name: set() for name in model.bags}
    for step in range(steps):
        parts = [batch_of(variant, step, r) for r in ranks]
        batch = {name: union([p[0][name] for p in parts], kwargs.get("include_last_offset", False))
                 for name, (kwargs, _, _) in features_of(variant).items()}  # fmt: skip
        target, probe = torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])
        for name, bags in batch.items():
            seen[name] |= set(bags.input.reshape(-1).tolist()) - {PAD}
        opt.zero_grad()
        loss, pooled = model(batch, target, probe)
        loss.backward()
        opt.step()
        outputs.append({name: p.detach().chunk(len(ranks)) for name, p in pooled.items()})
    rows = {}
    for name, bag in model.bags.items():
        ids = torch.tensor(sorted(seen[name]), dtype=torch.int64)
        rows[name] = (ids, bag.weight.detach()[torch.searchsorted(IDS, ids)])
    return {"outputs": outputs, "rows": rows, "head": [p.detach().clone() for p in model.head.parameters()]}


def assert_rows(got: dict, want: dict, what: str, atol: float = 1e-6) -> None:
    for name, (ids, rows) in want.items():
        assert torch.equal(got[name][0], ids), (what, name, got[name][0].tolist(), ids.tolist())
        assert torch.allclose(got[name][1], rows, atol=atol, rtol=0), (what, name, (got[name][1] - rows).abs().max())


def assert_outputs(got: list, want: list, rank: int, what: str) -> None:
    for step, outputs in enumerate(want):
        for name, pooled in outputs.items():
            close(got[step][name], pooled[rank], f"{what} step {step} table {name} forward")


@pytest.mark.timeout(120)
def test_async_one_worker_equals_one_process_and_keeps_the_click_statistics(fresh_fleet) -> None:
    from ps_jobs import run_job

    steps = 5
    (got,) = run_job(ps_bag_job, 1, 1, {"update": "async"}, "frozen", steps)
    want = reference("frozen", steps, [0])
    assert_outputs(got["outputs"], want["outputs"], 0, "async")
    assert_rows(got["rows"], want["rows"], "async")
    # the bag with a life cycle: the same rows, update counts and show/click statistics as in one process
    alone = ps_bag_job(0, "frozen", steps)
    for step, outputs in enumerate(alone["outputs"]):
        close(got["outputs"][step]["d"], outputs["d"], f"step {step} life-cycle bag forward")
    # (the admission sketch is the servers' own, not in a PS state dict: see docs/checkpoints.md)
    want_life = {k: v for k, v in alone["life"].items() if not k.startswith("rows.admission.")}
    assert got["life"].keys() == want_life.keys(), (sorted(got["life"]), sorted(want_life))
    assert {"rows.stats.show", "rows.stats.click", "rows.steps"} <= set(got["life"]), sorted(got["life"])
    for key, value in want_life.items():
        close(got["life"][key].to(value.dtype), value, f"life-cycle bag {key}")
    assert alone["life"]["rows.stats.click"].sum() > 0, "no click reached the table"
    assert 0 < got["rows"]["d"][0].numel() < len(set(IDS.tolist())), "admission and TTL left every id or none"


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("update", "servers"), [("async", 1), ("geo", 2)])
def test_two_workers_apply_every_push_once(update: str, servers: int) -> None:
    from ps_jobs import run_job

    steps = 4
    strategy = {"update": update, **({"k_steps": 2} if update == "geo" else {})}
    results = run_job(ps_bag_job, servers, 2, strategy, "linear", steps)
    want = reference("linear", steps, [0, 1])
    for rank, got in enumerate(results):
        assert_rows(got["rows"], want["rows"], f"{update} worker {rank}", atol=1e-5)


@pytest.mark.timeout(150)
def test_geo_trains_locally_and_the_servers_add_up_the_workers_changes() -> None:
    from ps_jobs import run_job

    steps = 4
    (alone,) = run_job(ps_bag_job, 1, 1, {"update": "geo", "k_steps": 2}, "full", steps)
    want = reference("full", steps, [0])
    assert_outputs(alone["outputs"], want["outputs"], 0, "geo, one worker")
    assert_rows(alone["rows"], want["rows"], "geo, one worker")
    for got, expected in zip(alone["head"], want["head"], strict=True):
        close(got, expected, "geo, one worker: head")

    results = run_job(ps_bag_job, 2, 2, {"update": "geo", "k_steps": steps}, "full", steps, True)
    start = Net("full", reference=True)
    each = [reference("full", steps, [rank]) for rank in range(2)]
    for rank, got in enumerate(results):  # every forward ran before the sync: the worker alone
        assert_outputs(got["outputs"], each[rank]["outputs"], 0, f"geo worker {rank}")
    shared = [n for n in start.bags if torch.isin(each[0]["rows"][n][0], each[1]["rows"][n][0]).any()]
    assert shared, "no row was changed by both workers: the sum would not be tested"
    summed = {}
    for name, bag in start.bags.items():  # initial rows plus each worker's change, on the rows either touched
        ids = torch.unique(torch.cat([e["rows"][name][0] for e in each]))
        total = bag.weight.detach()[torch.searchsorted(IDS, ids)].clone()
        for e in each:
            mine = torch.isin(ids, e["rows"][name][0])
            total[mine] += e["rows"][name][1] - bag.weight.detach()[torch.searchsorted(IDS, e["rows"][name][0])]
        summed[name] = (ids, total)
    head = [p.detach() + sum(e["head"][i] - p.detach() for e in each) for i, p in enumerate(start.head.parameters())]
    for rank, got in enumerate(results):
        assert_rows(got["rows"], summed, f"geo worker {rank}", atol=1e-5)
        for i, (value, expected) in enumerate(zip(got["head"], head, strict=True)):
            assert torch.allclose(value, expected, atol=1e-5), (rank, i, (value - expected).abs().max())


@pytest.mark.timeout(120)
def test_geo_keeps_the_click_statistics(fresh_fleet) -> None:
    from ps_jobs import run_job

    (got,) = run_job(ps_bag_job, 1, 1, {"update": "geo", "k_steps": 1}, "frozen", 3)
    alone = ps_bag_job(0, "frozen", 3)
    assert torch.equal(got["life"]["rows.ids"], alone["life"]["rows.ids"])
    close(got["life"]["rows.stats.show"], alone["life"]["rows.stats.show"], "shows")
    close(got["life"]["rows.stats.click"], alone["life"]["rows.stats.click"], "clicks")
