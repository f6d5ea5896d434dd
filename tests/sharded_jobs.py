"""A CTR-like model whose sparse tables are sharded across the workers, and the same model in one process.

Three kinds of table module (a ``SparseEmbedding``, a ``SparseEmbeddingBag``, a
``SparseFeatureCollection`` fed ``JaggedFeatures``, TorchRec's KeyedJaggedTensor layout) feed one
dense head. :func:`reference` trains it in one process on the union of the workers' batches;
:func:`worker` trains it on each worker of a collective or sharding job with the tables sharded,
and both return every table's rows (with per-row optimizer state and statistics) and the head.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

DIM, BATCH, VOCAB, STEPS = 4, 6, 30, 4
CAP = 12
FEATURES = ("user", "clicked", "viewed")


class Net(nn.Module):
    def __init__(self, life: bool | str = False) -> None:
        super().__init__()
        import fleet

        table: dict[str, Any] = {}
        if life is True:  # admission by a hash of (id, step), rows unseen for 2 steps evicted, clicks fed
            table = {"entry": fleet.ProbabilityEntry(0.7), "ttl_steps": 2}
        elif life == "count":  # admitted at the second sighting (each owner counts its own ids)
            table = {"entry": fleet.CountFilterEntry(2), "ttl_steps": 3}
        elif life == "cap":  # at most CAP rows: CAP // workers on each owner
            table = {"max_rows": CAP}
        self.emb = fleet.nn.SparseEmbedding(DIM, seed=3, **table)
        self.bag = fleet.nn.SparseEmbeddingBag(DIM, mode="mean", seed=4, **table)
        self.features = fleet.nn.SparseFeatureCollection(
            [
                fleet.nn.FeatureTable("user", DIM, seed=5, **table),
                fleet.nn.FeatureTable("item", DIM, features=["clicked", "viewed"], mode="sum", seed=6, **table),
            ]
        )
        self.head = nn.Linear(DIM * 5, 1)

    def tables(self) -> dict[str, Any]:
        return {"emb": self.emb, "bag": self.bag, "user": self.features["user"], "item": self.features["item"]}

    def forward(self, data: dict[str, Any]) -> torch.Tensor:
        import fleet

        bags = data["bags"]
        jagged = fleet.nn.JaggedFeatures(
            list(FEATURES), torch.cat([bags[f][0] for f in FEATURES]), torch.cat([bags[f][1] for f in FEATURES])
        )
        pooled = self.features(jagged)
        parts = [self.emb(data["ids"]).mean(1), self.bag(data["bag"]), *(pooled[f] for f in FEATURES)]
        return self.head(torch.cat(parts, 1)).squeeze(1)

    def record_clicks(self, label: torch.Tensor) -> None:
        self.emb.record_clicks(label)
        self.bag.record_clicks(label)
        self.features.record_clicks(label)


def _ids(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=g) * 7919 - 100  # sparse ids, negative ones too


def batch(step: int, rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    bags = {}
    for feature in FEATURES:
        lengths = torch.randint(0, 4, (BATCH,), generator=g)  # empty bags too
        bags[feature] = (_ids(g, int(lengths.sum())), lengths)
    return {
        "ids": _ids(g, BATCH, 2),
        "bag": _ids(g, BATCH, 3),
        "bags": bags,
        "label": torch.randint(0, 2, (BATCH,), generator=g).float(),
    }


def union(parts: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "ids": torch.cat([p["ids"] for p in parts]),
        "bag": torch.cat([p["bag"] for p in parts]),
        "bags": {f: tuple(torch.cat([p["bags"][f][i] for p in parts]) for i in range(2)) for f in FEATURES},
        "label": torch.cat([p["label"] for p in parts]),
    }


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    """The rows follow the dense optimizer (its kind and hyper-parameters)."""
    import fleet

    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.3)
    if kind == "momentum":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if kind == "adagrad":
        return torch.optim.Adagrad(params, lr=0.1)
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.01)
    if kind == "rowwise_adagrad":
        return fleet.nn.RowWiseAdagrad(params, lr=0.1)
    raise ValueError(kind)


def train(
    model: Net, opt: torch.optim.Optimizer, data: list[dict[str, Any]], life: bool | str, peeks: list | None = None
) -> None:
    """``peeks[s]``: a batch looked up without gradients between step s's forward and its optimizer step (its
    rows exist already: the math is unchanged)."""
    for s, one in enumerate(data):
        opt.zero_grad()
        out = model(one)
        if life:
            model.record_clicks(one["label"])
        if peeks is not None:
            with torch.no_grad():
                model(peeks[s])
        torch.nn.functional.binary_cross_entropy_with_logits(out, one["label"]).backward()
        opt.step()


def table_states(model: Net) -> dict[str, dict[str, torch.Tensor]]:
    """Every table's rows and per-row fields from its ``state_dict`` (gathered from every owner), by id."""
    from fleet.nn.rows_state import table_rows

    out = {}
    for name, module in model.tables().items():
        state = table_rows(module.state_dict())
        order = torch.argsort(state["ids"])
        out[name] = {
            k: v[order] for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() and len(v) == len(order)
        }
    return out


