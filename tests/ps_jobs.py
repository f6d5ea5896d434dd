"""Shared pieces of the parameter-server strategy tests: a small CTR-like model, its data and a job runner."""

from __future__ import annotations

import io
import json
import secrets

import torch

from dist_harness import describe, free_port, run_processes

SLOTS, DIM, DENSE, VOCAB, BATCH = 3, 4, 5, 40, 8


class Net(torch.nn.Module):
    def __init__(self, sparse_optimizer: dict | None = None, **lifecycle) -> None:
        super().__init__()
        import fleet

        self.emb = fleet.nn.SparseEmbedding(DIM, seed=3, optimizer=sparse_optimizer, **lifecycle)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(SLOTS * DIM + DENSE, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def forward(self, ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([self.emb(ids).flatten(1), dense], 1)).squeeze(1)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, VOCAB, (BATCH, SLOTS), generator=g) * 7919 - 100  # sparse, negative ids too
    dense = torch.randn(BATCH, DENSE, generator=g)
    w = torch.Generator().manual_seed(0)
    label = (dense @ torch.randn(DENSE, generator=w) > 0).float()
    return ids, dense, label


def make_model(name: str) -> Net:
    """``+adagrad_rows``: the sparse table overrides the dense optimizer with its own (Adagrad); ``+ftrl_rows``: FTRL.

    ``+life``: a life cycle (ids admitted on their second sighting, rows unseen for 3 steps
    evicted, clicks fed); ``+cap``: at most 30 rows (of the 40 ids the data uses).
    """
    import fleet

    lifecycle = {}
    if "+life" in name:
        lifecycle = {"entry": fleet.CountFilterEntry(2), "ttl_steps": 3}
    if "+cap" in name:
        lifecycle["max_rows"] = 30
    rows = {"kind": "adagrad", "lr": 0.1} if name.endswith("+adagrad_rows") else None
    if name.endswith("+ftrl_rows"):  # FTRL-Proximal, an L1 strong enough to zero some rows
        rows = {"kind": "ftrl", "lr": 0.1, "l1": 0.004, "l2": 0.01, "beta": 0.5}
    return Net(rows, **lifecycle)


def feed_clicks(name: str, model: Net, label: torch.Tensor) -> None:
    if "+life" in name:
        model.emb.record_clicks(label)


def make_scheduler(name: str, opt: torch.optim.Optimizer):
    """``...+steplr``: the learning rate halves every 2 steps (it travels with every push)."""
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if name.endswith("+steplr") else None


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    name = name.split("+")[0]
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01)
    if name == "rwsadagrad":  # row-wise on the sparse table, torch's Adagrad on the MLP
        import fleet

        return fleet.nn.RowWiseAdagrad(params, lr=0.1, lr_decay=0.01)
    return torch.optim.SGD(params, lr=0.3)


def all_ids() -> torch.Tensor:
    return torch.arange(VOCAB) * 7919 - 100


def snapshot(model: Net) -> dict[str, torch.Tensor]:
    model.eval()
    with torch.no_grad():
        rows = model.emb(all_ids())
    model.train()
    out = {k: v.detach().clone() for k, v in model.mlp.state_dict().items()}
    out["rows"] = rows.clone()
    return out


def reference(opt_name: str, steps: int, workers: int) -> dict[str, torch.Tensor]:
    """Single process on the union of the workers' batches (the model worker 0 builds)."""
    torch.manual_seed(100)
    model = make_model(opt_name)
    opt = make_optimizer(opt_name, model.parameters())
    scheduler = make_scheduler(opt_name, opt)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    for step in range(steps):
        parts = [batch(step, r) for r in range(workers)]
        ids, dense, label = (torch.cat([p[i] for p in parts]) for i in range(3))
        opt.zero_grad()
        loss_fn(model(ids, dense), label).backward()
        feed_clicks(opt_name, model, label)
        opt.step()
        if scheduler is not None:
            scheduler.step()
    out = snapshot(model)
    out["num_rows"] = torch.tensor(model.emb.num_rows())
    return out


def train(rank: int, opt_name: str, steps: int, want_stats: bool = False) -> dict:
    """A worker's (or server's) body: the same script for both roles."""
    import fleet

    try:
        fleet.init()
    except SystemExit as stop:  # a server: fleet.init served, then exited the process
        return {"served": stop.code}
    torch.manual_seed(100 + fleet.worker_index())  # differs per worker: worker 0's values must win
    model = make_model(opt_name)
    opt = fleet.distributed_optimizer(make_optimizer(opt_name, model.parameters()))
    scheduler = make_scheduler(opt_name, opt)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    losses = []
    for step in range(steps):
        ids, dense, label = batch(step, fleet.worker_index())
        opt.zero_grad()
        loss = loss_fn(model(ids, dense), label)
        if "+prefetch" in opt_name:  # the next batch's rows, in the background (async)
            model.emb.prefetch(batch(step + 1, fleet.worker_index())[0])
        loss.backward()
        feed_clicks(opt_name, model, label)
        opt.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    fleet.barrier_worker()
    out = {"snapshot": {**snapshot(model), "num_rows": torch.tensor(model.emb.num_rows())}, "losses": losses}
    if want_stats:
        out["stats"] = opt.client.stats().result()
    fleet.stop_worker()
    return out


