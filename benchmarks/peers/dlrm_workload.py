"""W6's workload (benchmarks/README.md): the tables, the synthetic batches and the DLRM dense part.

Torch only (no fleet, no torchrec): ``benchmarks/w6_dlrm.py`` (fleet, plain PyTorch in one process)
and ``benchmarks/peers/w6_torchrec.py`` (TorchRec, DDP) import it, so every system trains the same
model on the same tensors.

- Tables: :data:`SIZES` (``full``: 8 tables, 10 k to 10 M rows, dims 16 to 64; ``tiny`` for tests).
- A batch of worker ``w`` at step ``s`` is a pure function of ``(w, s)`` (:func:`make_batch`): 13
  dense features and, per table, a multi-hot bag per sample: ``1 + Poisson(9)`` ids (capped at 32, mean
  about 10) drawn from a Zipf distribution (exponent 1.05) over the table's rows, its ranks scattered
  over the rows by a fixed bijection. The label needs the embeddings: each id has a hidden weight
  (a hash of the table and the id), and the label is 1 when the sum over tables of each bag's mean
  hidden weight plus ``0.15 * dense @ w_true`` is above 0.
- :func:`union`: the batches of several workers at one step as one batch (what one process trains
  on to be compared with a synchronous job).
- :class:`DLRMDense`: DLRM's dense part: bottom MLP 13-64-16, one bias-free ``Linear(dim_t, 16)`` per
  table projecting its pooled embedding to the interaction's dimension (the tables' dims differ,
  DLRM's dot interaction needs one), the pairwise dots of [bottom output, 8 projections] (36), top
  MLP (16 + 36)-128-64-1; BCE with logits on its output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

DENSE = 13
LR = 0.5  # SGD, for the rows and the dense part (at 0.1 the loss barely moves in 100 steps)
INTERACTION_DIM = 16
MEAN_POOLING = 10  # 1 + Poisson(MEAN_POOLING - 1), capped at MAX_POOLING
MAX_POOLING = 32
ZIPF_EXPONENT = 1.05
_SCATTER = 2654435761  # a prime: rank -> row is a bijection for every table size it does not divide


@dataclass(frozen=True)
class Spec:
    """The tables (rows, dim), one worker's batch size and the initial rows ('uniform' +-0.01 or 'zeros')."""

    tables: tuple[tuple[int, int], ...]
    batch: int = 256
    init: str = "uniform"

    @property
    def names(self) -> list[str]:
        return [f"t{i}" for i in range(len(self.tables))]


SIZES: dict[str, tuple[tuple[int, int], ...]] = {
    # 8 tables, 13.7 M rows, 1.0 GB of float32: what TorchRec (allocating whole tables) and the
    # DDP peer (a replica per rank) hold beside fleet's servers on a 23 GB machine.
    "full": (
        (10_000_000, 16),
        (2_000_000, 16),
        (1_000_000, 32),
        (500_000, 32),
        (100_000, 64),
        (50_000, 64),
        (20_000, 64),
        (10_000, 16),
    ),
    "small": (
        (1_000_000, 16),
        (200_000, 16),
        (100_000, 32),
        (50_000, 32),
        (10_000, 64),
        (5_000, 64),
        (2_000, 64),
        (1_000, 16),
    ),  # fmt: skip
    "tiny": ((1_000, 16), (500, 16), (300, 32), (100, 64)),
}


def spec(size: str, batch: int = 256, init: str = "uniform") -> Spec:
    if size not in SIZES:
        raise SystemExit(f"unknown table sizes {size!r}: one of {', '.join(SIZES)}")
    if init not in ("uniform", "zeros"):
        raise SystemExit(f"--init must be 'uniform' or 'zeros', got {init!r}")
    return Spec(SIZES[size], batch, init)


def _zipf_rows(u: torch.Tensor, rows: int, table: int) -> torch.Tensor:
    """Row ids for uniforms ``u`` (float64): Zipf ranks by the inverse CDF of the continuous power law."""
    a = 1.0 - ZIPF_EXPONENT
    ranks = ((((rows + 1.0) ** a - 1.0) * u + 1.0) ** (1.0 / a)).floor().to(torch.int64) - 1
    ranks = ranks.clamp_(0, rows - 1)
    return (ranks * _SCATTER + table * 7919) % rows  # popular rows spread over the table


