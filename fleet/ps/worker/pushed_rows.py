"""Rows on the servers when the user's optimizer also steps locally (``dense_placement="allreduce"``)."""

from __future__ import annotations

from typing import Any

from fleet.ps.modes.rows import RemoteRows


class PushedRows(RemoteRows):
    """Rows on the servers (sync, async) when the user's optimizer also steps locally (the dense layers)."""

    @classmethod
    def like(cls, rows: RemoteRows) -> PushedRows:
        return cls(rows.client, rows.table_id, sync=rows.sync, module=rows.module)

    def step(self, optimizer_class: type, group: dict[str, Any]) -> None:
        """Nothing: the wrapped step pushed these rows' gradients to the servers, which apply them."""