def dense(model: Net) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in model.head.named_parameters()
    }


def reference(workers: int, kind: str, life: bool | str = False) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net(life)
    opt = make_optimizer(kind, model.parameters())
    train(model, opt, [union([batch(s, r) for r in range(workers)]) for s in range(STEPS)], life)
    return {"tables": table_states(model), "dense": dense(model)}


def worker(
    rank: int,
    kind: str,
    strategy: dict[str, Any],
    life: bool | str = False,
    piece_bytes: int | None = None,
    peek: bool = False,
) -> dict[str, Any]:
    """``piece_bytes``: gather the state dicts' rows in pieces this small (many exchanges). ``peek``: before each
    step, look up a batch without gradients: worker 0 its own (the ids of the step), the others the batch of the
    step before (other ids), so that the step sends the ids of its last pull on worker 0 only."""
    import fleet
    from fleet.collective import sharded_rows

    if piece_bytes is not None:
        sharded_rows.PIECE_BYTES = piece_bytes
    fleet.init()
    torch.manual_seed(0)
    model = Net(life)
    opt = fleet.distributed_optimizer(make_optimizer(kind, model.parameters()), fleet.DistributedStrategy(**strategy))
    me = fleet.worker_index()
    peeks = [batch(s if me == 0 else max(s - 1, 0), me) for s in range(STEPS)] if peek else None
    train(model, opt, [batch(s, me) for s in range(STEPS)], life, peeks)
    held = {}
    for name, module in model.tables().items():
        backend = module.backend()
        shard_ids = backend.local.rows_state()["ids"]
        held[name] = {
            "count": backend.local.num_rows(),
            "owned": bool((backend.owners(shard_ids) == fleet.worker_index()).all()),
            "holder": getattr(backend, "holder", None),  # table-wise: the worker holding the whole table
            "pooled": getattr(backend, "pooled", 0),  # table-wise: forwards whose bags its holder pooled
            "replica": module.local.num_rows(),  # the module's own table: empty when sharded
            "total": module.num_rows(),
            # which way its exchanges went: shared memory among workers of one host, unless switched off
            "through": "shared memory" if backend.shared is not None and backend.shared.usable else "process group",
        }
    out = {"tables": table_states(model), "dense": dense(model), "held": held}
    fleet.stop_worker()
    return out


def _saved(state: dict[str, torch.Tensor]) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def load_bytes(data: bytes) -> dict[str, torch.Tensor]:
    import io

    return torch.load(io.BytesIO(data), weights_only=True)


def more_steps(workers: int) -> list[list[dict[str, Any]]]:
    """The batches of the two steps after a reload on ``workers`` workers (step numbers past the first run's)."""
    return [[batch(100 + s, r) for r in range(workers)] for s in range(2)]


GIVEN = torch.arange(600)  # rows given with load_rows: ids 0..599


def given_rows() -> torch.Tensor:
    return torch.randn(GIVEN.numel(), DIM, generator=torch.Generator().manual_seed(7))


def reference_reload(before: int, after: int, kind: str) -> dict[str, Any]:
    """One process: trained on ``before`` workers' batches, its state dict loaded into a fresh model and
    optimizer, trained on ``after`` workers' batches."""
    torch.manual_seed(0)
    model = Net()
    train(
        model,
        make_optimizer(kind, model.parameters()),
        [union([batch(s, r) for r in range(before)]) for s in range(STEPS)],
        False,
    )
    saved = model.state_dict()
    torch.manual_seed(1)
    second = Net()
    second.load_state_dict(saved)
    train(second, make_optimizer(kind, second.parameters()), [union(parts) for parts in more_steps(after)], False)
    out = {"loaded": table_states(loaded(saved)), "tables": table_states(second), "dense": dense(second)}
    second.emb.load_rows(GIVEN, given_rows())
    out["weight"] = second.emb.dense_weight(GIVEN.numel())
    return out


def loaded(saved: dict[str, torch.Tensor]) -> Net:
    """A fresh model holding ``saved``."""
    model = Net()
    model.load_state_dict(saved)
    return model


def save_worker(rank: int, kind: str, strategy: dict[str, Any]) -> bytes:
    """Train on this worker's batches with the tables sharded; return the model's state dict (every row)."""
    import fleet

    fleet.init()
    torch.manual_seed(0)
    model = Net()
    opt = fleet.distributed_optimizer(make_optimizer(kind, model.parameters()), fleet.DistributedStrategy(**strategy))
    train(model, opt, [batch(s, fleet.worker_index()) for s in range(STEPS)], False)
    out = _saved(model.state_dict())
    fleet.stop_worker()
    return out


