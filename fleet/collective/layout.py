"""What a gradient round works on: the registered parameters that train now, bucketed.

:class:`Layout` is immutable and rebuilt by :class:`~fleet.collective.grad_sync.GradSync`
when the set of trainable parameters changes; its fingerprint travels in each round's
lockstep header, so workers whose layouts differ fail before any bucket is sent.
:class:`ParamMap` keys values by parameter without keeping parameters alive.
"""

from __future__ import annotations

import hashlib
import weakref
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge

from fleet.collective import buckets as bucketing


class ParamMap:
    """``param -> value`` that neither keeps parameters alive nor confuses a new one with a freed one."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, Any]] = {}

    def get(self, param: torch.Tensor, default: Any = None) -> Any:
        entry = self._entries.get(id(param))
        return entry[1] if entry is not None and entry[0]() is param else default

    def __contains__(self, param: torch.Tensor) -> bool:
        entry = self._entries.get(id(param))
        return entry is not None and entry[0]() is param

    def set(self, param: torch.Tensor, value: Any) -> None:
        self._entries[id(param)] = (weakref.ref(param), value)

    def get_all(self, params: list[torch.Tensor], default: Any = None) -> list[Any]:
        """``[get(p, default) for p in params]``, in one call (a round asks for every parameter's)."""
        entries = self._entries
        out = []
        for param in params:
            entry = entries.get(id(param))
            out.append(entry[1] if entry is not None and entry[0]() is param else default)
        return out

    def values(self) -> list[Any]:
        return [value for ref, value in self._entries.values() if ref() is not None]


class Layout:
    """The registered parameters that train now, bucketed; immutable, rebuilt when they change."""

    def __init__(
        self,
        registered: list[torch.Tensor],
        signature: tuple,
        sparse: set[int],
        bucket_bytes: int,
    ):
        self.signature = signature
        self.registered = len(registered)
        trainable = [p for p in registered if p.requires_grad]
        self.ids = {id(p) for p in trainable}
        self.dense = [p for p in trainable if id(p) not in sparse]
        self.sparse = [p for p in trainable if id(p) in sparse]
        self.buckets = bucketing.build(self.dense, bucket_bytes)
        self.where = {id(p): b for b in self.buckets for p in b.params}
        # Per dense parameter, what a round's start asks the autograd engine about, and where it counts.
        self.accumulators = [(id(p), get_gradient_edge(p).node, self.where[id(p)].index) for p in self.dense]
        position = {id(p): i for i, p in enumerate(registered)}
        text = repr(
            [self.registered, bucket_bytes]
            + [(position[id(p)], tuple(p.shape), str(p.dtype), id(p) in sparse) for p in trainable]
        )
        # 62 bits: a fingerprint that fits an int64 header field with room to spare.
        self.fingerprint = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2
