"""A trained model for serving: dense weights and the admitted rows of every sparse table, in one file.

``fleet.export_for_inference(dirname, model)`` (every worker calls it; worker 0 writes)
gathers what a serving process needs: the model's dense state (the servers' values in a
parameter-server job, whole tensors under ``mode="sharding"``) and, for every
``fleet.nn.SparseEmbedding``, the ids and rows its table holds now, without optimizer
state or statistics. ``fleet.load_for_inference(dirname, model)`` fills a freshly built
model with them in any process, no job and no server needed; the file is plain tensors
and JSON (``torch.load(path, weights_only=True)`` reads it), so a serving stack of its own
can read it too: a lookup of an id that has no row returns the table's initial value for
it, or zeros when the table admits ids by an ``entry`` (what training returned).
"""

from __future__ import annotations

import io
import json
from typing import Any

import torch

from fleet.nn import rows_state
from fleet.runtime import context
from fleet.sparse import backends as tables
from fleet.sparse.table import SparseTable
from fleet.storage.atomic import make_dirs, save_atomic
from fleet.storage.paths import store_for

FILE = "inference.pt"
FORMAT = "fleet-inference-1"


def _table_modules(model: torch.nn.Module) -> dict[str, Any]:
    found = {}
    for name, module in model.named_modules():
        placeholder = getattr(module, "placeholder", None)
        if isinstance(placeholder, torch.Tensor) and tables.module_of(placeholder) is module:
            found[name] = module
    return found


def _placeholder_keys(model: torch.nn.Module) -> set[str]:
    """A table's state-dict keys (its placeholder, its rows' entries): the file keeps the rows in "tables"."""
    with rows_state.rows_in_state_dict(False):
        keys = model.state_dict().keys()
    names = [f"{name}." if name else "" for name in _table_modules(model)]
    return {k for k in keys for n in names if k == n + "placeholder" or k.startswith(n + rows_state.PREFIX)}


def export_for_inference(dirname: str, model: torch.nn.Module) -> str:
    """Write ``<dirname>/inference.pt`` for serving; call on every worker (worker 0 writes). Returns the path.

    ``dirname`` may be a URL of any store (``s3://bucket/model``: :mod:`fleet.storage.store`).
    """
    store = store_for(dirname)  # a URL no store can write is refused on every worker, before any work
    strategy = context.strategy()
    with rows_state.rows_in_state_dict(False):  # the tables' rows are exported below, once
        dense = strategy.inference_state(model) if strategy is not None else model.state_dict()
    skip = _placeholder_keys(model)
    payload: dict[str, Any] = {
        "format": FORMAT,
        "dense": {k: v.detach().cpu().clone() for k, v in dense.items() if k not in skip},
        "tables": {},
    }
    for name, module in _table_modules(model).items():
        ids, rows = module.backend().export()
        config = {"dim": module.embedding_dim, "initializer": module.initializer.to_config(), "seed": module.seed}
        payload["tables"][name] = {
            "ids": ids,
            "rows": rows,
            "config": json.dumps(config, sort_keys=True),
            "missing": "zeros" if module.lifecycle.entry is not None else "initial",
        }
    job = context.current()
    path = store.join(dirname, FILE)
    if job is None or job.role.worker_index == 0:
        make_dirs(dirname)
        save_atomic(payload, path)
    if strategy is not None:
        strategy.barrier()  # the file is complete before any worker goes on
    return path


def load_for_inference(dirname: str, model: torch.nn.Module) -> torch.nn.Module:
    """Fill ``model`` (built as for training) from :func:`export_for_inference`'s file; returns it in eval mode."""
    store = store_for(dirname)
    path = store.join(dirname, FILE) if store.is_dir(dirname) else dirname
    entry = store.entry(path, follow_links=True)
    if entry is None or entry.kind != "file":
        raise FileNotFoundError(f"{path} does not exist: export the model with fleet.export_for_inference first")
    try:
        payload = torch.load(io.BytesIO(store.read(path, entry.size + 1)), weights_only=True)
    except Exception as error:  # noqa: BLE001 - whatever it is, the file is unusable: said with its name
        raise ValueError(f"{path} cannot be loaded ({type(error).__name__}: {error}): damaged?") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{path} is not a file written by fleet.export_for_inference")
    modules = _table_modules(model)
    if set(modules) != set(payload["tables"]):
        raise ValueError(
            f"{path} has sparse tables {sorted(payload['tables'])}, the model has {sorted(modules)}: "
            "build the model as it was trained"
        )
    skip = _placeholder_keys(model)
    with rows_state.rows_in_state_dict(False):
        wanted = {k for k in model.state_dict() if k not in skip}
    if wanted != set(payload["dense"]):
        missing, extra = sorted(wanted - set(payload["dense"])), sorted(set(payload["dense"]) - wanted)
        raise ValueError(f"{path} does not fit the model: missing {missing}, unexpected {extra}")
    model.load_state_dict(payload["dense"], strict=False)
    for name, module in modules.items():
        saved = payload["tables"][name]
        config = json.loads(saved["config"])
        if config["dim"] != module.embedding_dim:
            raise ValueError(f"{path}: table {name!r} has dim {config['dim']}, the model's has {module.embedding_dim}")
        module.local.adopt(_serving_table(module, saved))
    return model.eval()


def _serving_table(module: Any, saved: dict[str, Any]) -> SparseTable:
    """A local table holding the exported rows; missing ids read as in training (zeros or initial values)."""
    from fleet.sparse.lifecycle import CountFilterEntry, LifeCycle
    from fleet.sparse.optim import OptimizerSpec

    # An entry that admits nothing (lookups of missing ids read zeros); otherwise a plain table.
    lifecycle = LifeCycle(entry=CountFilterEntry(255, sketch_width=64)) if saved["missing"] == "zeros" else None
    table = SparseTable(
        module.embedding_dim, OptimizerSpec(kind="sgd", lr=0.0), module.initializer, module.seed, lifecycle
    )
    ids, rows = saved["ids"], saved["rows"]
    table.load_state_dict({"ids": ids, "rows": rows, "steps": torch.zeros(ids.numel(), dtype=torch.int64)})
    return table
