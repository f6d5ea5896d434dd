"""fleet.nn.SparseEmbeddingBag equals nn.EmbeddingBag on the same rows: forward, backward and the rows'
updates, in one process, in collective and sharding mode (2 workers) and in PS sync (1 server, 2 workers)
against one process on the union of the workers' batches."""

from __future__ import annotations

import pytest
import torch
from bag_cases import BAGS, DIM, IDS, LR, PAD, SEED, VOCAB, Bags, Both, close, make_bags, reference_bag, rows_of, union  # noqa: F401
from torch import nn

import fleet

# name -> (module arguments, 2-D input, per-sample weights)
CASES = {
    "sum": ({"mode": "sum"}, False, False),
    "sum+weights": ({"mode": "sum"}, False, True),
    "mean": ({"mode": "mean"}, False, False),
    "max": ({"mode": "max"}, False, False),
    "mean+padding": ({"mode": "mean", "padding_idx": PAD}, False, False),
    "max+padding": ({"mode": "max", "padding_idx": PAD}, False, False),
    "sum+weights+padding+last": ({"mode": "sum", "padding_idx": PAD, "include_last_offset": True}, False, True),
    "mean+last": ({"mode": "mean", "include_last_offset": True}, False, False),
    "max+last": ({"mode": "max", "include_last_offset": True}, False, False),
    "sum+2d": ({"mode": "sum"}, True, False),
    "sum+weights+2d+padding": ({"mode": "sum", "padding_idx": PAD}, True, True),
    "mean+2d+padding": ({"mode": "mean", "padding_idx": PAD}, True, False),
    "max+2d+padding": ({"mode": "max", "padding_idx": PAD}, True, False),
}
OPTIMIZERS = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_equals_nn_embedding_bag_forward_backward_and_updates(case: str, optimizer: str) -> None:
    kwargs, two_d, weighted = CASES[case]
    bag = fleet.nn.SparseEmbeddingBag(DIM, seed=SEED, **kwargs)
    ref = reference_bag(bag)
    opt = OPTIMIZERS[optimizer](bag.parameters(), lr=LR)
    ref_opt = OPTIMIZERS[optimizer](ref.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(7)
    seen: set[int] = set()
    for step in range(3):
        bags = make_bags(gen, two_d, weighted, "padding_idx" in kwargs, bag.include_last_offset)
        seen |= set(bags.input.reshape(-1).tolist()) - {PAD}
        probe = torch.randn(BAGS, DIM, generator=gen)
        w = bags.weights.clone().requires_grad_(True) if weighted else None
        ref_w = bags.weights.clone().requires_grad_(True) if weighted else None
        opt.zero_grad()
        ref_opt.zero_grad()
        out = bag(bags.input, bags.offsets, w)
        want = ref(bags.dense(), bags.offsets, ref_w)
        close(out, want, f"step {step} forward")
        (out * probe).sum().backward()
        (want * probe).sum().backward()
        if weighted:
            close(w.grad, ref_w.grad, f"step {step} per_sample_weights gradient")
        opt.step()
        ref_opt.step()
        if step == 0:  # before rows_of, which creates the rows it reads
            assert bag.num_rows() == len(seen)
        assert PAD not in bag.backend().export()[0].tolist(), "the padding id got a row"
        close(rows_of(bag), ref.weight[:VOCAB].detach(), f"step {step} rows")


def test_empty_bags_and_empty_batches_give_zeros_and_no_rows() -> None:
    bag = fleet.nn.SparseEmbeddingBag(DIM, mode="max", padding_idx=PAD)
    opt = torch.optim.SGD(bag.parameters(), lr=LR)
    out = bag(torch.empty(0, dtype=torch.int64), torch.zeros(3, dtype=torch.int64))
    close(out, torch.zeros(3, DIM), "empty batch")
    out = bag(torch.tensor([PAD, PAD]), torch.tensor([0, 1]))
    close(out, torch.zeros(2, DIM), "bags of padding only")
    out = bag(torch.full((2, 3), PAD))
    close(out, torch.zeros(2, DIM), "2-D bags of padding only")
    out.sum().backward()
    opt.step()
    assert bag.num_rows() == 0


def test_gradient_reaches_the_table_once_per_unique_id() -> None:
    bag = fleet.nn.SparseEmbeddingBag(DIM, mode="sum", seed=SEED)
    ids = torch.tensor([5, 9, 5, 5, 9, 11])
    bag(ids, torch.tensor([0, 3])).sum().backward()
    got_ids, grads, _ = bag.take_gradients()
    assert got_ids.tolist() == [5, 9, 11]
    close(grads, torch.tensor([3.0, 2.0, 1.0]).unsqueeze(1).expand(3, DIM), "row gradients")


def test_prefetch_and_no_grad_forwards_change_nothing() -> None:
    bag = fleet.nn.SparseEmbeddingBag(DIM, mode="mean", padding_idx=PAD, seed=SEED)
    ids, offsets = torch.tensor([5, PAD, 9, 5]), torch.tensor([0, 2])
    want = bag(ids, offsets)
    bag.take_gradients()
    bag.prefetch(ids)  # in one process the rows are here already: nothing to fetch
    close(bag(ids, offsets), want, "after prefetch")
    with torch.no_grad():
        close(bag(ids, offsets), want, "under no_grad")
    got_ids, _, _ = bag.take_gradients()
    assert got_ids.tolist() == [5, 9], "one training forward's ids, the padding id left out"


def test_record_clicks_gives_each_id_its_bags_label() -> None:
    bag = fleet.nn.SparseEmbeddingBag(DIM, mode="sum", padding_idx=PAD, include_last_offset=True)
    bag(torch.tensor([5, PAD, 9, 5, 11, 12]), torch.tensor([0, 2, 2, 5]))  # entry 12 is past the last bag
    bag.record_clicks(torch.tensor([1.0, 0.0, 1.0]))
    ids, _, clicks = bag.take_gradients()
    assert dict(zip(ids.tolist(), clicks.tolist(), strict=True)) == {5: 2.0, 9: 1.0, 11: 1.0, 12: 0.0}
    bag(torch.tensor([[5, 9], [9, PAD]]))
    with pytest.raises(ValueError, match="3 labels for 2 bags"):
        bag.record_clicks(torch.ones(3))


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        # (1000, 16) is nn.Embedding's signature now (issue 36): tests/nn/test_drop_in.py
        (lambda: fleet.nn.SparseEmbedding(16, 1000, 3), TypeError, r"at most 2 positional arguments"),
        (
            lambda: fleet.nn.SparseEmbeddingBag(16, "sum", mode="sum"),
            TypeError,
            r"SparseEmbeddingBag got the mode twice",
        ),
        (lambda: fleet.nn.SparseEmbedding(16, mode="sum"), TypeError, "'mode'.*SparseEmbeddingBag"),
        (lambda: fleet.nn.SparseEmbeddingBag(16, sparse=True), TypeError, "'sparse'.*always sparse"),
        (lambda: fleet.nn.SparseEmbeddingBag(16, mode="median"), ValueError, "sum, mean, max.*'median'"),
        (lambda: fleet.nn.SparseEmbeddingBag(16, padding_idx=0.5), TypeError, "padding_idx must be an int id"),
        (lambda: fleet.nn.SparseEmbedding(4)(torch.tensor([1]), torch.tensor([0])), TypeError, "SparseEmbeddingBag"),
        (lambda: fleet.nn.SparseEmbeddingBag(4)(torch.tensor([1, 2])), ValueError, "1-D input needs offsets"),
        (
            lambda: fleet.nn.SparseEmbeddingBag(4)(torch.tensor([[1, 2]]), torch.tensor([0])),
            ValueError,
            "offsets must be None for a 2-D input",
        ),
        (
            lambda: fleet.nn.SparseEmbeddingBag(4)(torch.tensor([1, 2]), torch.tensor([0]), torch.ones(2)),
            ValueError,
            "per_sample_weights need mode='sum'",
        ),
        (
            lambda: fleet.nn.SparseEmbeddingBag(4, "sum")(torch.tensor([1, 2]), torch.tensor([0]), torch.ones(3)),
            ValueError,
            "one weight per id",
        ),
        (lambda: fleet.nn.SparseEmbeddingBag(4)(torch.tensor([1.0]), torch.tensor([0])), TypeError, "integer ids"),
    ],
)
def test_mistakes_get_a_clear_error(make, error, match) -> None:
    with pytest.raises(error, match=match):
        make()


