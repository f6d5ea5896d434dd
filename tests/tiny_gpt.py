"""A GPT-shaped model for the sharding tests: a token embedding, blocks of attention + MLP in an nn.ModuleList
(the layout GPT, Llama and ViT code uses), a head."""

from __future__ import annotations

import torch
from torch import nn

DIM, HEADS, VOCAB = 16, 2, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)  # torch's _reset_parameters only
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)


class TinyGPT(nn.Module):
    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)
