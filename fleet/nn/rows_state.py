"""A sparse table's rows in ``model.state_dict()``: what the entries hold and how they load back.

A ``fleet.nn.SparseEmbedding`` keeps its rows outside ``nn.Parameter``s (a table keyed by
arbitrary ids), so its ``state_dict`` adds plain tensors beside the zero-size
``<name>.placeholder``, every value a tensor as code that walks a state dict expects
(``{k: v.clone() ...}``, ``torch.save``, ``torch.load(weights_only=True)``):

- ``<name>.rows.ids`` (int64 ``[n]``, ascending) and ``<name>.rows.values`` (``[n, dim]``): row ``i`` is
  id ``ids[i]``'s;
- ``<name>.rows.steps``, ``<name>.rows.state.<name>`` (each row's update count and optimizer state),
  ``<name>.rows.stats.<name>`` (life-cycle statistics), ``<name>.rows.admission.counters`` (the
  admission sketch, one process and collective only);
- ``<name>.rows.meta``: a uint8 tensor of JSON (format, dim, the table's settings, clock).

:func:`table_rows` turns them back into one table's dict. The backend reads them where the
rows live (:meth:`fleet.sparse.backends.TableBackend.rows_state`): this process's table, or
the parameter servers in bounded pages. A table built with ``state_dict_rows=False`` writes
only a ``meta`` marker, and loading it fails naming the savers that keep its rows. A state
dict from before rows were saved (a ``placeholder`` and no ``rows.meta``) loads with a
warning and leaves the table as it is.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
from collections.abc import Iterator
from typing import Any

import torch

from fleet.errors import FleetError

FORMAT = "fleet-rows-1"
PREFIX = "rows."
META = PREFIX + "meta"

# None: each table's own setting; True: rows in (fleet.save_checkpoint); False: no entries (export, DCP)
_ROWS: contextvars.ContextVar[bool | None] = contextvars.ContextVar("fleet_rows_in_state_dict", default=None)


@contextlib.contextmanager
def rows_in_state_dict(include: bool) -> Iterator[None]:
    """Within: every table's ``state_dict`` holds its rows (``True``) or no entries of them (``False``)."""
    token = _ROWS.set(include)
    try:
        yield
    finally:
        _ROWS.reset(token)


def expected() -> bool:
    """Whether a load here expects a table's rows in the state dict (not inside ``rows_in_state_dict(False)``)."""
    return _ROWS.get() is not False


def _flatten(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A table's state (``ids``, ``rows``, per-row fields, settings) as state-dict entries, all tensors."""
    out: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {}
    for key, value in state.items():
        if key == "admission":
            meta["admission"] = {k: v for k, v in value.items() if not isinstance(v, torch.Tensor)}
            out.update({f"{PREFIX}admission.{k}": v for k, v in value.items() if isinstance(v, torch.Tensor)})
        elif isinstance(value, torch.Tensor):
            out[PREFIX + ("values" if key == "rows" else key)] = value
        else:
            meta[key] = value
    out[META] = torch.frombuffer(bytearray(json.dumps(meta, sort_keys=True).encode()), dtype=torch.uint8)
    return out


def table_rows(state_dict: dict[str, Any], name: str = "") -> dict[str, Any]:
    """The rows of table module ``name`` in a ``state_dict`` as one dict (``ids``, ``rows``, ``state.*``, ...)."""
    prefix = f"{name}.{PREFIX}" if name else PREFIX
    if prefix + "meta" not in state_dict:
        raise KeyError(f"the state dict holds no rows of a SparseEmbedding called {name!r} (no {prefix}meta)")
    meta = json.loads(bytes(state_dict[prefix + "meta"].to(torch.uint8).tolist()).decode())
    out: dict[str, Any] = dict(meta)
    admission = dict(meta.get("admission", {}))
    for key, value in state_dict.items():
        if not key.startswith(prefix) or key == prefix + "meta":
            continue
        field = key[len(prefix) :]
        if field.startswith("admission."):
            admission[field[len("admission.") :]] = value
        else:
            out["rows" if field == "values" else field] = value
    if "admission" in meta:
        out["admission"] = admission
    return out


def capture(module: Any) -> dict[str, torch.Tensor]:
    """The module's state-dict entries (without its prefix): its rows and per-row fields, or the marker."""
    include = _ROWS.get()
    if include is False:  # a saver that keeps the rows itself (export), or cannot take them (sharding's DCP)
        return {}
    if include is None and not module.state_dict_rows:
        return _flatten({"format": FORMAT, "dim": module.embedding_dim, "rows_left_out": True})
    state = module.backend().rows_state()
    # by id: replicas that hold the same rows in another order (created in another order) save alike
    ids = state["ids"]
    if not bool((ids[1:] > ids[:-1]).all()):  # a local table sorted itself already; the servers' pages are not
        order = torch.argsort(ids)
        state = {k: v.index_select(0, order) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    return _flatten({**state, "format": FORMAT, "dim": module.embedding_dim})


def restore(module: Any, state: dict[str, Any], name: str) -> None:
    """Put :func:`table_rows`' dict back into ``module`` (called ``name`` in the model)."""
    where = f"SparseEmbedding {name!r}" if name else "SparseEmbedding"
    if state.get("format") != FORMAT:
        raise ValueError(f"{where}: its state-dict entries are not ones a fleet SparseEmbedding wrote")
    if state.get("rows_left_out"):
        raise FleetError(
            f"{where} was saved without its rows (SparseEmbedding(..., state_dict_rows=False)), so this state dict "
            "would load no rows for it. Restore its table from what saved it instead: fleet.load_persistables "
            "after fleet.save_persistables (parameter server), or fleet.load_checkpoint after fleet.save_checkpoint "
            "(one process, collective), which keep the rows."
        )
    if int(state.get("dim", module.embedding_dim)) != module.embedding_dim:
        raise ValueError(f"{where}: the state dict's rows have dim {state['dim']}, the module's {module.embedding_dim}")
    for key in ("ids", "rows"):
        if not isinstance(state.get(key), torch.Tensor):
            raise ValueError(f"{where}: the state dict has no tensor {PREFIX}{'values' if key == 'rows' else key}")
    module.backend().load_rows_state(state, replace=True)