def reload_worker(rank: int, saved: bytes, kind: str, strategy: dict[str, Any]) -> dict[str, Any]:
    """Load a state dict saved by another number of workers into sharded tables; train on; give rows."""
    import fleet

    fleet.init()
    torch.manual_seed(1)
    model = Net()
    opt = fleet.distributed_optimizer(make_optimizer(kind, model.parameters()), fleet.DistributedStrategy(**strategy))
    model.load_state_dict(load_bytes(saved))
    out: dict[str, Any] = {"loaded": table_states(model)}
    out["loaded_here"] = {name: module.backend().local.num_rows() for name, module in model.tables().items()}
    train(model, opt, [parts[fleet.worker_index()] for parts in more_steps(fleet.worker_num())], False)
    out["tables"], out["dense"] = table_states(model), dense(model)
    before = model.emb.backend().local.num_rows()
    model.emb.load_rows(GIVEN, given_rows())  # every worker gives the same rows; each keeps its own
    out["given_here"] = model.emb.backend().local.num_rows() - before
    out["weight"] = model.emb.dense_weight(GIVEN.numel())
    fleet.stop_worker()
    return out


def misuse_worker(rank: int, how: str) -> tuple[str, str]:
    """A job that uses its sharded tables unevenly: ``join`` (fleet.join() with 3 and 2 batches) or ``alone``
    (worker 0 looks rows up on its own while worker 1 waits at a barrier). Returns (error type, message)."""
    import fleet

    fleet.init(strategy=fleet.DistributedStrategy(table_placement="sharded", timeout_s=60))
    torch.manual_seed(0)
    model = Net()
    opt = fleet.distributed_optimizer(make_optimizer("sgd", model.parameters()))
    try:
        if how == "join":
            with fleet.join():
                train(model, opt, [batch(s, rank) for s in range(3 - rank)], False)
        else:
            train(model, opt, [batch(0, rank)], False)
            if rank == 0:
                with torch.no_grad():
                    model.emb(torch.arange(4))
            fleet.barrier_worker()
    except Exception as error:  # noqa: BLE001 - the test checks which error and what it says
        return type(error).__name__, str(error)
    return "finished", ""


def nonfinite_worker(rank: int) -> dict[str, Any]:
    """Worker 1's gradients hold NaN at the second step: every owner skips that step of its rows, as one process
    skips a non-finite update whole."""
    import warnings

    import fleet

    fleet.init(strategy=fleet.DistributedStrategy(table_placement="sharded"))
    torch.manual_seed(0)
    model = Net()
    opt = fleet.distributed_optimizer(make_optimizer("sgd", model.parameters()))
    train(model, opt, [batch(0, rank)], False)
    before = table_states(model)
    one = batch(1, rank)
    opt.zero_grad()
    loss = torch.nn.functional.binary_cross_entropy_with_logits(model(one), one["label"])
    (loss * (float("nan") if rank == 1 else 1.0)).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    out = {"before": before, "after": table_states(model), "warned": [str(w.message) for w in caught]}
    fleet.stop_worker()
    return out


def checkpoint_worker(rank: int, ckpt: str, resume: bool, placement: str = "auto") -> dict[str, Any]:
    """mode="sharding" (tables sharded by default, or as ``placement`` says): save a checkpoint after STEPS steps, or
    load it (on another number of workers) and train the two steps after it; the tables' rows and the head either
    way."""
    import fleet

    fleet.init()
    torch.manual_seed(1 if resume else 0)
    model = Net()
    opt = fleet.distributed_optimizer(
        make_optimizer("adagrad", model.parameters()),
        fleet.DistributedStrategy(mode="sharding", table_placement=placement),
    )
    if resume:
        assert fleet.load_checkpoint(ckpt, model, opt).step == STEPS
        loaded = table_states(model)
        train(model, opt, [parts[fleet.worker_index()] for parts in more_steps(fleet.worker_num())], False)
        out = {"loaded": loaded, "tables": table_states(model), "dense": dense(model)}
        out["exported"] = fleet.export_for_inference(ckpt + "-serving", model)  # every worker: rows gathered
    else:
        train(model, opt, [batch(s, fleet.worker_index()) for s in range(STEPS)], False)
        fleet.save_checkpoint(ckpt, model, opt, STEPS)
        out = {"saved": table_states(model)}
    fleet.stop_worker()
    return out


