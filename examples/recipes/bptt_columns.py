"""Recipe: sequential (bptt) data split over workers, hidden state carried across batches.

pytorch/examples' word_language_model cuts one token stream into ``batch_size`` columns
(``batchify``) and walks down them ``bptt`` tokens at a time, carrying each column's LSTM
hidden state from one chunk to the next. A DataLoader (and so ``fleet.distributed_loader``)
would cut those columns apart, so instead each worker takes its share of the columns and
keeps its own hidden state for them: worker i of N walks columns ``[i*B/N, (i+1)*B/N)`` of
the same ``batch_size=B`` batchified stream. With the gradients averaged over the workers
(equal shares, mean loss) every step equals one process training on all B columns. The
validation loss is evaluated the same way, each worker its columns, summed over the workers
by ``fleet.metrics.Mean`` (per token, so shares may differ).

    python examples/recipes/bptt_columns.py                # one process, B columns
    fleetrun --workers 2 examples/recipes/bptt_columns.py  # two workers, B/2 columns each
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn

import fleet

VOCAB, EMBED, HIDDEN = 40, 16, 32


class LanguageModel(nn.Module):
    """A one-layer LSTM language model (word_language_model's RNNModel, small)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Embedding(VOCAB, EMBED)
        self.rnn = nn.LSTM(EMBED, HIDDEN)
        self.decoder = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]):
        output, hidden = self.rnn(self.encoder(tokens), hidden)
        return self.decoder(output), hidden

    def init_hidden(self, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(1, columns, HIDDEN), torch.zeros(1, columns, HIDDEN)


def token_stream(length: int, seed: int = 0) -> torch.Tensor:
    """A synthetic corpus with structure to learn: each token mostly follows from the previous one."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.empty(length, dtype=torch.long)
    tokens[0] = 0
    noise = torch.randint(0, VOCAB, (length,), generator=generator)
    keep = torch.rand(length, generator=generator) < 0.8
    for t in range(1, length):
        tokens[t] = (tokens[t - 1] * 7 + 3) % VOCAB if keep[t] else noise[t]
    return tokens


def batchify(data: torch.Tensor, columns: int) -> torch.Tensor:
    """word_language_model's batchify: the stream as ``columns`` columns, shape [length // columns, columns]."""
    rows = data.size(0) // columns
    return data[: rows * columns].view(columns, rows).t().contiguous()


def my_columns(batched: torch.Tensor, even: bool = True) -> torch.Tensor:
    """This worker's contiguous share of the columns.

    For training every worker needs the same number of columns (``even``), so that the averaged
    mean losses weigh every column alike; evaluation sums per-token losses and takes any split.
    """
    total, workers, index = batched.size(1), fleet.worker_num(), fleet.worker_index()
    if even and total % workers:
        raise ValueError(
            f"{total} columns do not split evenly over {workers} workers; make --batch-size a multiple of the "
            "number of workers, so that every worker's mean loss weighs the same as one process's."
        )
    return batched[:, index * total // workers : (index + 1) * total // workers]


def get_batch(source: torch.Tensor, i: int, bptt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows i .. i+bptt of the columns, and the tokens that follow them (word_language_model's get_batch)."""
    length = min(bptt, len(source) - 1 - i)
    return source[i : i + length], source[i + 1 : i + 1 + length].reshape(-1)


@torch.no_grad()
def evaluate(model: LanguageModel, data: torch.Tensor, bptt: int) -> float:
    """The mean loss per token over every column of ``data``, each worker evaluating its share of them."""
    mine = my_columns(data, even=False)  # shares may differ: the metric counts tokens, not workers
    loss = fleet.metrics.Mean()
    model.eval()
    hidden = model.init_hidden(mine.size(1))
    for i in range(0, mine.size(0) - 1, bptt):
        tokens, targets = get_batch(mine, i, bptt)
        output, hidden = model(tokens, hidden)
        loss.update(nn.functional.cross_entropy(output.view(-1, VOCAB), targets, reduction="none"))
    model.train()
    return loss.compute()  # a collective: every worker calls it, one with no columns too


def train(batch_size: int = 8, bptt: int = 10, epochs: int = 2, lr: float = 0.5) -> dict[str, object]:
    """Train on this worker's columns; the per-step losses and validation losses of the whole job, the weights."""
    torch.manual_seed(0)
    model = LanguageModel()
    fleet.init()
    optimizer = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=lr))
    data = my_columns(batchify(token_stream(2000), batch_size))
    validation = batchify(token_stream(500, seed=1), 5)  # 5 columns: 3 and 2 over two workers
    criterion = nn.CrossEntropyLoss()
    losses, validation_losses = [], []
    for epoch in range(epochs):
        hidden = model.init_hidden(data.size(1))  # this worker's columns only
        for i in range(0, data.size(0) - 1, bptt):
            tokens, targets = get_batch(data, i, bptt)
            hidden = tuple(h.detach() for h in hidden)  # carried across batches, not back-propagated through
            optimizer.zero_grad()
            output, hidden = model(tokens, hidden)
            loss = criterion(output.view(-1, VOCAB), targets)
            loss.backward()
            optimizer.step()
            losses.append(float(fleet.metrics.sum(loss.detach())) / fleet.worker_num())  # the job's mean loss
        validation_losses.append(evaluate(model, validation, bptt))
        if fleet.is_first_worker():
            print(f"epoch {epoch} loss {losses[-1]:.4f} validation loss {validation_losses[-1]:.4f}")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "validation": validation_losses, "state": state}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8, help="columns of the whole job (split over workers)")
    parser.add_argument("--bptt", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--report", help="worker 0 writes the job's losses here (JSON)")
    args = parser.parse_args()
    result = train(args.batch_size, args.bptt, args.epochs)
    if args.report and fleet.is_first_worker():
        with open(args.report, "w") as handle:
            report = {"workers": fleet.worker_num(), "source": fleet.role_info().source}
            json.dump({**report, "losses": result["losses"], "validation": result["validation"]}, handle)
