"""A dense table over the servers: one flat float32 vector cut into contiguous ranges, one per server.

The client (:class:`~fleet.ps.client.client.PSClient`) cuts each dense call into one piece per server
with :class:`DenseLayout` and puts the servers' replies back together in the caller's order with it;
nothing here sends anything.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fleet.data.files import share_bounds
from fleet.ps.protocol.wire import Message


def shard_ranges(size: int, num_servers: int) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) pieces of a length-``size`` vector, sizes differing by at most one."""
    if num_servers < 1:
        raise ValueError(f"num_servers={num_servers}; need at least one server")
    return share_bounds(size, num_servers)


@dataclass(frozen=True)
class DenseState:
    """A dense table read whole: flat values and optimizer state, and each parameter's step count."""

    values: torch.Tensor
    named: dict[str, torch.Tensor]
    param_steps: torch.Tensor
    step: int


def json_replies(replies: Sequence[Message]) -> list[dict[str, Any]]:
    """Each reply's blob read as JSON (configs, stats, the metadata of a read)."""
    return [json.loads(bytes(r.blob).decode("utf-8")) for r in replies]


@dataclass(frozen=True)
class DenseLayout:
    """Dense table ``table_id`` of ``size`` values, server ``s`` holding ``ranges[s]``."""

    table_id: int
    size: int
    ranges: list[tuple[int, int]]

    @classmethod
    def of(cls, table_id: int, size: int, num_servers: int) -> DenseLayout:
        return cls(table_id, size, shard_ranges(size, num_servers))

    def flat(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """``t`` as the table's flat float32 vector; ``what`` names it when its size is wrong."""
        flat = t.detach().reshape(-1)
        if flat.numel() != self.size:
            raise ValueError(f"dense table {self.table_id} holds {self.size} values, {what} {flat.numel()}")
        return flat.to(torch.float32).contiguous()

    def pieces(self, flat: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """(server, its range of ``flat``) for every server."""
        return [(s, flat[lo:hi]) for s, (lo, hi) in enumerate(self.ranges)]

    def shard_configs(self, config: dict[str, Any]) -> list[bytes]:
        """Each server's create config: ``config`` with its range (``size``, ``offset``) and the whole size."""
        return [
            json.dumps({**config, "size": hi - lo, "offset": lo, "total_size": self.size}, sort_keys=True).encode()
            for lo, hi in self.ranges
        ]

    def join(self, replies: Sequence[Message]) -> torch.Tensor:
        """The values from every server's reply (its first tensor), in order."""
        if len(replies) == 1:
            return replies[0].tensors[0]
        out = torch.empty(self.size, dtype=torch.float32)
        for (lo, hi), reply in zip(self.ranges, replies, strict=True):
            out[lo:hi].copy_(reply.tensors[0])
        return out

    def read_state(self, replies: Sequence[Message]) -> DenseState:
        """A DENSE_STATE_GET's replies put together: values, optimizer state, each parameter's largest step."""
        metas = json_replies(replies)
        names = metas[0]["names"]
        values = torch.empty(self.size, dtype=torch.float32)
        named = {name: torch.empty(self.size, dtype=torch.float32) for name in names}
        steps = replies[0].tensors[1].clone()
        for (lo, hi), reply in zip(self.ranges, replies, strict=True):
            values[lo:hi].copy_(reply.tensors[0])
            for name, t in zip(names, reply.tensors[2:], strict=True):
                named[name][lo:hi].copy_(t)
            torch.maximum(steps, reply.tensors[1], out=steps)
        return DenseState(values, named, steps, max(int(m["step"]) for m in metas))
