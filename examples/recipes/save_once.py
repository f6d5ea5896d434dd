"""Recipe: save once per job, load everywhere.

Every worker calling ``torch.save(model, path)`` on the same path is a race: several
processes write one file at once, and a worker that reads it meanwhile may see half of it.
``fleet.save(obj, path)``, called on every worker, has worker 0 write it (under a temporary
name, renamed into place) and returns on every worker once the file is there, so each can
``torch.load`` it right away.

    python examples/recipes/save_once.py --out /tmp/model.pt
    fleetrun --workers 2 examples/recipes/save_once.py --out /tmp/model.pt
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fleet


def train_briefly() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    fleet.init()
    optimizer = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    loader = fleet.distributed_loader(DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8))
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return model


def main(out: str) -> dict[str, torch.Tensor]:
    model = train_briefly()
    fleet.save({"model": model.state_dict()}, out)  # every worker calls it; worker 0 writes
    loaded = torch.load(out, weights_only=True)["model"]  # there on every worker once fleet.save returned
    model.load_state_dict(loaded)
    print(f"worker {fleet.worker_index()}: loaded {len(loaded)} tensors from {out}")
    return loaded


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="file to save the trained model's state_dict to")
    main(parser.parse_args().out)
