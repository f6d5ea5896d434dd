"""fleet.nn.SparseFeatureCollection equals nn.EmbeddingBag tables on the same rows (forward, backward, the
rows' updates) in one process, collective, sharding and the parameter server (sync with 1 and 2 servers,
async with one worker) against one process on the union of the workers' batches; its pulls and pushes
are one request per server per step whatever the number of tables."""

from __future__ import annotations

import pytest
import torch
from bag_cases import BAGS, IDS, LR, PAD, SEED, VOCAB, Bags, Both, close, make_bags, rows_of, union
from torch import nn

import fleet
from fleet.nn import FeatureTable, JaggedFeatures, SparseFeatureCollection
from fleet.sparse.optim import InitializerSpec, initial_rows

# table -> (dim, features, FeatureTable arguments); feature -> (2-D input, per-id weights, padding)
TABLES = {
    "a": (4, ("a1", "a2"), {"mode": "sum"}),
    "b": (3, ("b",), {"mode": "mean", "padding_idx": PAD, "optimizer": {"kind": "adagrad", "lr": LR}}),
    "c": (5, ("c",), {"mode": "max", "padding_idx": PAD}),
}
FEATURES = {
    "a1": (False, True, False),
    "a2": (False, False, False),
    "b": (False, False, True),
    "c": (True, False, True),
}
TABLE_OF = {f: name for name, (_, features, _) in TABLES.items() for f in features}
WIDTH = sum(TABLES[TABLE_OF[f]][0] for f in FEATURES)


def lengths_of(bags: Bags) -> torch.Tensor:
    return torch.diff(torch.cat([bags.offsets, torch.tensor([bags.input.numel()])]))


def as_input(batch: dict[str, Bags]) -> dict:
    """The collection's dict input: 2-D bags, (values, lengths) or (values, lengths, weights)."""
    out = {}
    for name, bags in batch.items():
        if bags.offsets is None:
            out[name] = bags.input
        elif bags.weights is not None:
            out[name] = (bags.input, lengths_of(bags), bags.weights)
        else:
            out[name] = (bags.input, lengths_of(bags))
    return out


def as_jagged(batch: dict[str, Bags]) -> JaggedFeatures:
    """The same (unweighted) batch as one KeyedJaggedTensor-style object (a 2-D feature: bags of equal length)."""
    values, lengths = [], []
    for bags in batch.values():
        values.append(bags.input.reshape(-1))
        if bags.offsets is None:
            lengths.append(torch.full((bags.input.shape[0],), bags.input.shape[1]))
        else:
            lengths.append(lengths_of(bags))
    return JaggedFeatures(list(batch), torch.cat(values), lengths=torch.cat(lengths))


def collection() -> SparseFeatureCollection:
    return SparseFeatureCollection(
        [FeatureTable(name, dim, features, seed=SEED, **kwargs) for name, (dim, features, kwargs) in TABLES.items()]
    )


