"""What both versions of the trainer share: the data and the model (unchanged by the conversion)."""

import torch
from torch.utils.data import TensorDataset


def dataset(samples: int = 384) -> TensorDataset:
    g = torch.Generator().manual_seed(42)
    x = torch.randn(samples, 16, generator=g)
    y = (x[:, :4].sum(1, keepdim=True)).tanh() + 0.1 * torch.randn(samples, 1, generator=g)
    return TensorDataset(x, y)


def model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 1))


def param_groups(net: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's usual two groups: weights decay, biases and norm parameters do not."""
    decay = [p for n, p in net.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in net.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
