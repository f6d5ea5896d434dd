"""A job that takes a SparseEmbedding's rows through ``state_dict`` and ``load_rows``, in any mode.

The same scenario runs in one process on the union of the workers' batches (:func:`reference`)
and on each worker of a collective or parameter-server job (:func:`worker`): rows given before
training, steps 0-2, the table's state dict taken, steps 3-4, the state dict loaded back, steps
5-6; then rows given to the running table.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from fleet.nn.rows_state import table_rows
from ps_jobs import all_ids, batch, make_model, make_optimizer

OPT = "plain+adagrad_rows"  # dense: plain SGD; rows: Adagrad, whose per-row state must round-trip
GIVEN_IDS = all_ids()[:10]
LATE_IDS = torch.tensor([5, -7, 2**33])


def given(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))


def _sorted(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The per-row tensors of a table's state-dict entry, by ascending id."""
    order = torch.argsort(state["ids"])
    keys = [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == order.numel()]
    return {k: state[k][order] for k in keys if k == "ids" or k == "rows" or k.startswith("state.")}


def _through_torch_save(state: dict[str, Any]) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _step(model, opt, step: int, ranks: list[int]) -> None:
    parts = [batch(step, r) for r in ranks]
    ids, dense, label = (torch.cat([p[i] for p in parts]) for i in range(3))
    opt.zero_grad()
    torch.nn.functional.binary_cross_entropy_with_logits(model(ids, dense), label).backward()
    opt.step()


def _scenario(model, wrap, ranks: list[int], barrier) -> dict[str, Any]:
    model.emb.load_rows(GIVEN_IDS, given(10, 1))  # before the optimizer: goes with the table
    opt = wrap(make_optimizer(OPT, model.parameters()))
    model.eval()
    with torch.no_grad():
        first = model.emb(GIVEN_IDS).clone()
    model.train()
    for step in range(3):
        _step(model, opt, step, ranks)
    barrier()  # every step applied before the rows are read
    saved = _through_torch_save(model.emb.state_dict())
    barrier()
    elsewhere = make_model(OPT).emb  # held by no optimizer: a table in this process, whatever the mode
    elsewhere.load_state_dict(saved)
    for step in range(3, 5):
        _step(model, opt, step, ranks)
    barrier()
    model.emb.load_state_dict(saved)
    barrier()  # loaded everywhere before anyone pulls again
    for step in range(5, 7):
        _step(model, opt, step, ranks)
    barrier()
    out = {
        "first": first,
        "saved": _sorted(table_rows(saved)),
        "after": _sorted(table_rows(model.emb.state_dict())),
    }
    out["weight"] = model.emb.dense_weight(3)
    out["elsewhere"] = _sorted(table_rows(elsewhere.state_dict()))
    barrier()  # every worker has read its state dict (in pieces, on a PS) before anyone adds LATE_IDS' rows
    model.emb.load_rows(LATE_IDS, given(3, 2))
    barrier()
    model.eval()
    with torch.no_grad():
        out["late"] = model.emb(LATE_IDS).clone()
    out["rows"] = model.emb(all_ids()).detach().clone()
    out["mlp"] = {k: v.detach().clone() for k, v in model.mlp.state_dict().items()}
    return out


def reference(workers: int) -> dict[str, Any]:
    torch.manual_seed(100)
    return _scenario(make_model(OPT), lambda opt: opt, list(range(workers)), lambda: None)


def worker(rank: int) -> dict[str, Any]:
    import fleet

    try:
        fleet.init()
    except SystemExit as stop:  # a parameter server: served, then exited
        return {"served": stop.code}
    torch.manual_seed(100)
    out = _scenario(make_model(OPT), fleet.distributed_optimizer, [fleet.worker_index()], fleet.barrier_worker)
    fleet.stop_worker()
    return out


def reload_worker(rank: int) -> dict[str, Any]:
    """Any update mode: the state dict taken at a barrier, loaded back later, is what the servers then hold
    and what this worker's lookups return (geo: its cached rows are fetched again)."""
    import fleet

    try:
        fleet.init()
    except SystemExit as stop:
        return {"served": stop.code}
    torch.manual_seed(100)
    model = make_model(OPT)
    opt = fleet.distributed_optimizer(make_optimizer(OPT, model.parameters()))
    for step in range(3):
        _step(model, opt, step, [fleet.worker_index()])
    fleet.barrier_worker()
    saved = _through_torch_save(model.emb.state_dict())
    fleet.barrier_worker()  # async: nobody steps on while another worker still reads the rows
    for step in range(3, 6):
        _step(model, opt, step, [fleet.worker_index()])
    fleet.barrier_worker()
    model.emb.load_state_dict(saved)
    fleet.barrier_worker()
    model.eval()
    with torch.no_grad():
        looked_up = model.emb(table_rows(saved)["ids"]).clone()
    out = {"saved": _sorted(table_rows(saved)), "after": _sorted(table_rows(model.emb.state_dict()))}
    out["looked_up"], out["want"] = looked_up, table_rows(saved)["rows"]
    second = make_model(OPT)
    second.emb.load_state_dict(saved)  # before its optimizer: worker 0 sends the rows when the table is created
    fleet.distributed_optimizer(make_optimizer(OPT, second.parameters()))
    out["second"] = _sorted(table_rows(second.emb.state_dict()))
    fleet.stop_worker()
    return out