class Net(nn.Module):
    """The collection (or nn.EmbeddingBag tables over the same starting rows) and a linear head."""

    def __init__(self, reference: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(WIDTH, 1)
        self.reference = reference
        if reference:
            self.tables = nn.ModuleDict(
                {
                    name: nn.EmbeddingBag(
                        VOCAB + 1, dim, mode=kwargs["mode"], padding_idx=VOCAB if "padding_idx" in kwargs else None,
                        _weight=torch.cat([initial_rows(IDS, dim, InitializerSpec(), SEED), torch.zeros(1, dim)]),
                    )
                    for name, (dim, _, kwargs) in TABLES.items()
                }
            )  # fmt: skip
        else:
            self.features = collection()

    def forward(self, batch: dict[str, Bags]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self.reference:
            pooled = {
                f: self.tables[TABLE_OF[f]](bags.dense(), bags.offsets, bags.weights) for f, bags in batch.items()
            }
        else:
            pooled = self.features(as_input(batch))
        return self.head(torch.cat([pooled[f] for f in FEATURES], 1)).squeeze(1), pooled

    def optimizer(self):
        if not self.reference:  # table b's own optimizer (Adagrad) overrides the dense one's
            return torch.optim.SGD(self.parameters(), lr=LR)
        adagrad = list(self.tables["b"].parameters())
        sgd = [p for p in self.parameters() if all(p is not q for q in adagrad)]
        return Both(torch.optim.SGD(sgd, lr=LR), torch.optim.Adagrad(adagrad, lr=LR))


def worker_batch(step: int, rank: int) -> tuple[dict[str, Bags], torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    batch = {f: make_bags(gen, two_d, weighted, padding, False) for f, (two_d, weighted, padding) in FEATURES.items()}
    return batch, torch.randn(BAGS, generator=gen)


def server_ops() -> list[dict]:
    """Each server's request counts (worker-side, through the job's client)."""
    from fleet.runtime import context

    return [info["ops"] for info in context.strategy().client().stats().result()]


def collection_job(rank: int, steps: int, mode: str = "collective") -> dict:
    """A worker (or server) of any mode: train Net, report each step's pooled outputs, the rows, the requests."""
    try:
        fleet.init()
    except SystemExit as stop:  # a PS server: it served, then exited
        return {"served": stop.code}
    model = Net()
    strategy = {
        "sharding": fleet.DistributedStrategy(mode="sharding"),
        "table_wise": fleet.DistributedStrategy(table_placement="table_wise"),  # bags pooled by their holders
    }.get(mode)
    opt = fleet.distributed_optimizer(model.optimizer(), strategy)
    outputs = []
    for step in range(steps):
        batch, target = worker_batch(step, fleet.worker_index())
        opt.zero_grad()
        prediction, pooled = model(batch)
        torch.nn.functional.mse_loss(prediction, target).backward()
        # the next batch's rows: fetched in the background in async PS (an unused prefetch would show
        # as extra pulls in the servers' counts), nothing elsewhere
        if step + 1 < steps:
            model.features.prefetch(as_input(worker_batch(step + 1, fleet.worker_index())[0]))
        opt.step()
        outputs.append({f: p.detach() for f, p in pooled.items()})
    fleet.barrier_worker()
    out = {
        "outputs": outputs,
        "ops": server_ops() if mode == "ps" else None,
        "num_rows": {name: t.num_rows() for name, t in model.features.tables.items()},
        # table-wise: forwards whose bags the tables' holders pooled
        "pooled": {name: getattr(t.backend(), "pooled", 0) for name, t in model.features.tables.items()},
    }
    # Reading the rows pulls every id (creating absent rows on a PS server, and counting as pulls): every
    # worker must have counted rows and requests before any reads them (a slow worker counted 30 for 29).
    fleet.barrier_worker()
    out["rows"] = {name: rows_of(t) for name, t in model.features.tables.items()}
    fleet.stop_worker()
    return out


def reference(steps: int, workers: int) -> dict:
    """One process on the union of the workers' batches, with nn.EmbeddingBag tables."""
    model = Net(reference=True)
    opt = model.optimizer()
    outputs = []
    seen: dict[str, set[int]] = {name: set() for name in TABLES}
    for step in range(steps):
        parts = [worker_batch(step, r) for r in range(workers)]
        batch = {f: union([p[0][f] for p in parts], False) for f in FEATURES}
        for f, bags in batch.items():
            seen[TABLE_OF[f]] |= set(bags.input.reshape(-1).tolist()) - {PAD}
        opt.zero_grad()
        prediction, pooled = model(batch)
        torch.nn.functional.mse_loss(prediction, torch.cat([p[1] for p in parts])).backward()
        opt.step()
        outputs.append({f: p.detach().chunk(workers) for f, p in pooled.items()})
    rows = {name: bag.weight[:VOCAB].detach() for name, bag in model.tables.items()}
    return {"outputs": outputs, "rows": rows, "num_rows": {name: len(ids) for name, ids in seen.items()}}


def assert_matches(results: list[dict], want: dict) -> None:
    for rank, got in enumerate(results):
        for step, outputs in enumerate(got["outputs"]):
            for f, pooled in outputs.items():
                close(pooled, want["outputs"][step][f][rank], f"worker {rank} step {step} feature {f} forward")
        for name, rows in got["rows"].items():
            close(rows, want["rows"][name], f"worker {rank} table {name} rows")
        assert got["num_rows"] == want["num_rows"], (rank, got["num_rows"], want["num_rows"])


def test_one_process_equals_nn_embedding_bag_tables(fresh_fleet) -> None:
    assert_matches([collection_job(0, 4)], reference(4, 1))


def test_jagged_features_and_a_dict_give_the_same_bags() -> None:
    batch, _ = worker_batch(0, 0)
    batch = {f: Bags(b.input, b.offsets, None) for f, b in batch.items()}
    model = collection()
    model.eval()
    by_dict = model(as_input(batch))
    jagged = as_jagged(batch)
    by_jagged = model(jagged)
    assert list(by_dict) == list(by_jagged) == list(FEATURES)
    for f in FEATURES:
        close(by_jagged[f], by_dict[f], f"feature {f}")
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), jagged.lengths().cumsum(0)])
    by_offsets = model(JaggedFeatures(jagged.keys(), jagged.values(), offsets=offsets))
    close(by_offsets["a2"], by_dict["a2"], "offsets")
    weighted = JaggedFeatures(["a1", "a2", "b", "c"], jagged.values(), lengths=jagged.lengths(),
                              weights=torch.ones(jagged.values().numel()))  # fmt: skip
    with pytest.raises(ValueError, match="per-id weights need mode='sum'"):
        model(weighted)  # weights for every feature, tables b and c pool by mean and max

    class KeyedJagged:  # the surface of torchrec's KeyedJaggedTensor the collection reads
        def keys(self):
            return jagged.keys()

        def values(self):
            return jagged.values()

        def lengths(self):
            return jagged.lengths()

        def weights_or_none(self):
            return None

    close(model(KeyedJagged())["c"], by_dict["c"], "KeyedJaggedTensor-like")


