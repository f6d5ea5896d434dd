"""A sparse table's rows in ``model.state_dict()``: what the entry holds and how it loads back.

A ``fleet.nn.SparseEmbedding`` keeps its rows outside ``nn.Parameter``s (a table keyed by
arbitrary ids), so they travel as the module's *extra state* (``<name>._extra_state`` in the
state dict, beside the zero-size ``<name>.placeholder``): a dict of plain tensors and strings
that ``torch.save`` / ``torch.load(weights_only=True)`` and ``torch.distributed.checkpoint``
carry. It holds every row the table has (``ids``, ``rows``), each row's optimizer state
(``state.*``) and update count (``steps``), and its life-cycle statistics (``stats.*``); in one
process or collective mode also the table-wide clock and admission state. The backend reads
them where the rows live (:meth:`fleet.sparse.backends.TableBackend.rows_state`): this
process's table, or the parameter servers in bounded pages.

A table built with ``state_dict_rows=False`` writes a marker instead, and loading the marker
fails naming the savers that do keep its rows. A state dict from before rows were saved (a
``placeholder`` and no extra state) loads with a warning and leaves the table as it is.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch

from fleet.errors import FleetError

FORMAT = "fleet-rows-1"
KEY = "_extra_state"  # torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX

# None: each table's own setting; True: rows in (fleet.save_checkpoint); False: rows out (export keeps its own)
_ROWS: contextvars.ContextVar[bool | None] = contextvars.ContextVar("fleet_rows_in_state_dict", default=None)


@contextlib.contextmanager
def rows_in_state_dict(include: bool) -> Iterator[None]:
    """Within: every table's ``state_dict`` entry holds its rows (``True``) or only a marker (``False``)."""
    token = _ROWS.set(include)
    try:
        yield
    finally:
        _ROWS.reset(token)


def capture(module: Any) -> dict[str, Any]:
    """The module's state-dict entry: its rows and per-row fields, or the opt-out marker."""
    include = _ROWS.get()
    if include is None:
        include = bool(module.state_dict_rows)
    if not include:
        return {"format": FORMAT, "dim": module.embedding_dim, "rows_left_out": True}
    state = module.backend().rows_state()
    return {**state, "format": FORMAT, "dim": module.embedding_dim}


def restore(module: Any, state: Any, name: str) -> None:
    """Put a :func:`capture`'d entry back into ``module`` (called ``name`` in the model)."""
    where = f"SparseEmbedding {name!r}" if name else "SparseEmbedding"
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{where}: its state-dict entry is not one a fleet SparseEmbedding wrote")
    if state.get("rows_left_out"):
        raise FleetError(
            f"{where} was saved without its rows (SparseEmbedding(..., state_dict_rows=False)), so this state dict "
            "would load no rows for it. Restore its table from what saved it instead: fleet.load_persistables "
            "after fleet.save_persistables (parameter server), or fleet.load_checkpoint after fleet.save_checkpoint "
            "(one process, collective, sharding), which keep the rows."
        )
    if int(state.get("dim", module.embedding_dim)) != module.embedding_dim:
        raise ValueError(f"{where}: the state dict's rows have dim {state['dim']}, the module's {module.embedding_dim}")
    for key in ("ids", "rows"):
        if not isinstance(state.get(key), torch.Tensor):
            raise ValueError(f"{where}: its state-dict entry has no tensor {key!r}")
    module.backend().load_rows_state(state, replace=True)
