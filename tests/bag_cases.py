"""Shared by the bag and feature-collection tests: multi-hot batches in fleet's ids, their union over
workers, and nn.EmbeddingBag references over the rows a fleet table starts from."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import fleet
from fleet.sparse.optim import InitializerSpec, initial_rows

DIM, VOCAB, BAGS, WIDTH, LR = 4, 30, 6, 4, 0.1
IDS = torch.arange(VOCAB) * 7919 - 100  # sparse, negative ids too
PAD = -7  # the padding id: any int64, not a position
SEED = 3


@dataclass
class Bags:
    """One batch of one feature, in fleet's ids: (input, offsets or None, per-sample weights or None)."""

    input: torch.Tensor
    offsets: torch.Tensor | None
    weights: torch.Tensor | None

    def dense(self) -> torch.Tensor:
        """The same input as positions in the reference table (the padding id is its last row, VOCAB)."""
        position = torch.searchsorted(IDS, self.input.clamp(IDS[0], IDS[-1]))
        return torch.where(self.input == PAD, VOCAB, position)


def make_bags(gen: torch.Generator, two_d: bool, weighted: bool, padding: bool, last: bool) -> Bags:
    if two_d:
        ids = IDS[torch.randint(0, VOCAB, (BAGS, WIDTH), generator=gen)]
        offsets = None
    else:
        lengths = torch.randint(0, 5, (BAGS,), generator=gen)
        lengths[1] = 0  # an empty bag
        lengths[-1] = 0  # and an empty last bag
        ids = IDS[torch.randint(0, VOCAB, (int(lengths.sum()),), generator=gen)]
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        offsets = offsets if last else offsets[:-1]
    if padding:
        ids = torch.where(torch.rand(ids.shape, generator=gen) < 0.3, PAD, ids)
        if two_d:
            ids[0] = PAD  # a bag of padding only
    weights = torch.randn(ids.shape, generator=gen) if weighted else None
    return Bags(ids, offsets, weights)


def union(parts: list[Bags], last: bool) -> Bags:
    """The workers' batches as one batch of all their bags, in worker order."""
    ids = torch.cat([p.input for p in parts])
    weights = torch.cat([p.weights for p in parts]) if parts[0].weights is not None else None
    if parts[0].offsets is None:
        return Bags(ids, None, weights)
    starts, shift = [], 0
    for p in parts:
        starts.append((p.offsets[:-1] if last else p.offsets) + shift)
        shift += p.input.numel()
    offsets = torch.cat(starts + ([torch.tensor([shift])] if last else []))
    return Bags(ids, offsets, weights)


def reference_bag(module: fleet.nn.SparseEmbeddingBag) -> nn.EmbeddingBag:
    """nn.EmbeddingBag over the rows ``module``'s table starts from (the padding id is its last row)."""
    weight = torch.cat([initial_rows(IDS, DIM, InitializerSpec(), SEED), torch.zeros(1, DIM)])
    padding = VOCAB if module.padding_idx is not None else None
    return nn.EmbeddingBag(
        VOCAB + 1, DIM, mode=module.mode, padding_idx=padding, include_last_offset=module.include_last_offset,
        _weight=weight,
    )  # fmt: skip


def rows_of(module: fleet.nn.SparseEmbeddingBag) -> torch.Tensor:
    """The table's rows of IDS, read through the module (one id per bag)."""
    module.eval()
    with torch.no_grad():
        rows = module(IDS, torch.arange(VOCAB + module.include_last_offset))
    module.train()
    return rows


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert torch.allclose(got, want, atol=1e-6, rtol=0), f"{what}: off by {(got - want).abs().max()}"


class Both:
    """Two torch optimizers stepped as one (a reference model's dense SGD beside its tables' Adagrad)."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad()

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()