def test_record_clicks_gives_each_id_its_samples_label() -> None:
    model = SparseFeatureCollection(
        [FeatureTable("t", 2, ["x", "y"], entry=fleet.CountFilterEntry(1), padding_idx=PAD)]
    )
    ids_x = torch.tensor([1, 2, 2, PAD])
    ids_y = torch.tensor([3, 1])
    out = model({"x": (ids_x, torch.tensor([2, 2])), "y": (ids_y, torch.tensor([1, 1]))})
    sum(o.sum() for o in out.values()).backward()
    model.record_clicks(torch.tensor([1.0, 0.0]))
    ids, _, clicks = model.tables["t"].take_gradients()
    got = dict(zip(ids.tolist(), clicks.tolist(), strict=True))
    # sample 0: x = {1, 2}, y = {3}; sample 1: x = {2, PAD}, y = {1}
    assert got == {1: 1.0, 2: 1.0, 3: 1.0}


@pytest.mark.parametrize(
    ("features", "error", "match"),
    [
        ({"a1": torch.zeros(2, 3, dtype=torch.int64)}, ValueError, "missing from the input"),
        ({"zz": torch.zeros(2, 3, dtype=torch.int64)}, ValueError, "not in the collection"),
        ({"a1": torch.zeros(2, 3)}, TypeError, "integer tensor"),
        ({"a1": torch.zeros(6, dtype=torch.int64)}, ValueError, "2-D batch of bags"),
        ({"a1": (torch.zeros(3, dtype=torch.int64), torch.tensor([1, 1]))}, ValueError, "adding up to the 3 ids"),
        ({"a1": 3}, TypeError, "expected a 2-D tensor of bags"),
        ("not features", TypeError, "KeyedJaggedTensor"),
    ],
)
def test_input_mistakes_get_a_clear_error(features, error, match) -> None:
    with pytest.raises(error, match=match):
        collection()(features)