# ---------------------------------------------------------------- the same model in every mode
FEATURES = {  # name -> (module arguments, 2-D input, per-sample weights); tables b and c use Adagrad
    "a": ({"mode": "sum"}, False, True),
    "b": ({"mode": "mean", "padding_idx": PAD, "include_last_offset": True}, False, False),
    "c": ({"mode": "max", "padding_idx": PAD}, True, False),
}
ADAGRAD = {"b", "c"}


class BagNet(nn.Module):
    """Three multi-hot features pooled, then a linear layer: fleet's tables or nn.EmbeddingBag ones."""

    def __init__(self, reference: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(len(FEATURES) * DIM, 1)
        tables = {}
        for name, (kwargs, _, _) in FEATURES.items():
            spec = {"optimizer": {"kind": "adagrad", "lr": LR}} if name in ADAGRAD else {}
            tables[name] = fleet.nn.SparseEmbeddingBag(DIM, seed=SEED, **kwargs, **spec)
            if reference:
                tables[name] = reference_bag(tables[name])
        self.bags = nn.ModuleDict(tables)
        self.reference = reference

    def forward(self, batch: dict[str, Bags]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        pooled = {}
        for name, bags in batch.items():
            ids = bags.dense() if self.reference else bags.input
            pooled[name] = self.bags[name](ids, bags.offsets, bags.weights)
        return self.head(torch.cat(list(pooled.values()), 1)).squeeze(1), pooled

    def optimizer(self) -> torch.optim.Optimizer:
        if not self.reference:  # the tables' own optimizer overrides the dense one's
            return torch.optim.SGD(self.parameters(), lr=LR)
        adagrad = [p for name in ADAGRAD for p in self.bags[name].parameters()]
        sgd = [p for p in self.parameters() if all(p is not q for q in adagrad)]
        return Both(torch.optim.SGD(sgd, lr=LR), torch.optim.Adagrad(adagrad, lr=LR))


def worker_batch(step: int, rank: int) -> tuple[dict[str, Bags], torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    batch = {
        name: make_bags(gen, two_d, weighted, "padding_idx" in kwargs, kwargs.get("include_last_offset", False))
        for name, (kwargs, two_d, weighted) in FEATURES.items()
    }
    return batch, torch.randn(BAGS, generator=gen)


def bag_job(rank: int, steps: int, mode: str = "collective") -> dict:
    """A worker (or server) of any mode: train BagNet, report each step's pooled outputs and the final rows."""
    try:
        fleet.init()
    except SystemExit as stop:  # a PS server: it served, then exited
        return {"served": stop.code}
    model = BagNet()
    strategy = fleet.DistributedStrategy(mode="sharding") if mode == "sharding" else None
    opt = fleet.distributed_optimizer(model.optimizer(), strategy)
    outputs = []
    for step in range(steps):
        batch, target = worker_batch(step, fleet.worker_index())
        opt.zero_grad()
        prediction, pooled = model(batch)
        torch.nn.functional.mse_loss(prediction, target).backward()
        opt.step()
        outputs.append({name: p.detach() for name, p in pooled.items()})
    fleet.barrier_worker()
    num_rows = {name: bag.num_rows() for name, bag in model.bags.items()}
    # Reading the rows pulls every id, which creates the absent ones on a PS server: every worker
    # must have counted the rows before any reads them (a slow worker counted 30 for 28 once).
    fleet.barrier_worker()
    out = {"outputs": outputs, "num_rows": num_rows, "rows": {name: rows_of(bag) for name, bag in model.bags.items()}}
    fleet.stop_worker()
    return out


def bag_reference(steps: int, workers: int) -> dict:
    """One process on the union of the workers' batches, with nn.EmbeddingBag tables."""
    model = BagNet(reference=True)
    opt = model.optimizer()
    outputs = []
    seen: dict[str, set[int]] = {name: set() for name in FEATURES}
    for step in range(steps):
        parts = [worker_batch(step, r) for r in range(workers)]
        batch = {name: union([p[0][name] for p in parts], FEATURES[name][0].get("include_last_offset", False))
                 for name in FEATURES}  # fmt: skip
        target = torch.cat([p[1] for p in parts])
        for name, bags in batch.items():
            seen[name] |= set(bags.input.reshape(-1).tolist()) - {PAD}
        opt.zero_grad()
        prediction, pooled = model(batch)
        torch.nn.functional.mse_loss(prediction, target).backward()
        opt.step()
        outputs.append({name: p.detach().chunk(workers) for name, p in pooled.items()})
    rows = {name: bag.weight[:VOCAB].detach() for name, bag in model.bags.items()}
    return {"outputs": outputs, "rows": rows, "num_rows": {name: len(ids) for name, ids in seen.items()}}


def assert_job_matches(results: list[dict], want: dict) -> None:
    for rank, got in enumerate(results):
        for step, outputs in enumerate(got["outputs"]):
            for name, pooled in outputs.items():
                close(pooled, want["outputs"][step][name][rank], f"worker {rank} step {step} table {name} forward")
        for name, rows in got["rows"].items():
            close(rows, want["rows"][name], f"worker {rank} table {name} rows")
        assert got["num_rows"] == want["num_rows"], (rank, got["num_rows"], want["num_rows"])


def test_a_model_of_bags_with_fleet_init_equals_nn_embedding_bag(fresh_fleet) -> None:
    assert_job_matches([bag_job(0, 4)], bag_reference(4, 1))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["collective", "sharding"])
def test_collective_and_sharding_equal_one_process_on_the_union(mode: str) -> None:
    from dist_harness import run_workers

    assert_job_matches(run_workers(bag_job, 2, 4, mode, timeout=90), bag_reference(4, 2))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_ps_sync_equals_one_process_on_the_union() -> None:
    from ps_jobs import run_job

    assert_job_matches(run_job(bag_job, 1, 2, {"update": "sync"}, 4, "ps"), bag_reference(4, 2))
