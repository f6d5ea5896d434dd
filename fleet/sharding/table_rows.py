"""A sharding checkpoint's ``fleet.nn.SparseEmbedding`` tables: their rows beside FSDP2's shards.

``torch.distributed.checkpoint`` takes every state-dict key for a parameter or buffer, so the
tables' rows (:mod:`fleet.nn.rows_state`: ids, values, per-row optimizer state, life-cycle
statistics) cannot travel in it. Every worker holds the same replica of each table in
sharding mode, so worker 0 writes them once as a part of their own (:data:`ROWS`), loaded by
any number of workers.

The zero-size ``placeholder`` that names a table in the optimizer gets optimizer state only
from ``torch.distributed.checkpoint.state_dict``'s initialising step (zero gradients, lr 0),
which a fresh optimizer takes on load but a trained one never took when it saved: left in,
the load asks for entries the checkpoint lacks (``Missing key in checkpoint state_dict:
optimizer.state.emb.placeholder.momentum_buffer``). The rows' optimizer state is in
:data:`ROWS`; the placeholder's is left out of the save and, on load, kept as the fresh
optimizer made it (``set_state_dict`` wants state for every parameter; it is zero-size).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch

from fleet.errors import FleetError
from fleet.nn import rows_state
from fleet.sparse import backends as tables

if TYPE_CHECKING:
    from fleet.storage.layout import Save, SaveWriter

ROWS = "rows.pt"
"""The part of a sharding checkpoint that holds every table's rows (``<name>.rows.*``, as ``state_dict`` has them)."""


def table_modules(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """``(qualified name, module)`` of each table module in ``model`` (FSDP2 leaves their placeholders alone)."""
    found = []
    for name, module in model.named_modules():
        placeholder = getattr(module, "placeholder", None)
        if isinstance(placeholder, torch.Tensor) and tables.module_of(placeholder) is module:
            found.append((name, module))
    return found


def split_placeholders(optim_state: dict[str, Any], model: torch.nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """(``optim_state`` without the tables' placeholders' state, that state): ``get_state_dict``'s, keyed by name.

    The second holds an entry (maybe empty) for each placeholder in the optimizer, for ``set_state_dict``.
    """
    names = {f"{name}.placeholder" if name else "placeholder" for name, _ in table_modules(model)}
    if not names or "state" not in optim_state:
        return optim_state, {}
    state = {key: value for key, value in optim_state["state"].items() if key not in names}
    # every placeholder the optimizer holds, with or without state (set_state_dict wants an entry for each)
    held_names = {fqn for group in optim_state.get("param_groups", []) for fqn in group["params"] if fqn in names}
    held = {key: optim_state["state"].get(key, {}) for key in held_names}
    return {**optim_state, "state": state}, held


def save(save: SaveWriter, model: torch.nn.Module, worker_index: int) -> None:
    """Worker 0 writes every table's rows (their replicas are the same on every worker).

    Every worker reads them: reading puts a table's rows in id order, which breaks ties between
    equal eviction scores, so the replicas stay alike.
    """
    found = table_modules(model)
    if not found:
        return
    entries: dict[str, torch.Tensor] = {}
    with rows_state.rows_in_state_dict(True):  # a checkpoint keeps the rows of a table that opted out, too
        for name, module in found:
            prefix = f"{name}." if name else ""
            entries.update({prefix + key: value for key, value in rows_state.capture(module).items()})
    if worker_index == 0:
        save.write(ROWS, entries)


def load(save: Save, model: torch.nn.Module) -> None:
    """Put every table's rows back from :data:`ROWS` (each worker into its replica)."""
    found = table_modules(model)
    if not found:
        return
    if not save.has(ROWS):
        names = ", ".join(repr(name) for name, _ in found)
        warnings.warn(
            f"{save.path} holds no rows of the model's SparseEmbedding tables ({names}): it was saved before sharding "
            "checkpoints kept them; the tables keep the rows they have",
            stacklevel=3,
        )
        return
    entries = save.load(ROWS)
    saved = sorted(key[: -len(".rows.meta")] for key in entries if key.endswith(".rows.meta"))
    for name, module in found:
        if f"{name}.{rows_state.META}" not in entries:
            raise FleetError(
                f"{save.path} holds no rows of the model's SparseEmbedding {name!r}; its tables are {saved}: load it "
                "into the model that saved it"
            )
        rows_state.restore(module, rows_state.table_rows(entries, name), name)