def test_batch_sizes_and_weights_are_checked() -> None:
    two = torch.zeros(2, 3, dtype=torch.int64)
    three = torch.zeros(3, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="batch sizes differ"):
        collection()({"a1": two, "a2": two, "b": two, "c": three})
    ids, lengths = torch.zeros(2, dtype=torch.int64), torch.tensor([1, 1])
    weighted = {"a1": two, "a2": two, "b": (ids, lengths, torch.ones(2)), "c": two}
    with pytest.raises(ValueError, match="need mode='sum'"):
        collection()(weighted)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: SparseFeatureCollection([]), "non-empty list"),
        (lambda: SparseFeatureCollection([FeatureTable("t", 2), FeatureTable("t", 3, ["u"])]), "names repeat"),
        (lambda: SparseFeatureCollection([FeatureTable("t", 2, ["f"]), FeatureTable("u", 2, ["f"])]), "more than one"),
        (lambda: FeatureTable("a.b", 2), "without '.'"),
        (lambda: FeatureTable("t", 2, "f"), "list of feature names"),
        (lambda: FeatureTable("t", 2, mode="avg"), "mode must be one of"),
        (lambda: FeatureTable("t", 2, max_norm=1.0), "max_norm"),
    ],
)
def test_construction_mistakes_get_a_clear_error(make, match) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        make()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["collective", "sharding", "table_wise"])
def test_collective_and_sharding_equal_one_process_on_the_union(mode: str) -> None:
    from dist_harness import run_workers

    results = run_workers(collection_job, 2, 3, mode, timeout=90)
    assert_matches(results, reference(3, 2))
    if mode == "table_wise":  # per-id weights, mean and max pooling, padding: all pooled where the tables live
        assert all(r["pooled"] == {name: 3 for name in TABLES} for r in results), [r["pooled"] for r in results]


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize(("servers", "update"), [(2, "sync"), (1, "async")])
def test_ps_in_one_pull_and_one_push_per_server_per_step(servers, update) -> None:
    """Sync equals one process on the union; async (dense values a step behind by design) holds the same rows
    on every worker. Either way each step is one pull and one push per server for the 3 tables."""
    from ps_jobs import run_job

    steps, workers = 3, 2
    results = run_job(collection_job, servers, workers, {"update": update}, steps, "ps")
    want = reference(steps, workers)
    if update == "sync":
        assert_matches(results, want)
    else:
        for name in TABLES:
            close(results[1]["rows"][name], results[0]["rows"][name], f"table {name} rows on both workers")
        assert results[0]["num_rows"] == want["num_rows"]
    for ops in results[0]["ops"]:
        assert "PULL_SPARSE" not in ops and "PUSH_SPARSE_GRAD" not in ops, ops
        assert ops["PUSH_SPARSE_GRAD_MANY"] == steps * workers, ops  # 3 tables, one push per step
        assert 0 < ops["PULL_SPARSE_MANY"] <= steps * workers, ops  # a server without ids is not asked
    if update == "async":  # one server: one pull per step, the prefetched one after the first
        assert results[0]["ops"][0]["PULL_SPARSE_MANY"] == steps * workers


def _autograd_rows_gradient(table, ids, lengths, weights, rows, upstream) -> torch.Tensor:
    """The union's rows' gradient as one process's autograd gives it: a leaf, the collection's pooling, backward."""
    from fleet.nn.bag_kernels import unique_inverse
    from fleet.nn.sparse_embedding_bag import pool

    kept = [table.kept_ids(i) for i in ids]
    _, inverse = unique_inverse(torch.cat([k for k, _ in kept]))
    leaf = rows.clone().requires_grad_(True)
    outputs, at = [], 0
    for feature_ids, (k, keep), n, w in zip(ids, kept, lengths, weights, strict=True):
        offsets = torch.cat([n.new_zeros(1), n.cumsum(0)])
        outputs.append(pool(leaf, inverse[at : at + k.numel()], keep, feature_ids.shape, offsets, table.mode, w, True))
        at += k.numel()
    torch.autograd.backward(outputs, upstream)
    return leaf.grad


@pytest.mark.parametrize("features", [1, 2, 3, 5])
@pytest.mark.parametrize("kind", ["sum", "mean", "weighted", "padding"])
def test_holder_pooling_gradient_is_autograds_bit_for_bit(features: int, kind: str) -> None:
    # a table-wise holder pools plain sums without autograd and sums the rows' gradients itself: the same bits
    from fleet.nn.feature_collection import _pool_union
    from fleet.nn.sparse_embedding_bag import SparseEmbeddingBag

    gen = torch.Generator().manual_seed(features * 7 + len(kind))
    table = SparseEmbeddingBag(8, "mean" if kind == "mean" else "sum", padding_idx=3 if kind == "padding" else None)
    lengths = [torch.randint(0, 12, (64,), generator=gen) for _ in range(features)]
    ids = [torch.randint(0, 40, (int(n.sum()),), generator=gen) for n in lengths]  # many ties per row
    weights = [torch.rand(i.numel(), generator=gen) if kind == "weighted" else None for i in ids]
    table_rows: dict[int, torch.Tensor] = {}

    def pull(unique: torch.Tensor) -> torch.Tensor:
        return torch.stack([table_rows.setdefault(int(i), torch.randn(8, generator=gen)) for i in unique.tolist()])

    unique, pooled, _, gradient = _pool_union(table, ids, lengths, weights, pull, True)
    upstream = [torch.randn(p.shape, generator=gen) * 1e3 for p in pooled]
    got = gradient(upstream)
    rows = torch.stack([table_rows[int(i)] for i in unique.tolist()])
    want = _autograd_rows_gradient(table, ids, lengths, weights, rows, upstream)
    assert torch.equal(got, want)
    assert _pool_union(table, ids, lengths, weights, pull, False)[3] is None