def hidden_weight(ids: torch.Tensor, table: int) -> torch.Tensor:
    """Each (table, id)'s hidden weight in [-1, 1): what the label depends on."""
    return ((ids * 40503 + table * 2_147_483_647) % 4099).to(torch.float32) / 2049.5 - 1.0


def make_batch(
    spec: Spec, worker: int, step: int
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """(dense [B, 13], per table (ids, offsets), label [B]) of ``worker`` at ``step``: a pure function of both."""
    b = spec.batch
    g = torch.Generator().manual_seed(1_000_003 * (step + 1) + 7_919 * worker)
    w_true = torch.randn(DENSE, generator=torch.Generator().manual_seed(0))
    dense = torch.randn(b, DENSE, generator=g)
    score = 0.15 * (dense @ w_true)
    feats = []
    for t, (rows, _dim) in enumerate(spec.tables):
        lengths = 1 + torch.poisson(torch.full((b,), MEAN_POOLING - 1.0), generator=g).to(torch.int64)
        lengths.clamp_(max=MAX_POOLING)
        ids = _zipf_rows(torch.rand(int(lengths.sum()), generator=g, dtype=torch.float64), rows, t)
        offsets = torch.cumsum(lengths, 0) - lengths
        bag_of = torch.repeat_interleave(torch.arange(b), lengths)
        score += torch.zeros(b).index_add_(0, bag_of, hidden_weight(ids, t)) / lengths
        feats.append((ids, offsets))
    return dense, feats, (score > 0).float()


def union(batches: list[tuple]) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Several workers' batches of one step as one batch (offsets shifted), in worker order."""
    dense = torch.cat([b[0] for b in batches])
    label = torch.cat([b[2] for b in batches])
    feats = []
    for t in range(len(batches[0][1])):
        ids, offsets, base = [], [], 0
        for b in batches:
            ids.append(b[1][t][0])
            offsets.append(b[1][t][1] + base)
            base += b[1][t][0].numel()
        feats.append((torch.cat(ids), torch.cat(offsets)))
    return dense, feats, label


class DLRMDense(nn.Module):
    """DLRM's dense part: bottom MLP, per-table projections, pairwise dots, top MLP -> one logit."""

    def __init__(self, dims: list[int]) -> None:
        super().__init__()
        d = INTERACTION_DIM
        self.bottom = nn.Sequential(nn.Linear(DENSE, 64), nn.ReLU(), nn.Linear(64, d), nn.ReLU())
        self.project = nn.ModuleList(nn.Linear(dim, d, bias=False) for dim in dims)
        features = len(dims) + 1
        self.register_buffer("_pairs", torch.tril_indices(features, features, offset=-1), persistent=False)
        width = d + features * (features - 1) // 2
        self.top = nn.Sequential(nn.Linear(width, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, dense: torch.Tensor, pooled: list[torch.Tensor]) -> torch.Tensor:
        x = self.bottom(dense)
        z = torch.stack([x, *(p(e) for p, e in zip(self.project, pooled, strict=True))], 1)  # [B, F, d]
        dots = torch.bmm(z, z.transpose(1, 2))[:, self._pairs[0], self._pairs[1]]
        return self.top(torch.cat([x, dots], 1)).squeeze(1)


def dense_part(spec: Spec) -> DLRMDense:
    """The dense part, initialized from seed 0 (the same parameters in every system)."""
    torch.manual_seed(0)
    return DLRMDense([dim for _, dim in spec.tables])


def init_table_(weight: torch.Tensor, spec: Spec) -> torch.Tensor:
    """A dense table's initial rows: uniform +-0.01 (fleet's default range, other values) or zeros."""
    with torch.no_grad():
        return weight.zero_() if spec.init == "zeros" else weight.uniform_(-0.01, 0.01)


class TorchDLRM(nn.Module):
    """The whole model in plain PyTorch: one ``nn.EmbeddingBag`` per table (sum, sparse gradients) + the dense part."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.dense = dense_part(spec)
        self.tables = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum", sparse=True) for rows, dim in spec.tables)
        for table in self.tables:
            init_table_(table.weight, spec)

    def forward(self, dense: torch.Tensor, feats: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        pooled = [t(ids, offsets) for t, (ids, offsets) in zip(self.tables, feats, strict=True)]
        return self.dense(dense, pooled)