def run_job(
    fn,
    servers: int,
    workers: int,
    strategy: dict,
    *args,
    timeout: float = 90.0,
    extra_env: dict[str, str] | None = None,
    served: int = 0,
) -> list:
    """``servers`` + ``workers`` processes with fleetrun's environment (plus ``extra_env``); returns the workers'
    results, after checking that every server served and exited with ``served`` (1 when a worker failed)."""
    secret = secrets.token_hex(16)
    endpoints = ",".join(f"127.0.0.1:{free_port()}" for _ in range(servers))
    common = {
        "FLEET_SECRET": secret,
        "FLEET_SERVER_NUM": str(servers),
        "FLEET_SERVER_ENDPOINTS": endpoints,
        "FLEET_WORKER_NUM": str(workers),
        "FLEET_STRATEGY": json.dumps({"mode": "ps", "timeout_s": 30, **strategy}),
        **(extra_env or {}),
    }
    envs = [{**common, "FLEET_ROLE": "server", "FLEET_SERVER_INDEX": str(i)} for i in range(servers)]
    envs += [{**common, "FLEET_ROLE": "worker", "FLEET_WORKER_INDEX": str(r)} for r in range(workers)]
    outcome = run_processes(_shift, envs, fn, servers, *args, timeout=timeout)
    if any(status != "ok" for status, _ in outcome):
        names = [f"server {i}" for i in range(servers)] + [f"worker {r}" for r in range(workers)]
        raise AssertionError(describe(outcome, names))
    values = [torch.load(io.BytesIO(value), weights_only=False) for _, value in outcome]
    assert all(v == {"served": served} for v in values[:servers]), values[:servers]
    return values[servers:]


def _shift(rank: int, fn, servers: int, *args):
    return fn(rank - servers if rank >= servers else rank, *args)


def train_resumable(rank: int, opt_name: str, steps: int, save_at: int | None, load_from: str | None, ckpt: str):
    """Train steps [start, steps); save a checkpoint after ``save_at`` steps and stop there, or resume from one."""
    import fleet

    try:
        fleet.init()
    except SystemExit as stop:
        return {"served": stop.code}
    torch.manual_seed(100 + fleet.worker_index() + (50 if load_from else 0))  # a resumed run starts elsewhere
    model = Net()
    opt = fleet.distributed_optimizer(make_optimizer(opt_name, model.parameters()))
    start = 0
    if load_from:
        fleet.load_persistables(load_from)
        start = save_at or 0
    loss_fn = torch.nn.BCEWithLogitsLoss()
    for step in range(start, steps):
        if save_at is not None and not load_from and step == save_at:
            fleet.save_persistables(ckpt)
            break
        ids, dense, label = batch(step, fleet.worker_index())
        opt.zero_grad()
        loss_fn(model(ids, dense), label).backward()
        opt.step()
    fleet.barrier_worker()
    out = {"snapshot": {**snapshot(model), "num_rows": torch.tensor(model.emb.num_rows())}}
    fleet.stop_worker()
    return out


def one_step(opt_name: str, model: Net, opt, step: int, rank: int) -> None:
    ids, dense, label = batch(step, rank)
    opt.zero_grad()
    torch.nn.functional.binary_cross_entropy_with_logits(model(ids, dense), label).backward()
    feed_clicks(opt_name, model, label)
    opt.step()


def _rows_snapshot(model: Net) -> dict:
    return {"snapshot": {**snapshot(model), "num_rows": torch.tensor(model.emb.num_rows())}}


def train_collective(rank: int, opt_name: str, steps: int) -> dict:
    """The same script in collective mode: the local sparse tables must stay identical across workers."""
    import fleet

    fleet.init()
    torch.manual_seed(100)
    model = make_model(opt_name)
    opt = fleet.distributed_optimizer(make_optimizer(opt_name, model.parameters()))
    for step in range(steps):
        one_step(opt_name, model, opt, step, fleet.worker_index())
    out = _rows_snapshot(model)
    fleet.stop_worker()
    return out


def _ps_worker(opt_name: str):
    """fleet.init, then (model, wrapped optimizer) on a worker; None on a server (it served, then exited)."""
    import fleet

    try:
        fleet.init()
    except SystemExit:
        return None
    torch.manual_seed(100 + fleet.worker_index())
    model = make_model(opt_name)
    return model, fleet.distributed_optimizer(make_optimizer(opt_name, model.parameters()))


def train_with_saves(rank: int, opt_name: str, steps: int, saves: dict, load_from: str | None = None) -> dict:
    """Train, calling ``save_persistables(dirname, mode)`` after the steps named in ``saves``
    (``{step: [(dirname, mode), ...]}``); or only load ``load_from`` and report what the servers hold."""
    import fleet

    started = _ps_worker(opt_name)
    if started is None:
        return {"served": 0}
    model, opt = started
    if load_from:
        fleet.load_persistables(load_from)
        steps = 0
    for step in range(steps):
        one_step(opt_name, model, opt, step, fleet.worker_index())
        for dirname, mode in saves.get(step + 1, []):
            try:
                fleet.save_persistables(dirname, mode)
            except fleet.FleetError as exc:
                fleet.stop_worker()
                return {"error": str(exc)}
    fleet.barrier_worker()
    opt.refresh()  # the servers' values, also in geo mode
    out = _rows_snapshot(model)
    fleet.stop_worker()
    return out


def train_and_export(rank: int, opt_name: str, steps: int, dirname: str) -> dict:
    """Train, export for inference (every worker), and predict a held-out batch with the trained model."""
    import fleet

    started = _ps_worker(opt_name)
    if started is None:
        return {"served": 0}
    model, opt = started
    for step in range(steps):
        one_step(opt_name, model, opt, step, fleet.worker_index())
    fleet.export_for_inference(dirname, model)
    model.eval()
    with torch.no_grad():
        ids, dense, _ = batch(999, 0)
        predictions = model(ids, dense)
    fleet.stop_worker()
    return {"predictions": predictions}