@pytest.mark.parametrize("unused", [None, 0, -1])
def test_one_node_for_every_sum_pooled_table_gives_autograds_bits(unused: int | None) -> None:
    # the collection pools every plain-sum table in one autograd node (sum_bags_many): each table's rows get the
    # gradient that one node per feature gave, bit for bit: features of one table summed in autograd's order, an
    # unused output adding nothing; a table it cannot sum (mean) keeps its own nodes beside it
    gen = torch.Generator().manual_seed(11 + (unused or 0))
    shapes = {"one": (8, 1, "sum"), "two": (4, 2, "sum"), "three": (16, 3, "sum"), "five": (8, 5, "sum"),
              "avg": (4, 2, "mean")}  # fmt: skip
    model = SparseFeatureCollection(
        [FeatureTable(name, dim, [f"{name}{k}" for k in range(n)], mode=mode, seed=3)
         for name, (dim, n, mode) in shapes.items()]
    )  # fmt: skip
    batch, lengths_of_feature = {}, {}
    for name, (_, n, _) in shapes.items():
        for k in range(n):
            lengths = torch.randint(0, 12, (64,), generator=gen)
            batch[f"{name}{k}"] = (torch.randint(0, 30, (int(lengths.sum()),), generator=gen), lengths)
            lengths_of_feature[f"{name}{k}"] = lengths
    pooled = model(batch)
    used = [f for f in model.feature_names if unused is None or f != model.feature_names[unused]]
    upstream = {f: torch.randn(pooled[f].shape, generator=gen) * 1e3 for f in used}
    torch.autograd.backward([pooled[f] for f in used], [upstream[f] for f in used])
    for name, table in model.tables.items():
        unique, rows, _, _ = table._pending[-1]
        features = model.features_of(name)
        live = [f for f in features if f in upstream]
        if not live:
            assert rows.grad is None
            continue
        ids = [batch[f][0] for f in features]
        grads = [upstream.get(f, torch.zeros(pooled[f].shape)) for f in features]
        want = _autograd_rows_gradient(table, ids, [batch[f][1] for f in features], [None] * len(features),
                                       rows.detach(), grads)  # fmt: skip
        if len(live) < len(features):  # autograd without the unused output: it adds nothing, not even zeros
            kept = [i for i, f in enumerate(features) if f in upstream]
            from fleet.nn.bag_kernels import unique_inverse
            from fleet.nn.sparse_embedding_bag import pool

            _, inverse = unique_inverse(torch.cat(ids))
            leaf = rows.detach().clone().requires_grad_(True)
            outputs, at = [], 0
            for f, i in zip(features, ids, strict=True):
                offsets = torch.cat([lengths_of_feature[f].new_zeros(1), lengths_of_feature[f].cumsum(0)])
                outputs.append(pool(leaf, inverse[at : at + i.numel()], None, i.shape, offsets, table.mode, None, True))
                at += i.numel()
            torch.autograd.backward([outputs[i] for i in kept], [grads[i] for i in kept])
            want = leaf.grad
        assert torch.equal(rows.grad, want), name
        for f, i in zip(features, ids, strict=True):  # the sums are F.embedding_bag's, bit for bit
            offsets = torch.cat([lengths_of_feature[f].new_zeros(1), lengths_of_feature[f].cumsum(0)])
            by_id = torch.nn.functional.embedding_bag(
                torch.searchsorted(unique, i), rows.detach(), offsets, mode=table.mode, include_last_offset=True
            )
            assert torch.equal(pooled[f].detach(), by_id), f
        assert torch.equal(unique, unique_ids(ids)), name
    assert type(pooled["five0"].grad_fn) is type(pooled["one0"].grad_fn)  # one node type for the sums
    assert pooled["five0"].grad_fn is pooled["one0"].grad_fn  # and one node


def unique_ids(ids: list[torch.Tensor]) -> torch.Tensor:
    return torch.unique(torch.cat(ids))