def reference_resume(before: int, after: int) -> dict[str, Any]:
    """One process on the union of ``before`` workers' batches, then (optimizer state and all) ``after``'s."""
    torch.manual_seed(0)
    model = Net()
    opt = make_optimizer("adagrad", model.parameters())
    train(model, opt, [union([batch(s, r) for r in range(before)]) for s in range(STEPS)], False)
    train(model, opt, [union(parts) for parts in more_steps(after)], False)
    return {"tables": table_states(model), "dense": dense(model)}


def pretrained_worker(rank: int) -> dict[str, Any]:
    """Rows given before fleet.init (from_pretrained, in the module's own table) move to their owners when the
    table is sharded: each worker keeps its own, and the module's own table empties."""
    import fleet
    from fleet.nn.rows_state import table_rows

    emb = fleet.nn.SparseEmbedding.from_pretrained(given_rows(), ids=GIVEN * 7 - 3)
    fleet.init(strategy=fleet.DistributedStrategy(table_placement="sharded"))
    head = nn.Linear(DIM, 1)
    opt = fleet.distributed_optimizer(torch.optim.SGD([*emb.parameters(), *head.parameters()], lr=0.1))
    held = emb.backend().local.num_rows()
    out = {"held": held, "replica": emb.local.num_rows(), "rows": table_rows(emb.state_dict())}
    opt.zero_grad()
    head(emb(GIVEN[:5] * 7 - 3)).sum().backward()
    opt.step()
    fleet.stop_worker()
    return out


def _accumulated_and_evaluated(model: Net, opt: torch.optim.Optimizer, parts: list[dict[str, Any]]) -> torch.Tensor:
    """A step over two micro-batches (two forwards and backwards, one optimizer step), then an evaluation forward
    (``torch.no_grad``, ``model.eval()``) of the first micro-batch; its outputs."""
    opt.zero_grad()
    for part in parts:
        torch.nn.functional.binary_cross_entropy_with_logits(model(part), part["label"]).div(len(parts)).backward()
    opt.step()
    model.eval()
    with torch.no_grad():
        out = model(parts[0])
    model.train()
    return out


def reference_accumulated(workers: int, kind: str) -> dict[str, Any]:
    """One process: STEPS steps, then a step of two micro-batches and an evaluation (the union of the workers')."""
    torch.manual_seed(0)
    model = Net()
    opt = make_optimizer(kind, model.parameters())
    train(model, opt, [union([batch(s, r) for r in range(workers)]) for s in range(STEPS)], False)
    parts = [union([batch(50 + m, r) for r in range(workers)]) for m in range(2)]
    out = _accumulated_and_evaluated(model, opt, parts)
    return {"tables": table_states(model), "dense": dense(model), "evaluated": out}


def accumulating_worker(rank: int, kind: str, strategy: dict[str, Any]) -> dict[str, Any]:
    """:func:`reference_accumulated` on this worker's batches."""
    import fleet

    fleet.init()
    torch.manual_seed(0)
    model = Net()
    opt = fleet.distributed_optimizer(make_optimizer(kind, model.parameters()), fleet.DistributedStrategy(**strategy))
    train(model, opt, [batch(s, fleet.worker_index()) for s in range(STEPS)], False)
    out = _accumulated_and_evaluated(model, opt, [batch(50 + m, fleet.worker_index()) for m in range(2)])
    result = {"tables": table_states(model), "dense": dense(model), "evaluated": out}
    fleet.stop_worker()
    return result


def mixed_mode_worker(rank: int) -> tuple[str, str]:
    """Worker 0 evaluates (no_grad) while worker 1 trains, each calling the collection of table-wise tables."""
    import fleet

    fleet.init(strategy=fleet.DistributedStrategy(table_placement="table_wise", timeout_s=60))
    torch.manual_seed(0)
    model = Net()
    fleet.distributed_optimizer(make_optimizer("sgd", model.parameters()))
    data = batch(0, rank)
    try:
        with torch.set_grad_enabled(rank != 0):
            model(data)
    except Exception as error:  # noqa: BLE001 - the test checks which error and what it says
        return type(error).__name__, str(error)
    return "finished", ""


def mixed_weights_worker(rank: int) -> tuple[str, str]:
    """Worker 0 gives its bags per-id weights, worker 1 does not, on a collection of table-wise tables."""
    import fleet

    fleet.init(strategy=fleet.DistributedStrategy(table_placement="table_wise", timeout_s=60))
    collection = fleet.nn.SparseFeatureCollection([fleet.nn.FeatureTable("t", DIM)])
    fleet.distributed_optimizer(torch.optim.SGD(collection.parameters(), lr=0.1))
    ids, lengths = torch.tensor([1, 2, 3]), torch.tensor([2, 1])
    bags = (ids, lengths, torch.ones(3)) if rank == 0 else (ids, lengths)
    try:
        collection({"t": bags})
    except Exception as error:  # noqa: BLE001 - the test checks which error and what it says
        return type(error).__name__, str(error)
    return "finished", ""
