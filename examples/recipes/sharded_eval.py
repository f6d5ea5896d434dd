"""Recipe: evaluation sharded over workers, with metrics of the whole evaluation set.

Every worker evaluating the whole set costs as much as one process doing it. Instead each
worker evaluates every N-th example (``Subset(dataset, range(i, len, N))``: shares differ by
at most one, and no example is counted twice) and accumulates ``fleet.metrics`` objects;
``compute()`` reduces them over the workers once, so every worker prints the loss and accuracy
of the whole set, equal to one process evaluating everything.

Not ``fleet.distributed_loader`` here: for training it gives every worker the same number of
examples, padding an uneven last share with examples from the start of the epoch (a few
examples seen twice), which is right for training and wrong for a metric.

    python examples/recipes/sharded_eval.py
    fleetrun --workers 2 examples/recipes/sharded_eval.py
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

import fleet

FEATURES, CLASSES = 12, 4


def evaluation_set(size: int, seed: int = 1) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, FEATURES, generator=generator)
    y = (x[:, :CLASSES] + 0.5 * torch.randn(size, CLASSES, generator=generator)).argmax(dim=1)
    return TensorDataset(x, y)


def build_model() -> nn.Module:
    torch.manual_seed(0)  # every worker builds the same model (or loads it: see save_once.py)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, CLASSES))


def my_share(dataset: TensorDataset) -> Subset:
    """Every N-th example from this worker's index: shares of sizes differing by at most one."""
    return Subset(dataset, range(fleet.worker_index(), len(dataset), fleet.worker_num()))


@torch.no_grad()
def evaluate(model: nn.Module, dataset: TensorDataset, batch_size: int = 16) -> dict[str, float]:
    """The loss and accuracy over the whole ``dataset``, each worker evaluating its share."""
    loss, accuracy = fleet.metrics.Mean(), fleet.metrics.Accuracy()
    model.eval()
    for x, y in DataLoader(my_share(dataset), batch_size=batch_size):
        logits = model(x)
        loss.update(nn.functional.cross_entropy(logits, y, reduction="none"))  # per example: shares may differ
        accuracy.update(logits, y)
    # compute() is a collective: every worker calls it, also one whose share was empty
    return {"loss": loss.compute(), "accuracy": accuracy.compute(), "examples": len(my_share(dataset))}


def main(size: int = 203) -> dict[str, float]:
    fleet.init()
    model = build_model()
    result = evaluate(model, evaluation_set(size))
    print(f"worker {fleet.worker_index()}: {result['examples']} examples here; whole set: "
          f"loss {result['loss']:.6f} accuracy {result['accuracy']:.4f}")  # fmt: skip
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=203, help="examples in the evaluation set")
    main(parser.parse_args().size)
