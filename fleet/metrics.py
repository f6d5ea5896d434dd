"""Global evaluation metrics: values over the data of every worker of the job (Paddle's ``fleet.metrics``).

    auc = fleet.metrics.AUC()
    for x, y in loader:                          # each worker its own shard
        auc.update(torch.sigmoid(model(x)), y)   # local, float64, no communication
    print(auc.compute())                         # every worker: the AUC of the union of the shards

Each metric keeps a small vector of float64 statistics that add up (or take the maximum)
over workers: sums, counts, histograms. ``update`` only adds to it; ``compute`` makes one
reduction of that vector over the workers and derives the value from the result, so every
worker gets the same Python float. Paddle's functional forms (:func:`sum`, :func:`max`,
:func:`min`, :func:`auc`, :func:`mae`, :func:`rmse`, :func:`mse`, :func:`acc`) reduce the
statistics a script accumulated itself.

Why AUC goes through a histogram: the exact AUC of the union is not a function of the
workers' AUCs (nor of any fixed-size summary of them): it ranks every positive against every
negative, across workers, which needs all predictions in one place. What does add up over
workers is a histogram: each worker counts its positives and negatives per bucket of
predictions (``int(p * num_thresholds)``, Paddle's ``stat_pos``/``stat_neg``); the summed
histograms are exactly those of the union, and the AUC read from them (a pair in one bucket
counts half) differs from the exact one by at most half the share of positive-negative pairs
that fall into the same bucket: about 1e-4 with the default 4096 buckets on spread-out
predictions (measured in ``tests/test_metrics.py``); raise ``num_thresholds`` when
predictions crowd into a narrow range.

Communication goes through the job's strategy (``Strategy.all_reduce``): nothing without
``fleet.init`` or with one worker, the workers' process group in collective and sharding jobs
(announced like every collective in collective mode, so a worker that is doing something else
makes every worker fail naming both), server 0 in parameter-server jobs. ``compute`` is
therefore a collective: every worker calls it, for the same metrics, in the same order. After
``fleet.stop_worker()`` it is local again.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fleet.runtime import context

__all__ = ["AUC", "Accuracy", "MAE", "Max", "Mean", "Metric", "Min", "RMSE", "Sum"]
__all__ += ["acc", "auc", "mae", "max", "min", "mse", "rmse", "sum"]

DEFAULT_NUM_THRESHOLDS = 4095
"""Paddle's default: predictions fall into 4096 buckets (``int(p * 4095)``)."""


def _all_reduce(values: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """A 1-D float64 CPU vector reduced over every worker of the job (itself outside a job)."""
    strategy = context.strategy()
    return values if strategy is None else strategy.all_reduce(values, op)


def _tensor(x: Any) -> torch.Tensor:
    """A tensor (detached), numpy array, list or number as a tensor, without copying where possible."""
    return x.detach() if isinstance(x, torch.Tensor) else torch.as_tensor(x)


def _pairs(preds: Any, labels: Any, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    p, y = _tensor(preds).reshape(-1), _tensor(labels).reshape(-1)
    if p.numel() != y.numel():
        raise ValueError(
            f"{what}.update: {p.numel()} predictions for {y.numel()} labels (shapes {list(_tensor(preds).shape)} "
            f"and {list(_tensor(labels).shape)}); give one prediction per label."
        )
    return p.to(torch.float64), y.to(device=p.device, dtype=torch.float64)


class Metric:
    """A global metric: ``update`` locally as often as needed, ``compute`` on every worker, ``reset`` to start over."""

    _size = 1
    _reduce_op = "sum"

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget what was accumulated (on this worker)."""
        self._stats = self._initial()

    def _initial(self) -> torch.Tensor:
        return torch.zeros(self._size, dtype=torch.float64)

    def _add(self, values: torch.Tensor) -> None:
        """Add float64 ``values`` (this metric's statistics) on their device; the state follows them there."""
        self._stats = self._stats.to(values.device) + values

    def compute(self) -> float:
        """The value over every worker's data (a collective: every worker calls it)."""
        return self._value(_all_reduce(self._stats.detach().to("cpu", copy=True), self._reduce_op))

    def _value(self, stats: torch.Tensor) -> float:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Sum(Metric):
    """The sum of every value given to ``update`` (tensors are summed element-wise into one number)."""

    def update(self, values: Any) -> None:
        self._add(_tensor(values).to(torch.float64).sum().reshape(1))

    def _value(self, stats: torch.Tensor) -> float:
        return float(stats[0])


class Mean(Sum):
    """The mean of every value given to ``update`` over all workers (each element counts once); NaN if none."""

    _size = 2

    def update(self, values: Any) -> None:
        t = _tensor(values).to(torch.float64)
        self._add(torch.stack([t.sum(), torch.tensor(float(t.numel()), dtype=torch.float64, device=t.device)]))

    def _value(self, stats: torch.Tensor) -> float:
        return float(stats[0] / stats[1]) if stats[1] else math.nan


class Max(Metric):
    """The largest value given to ``update`` on any worker; NaN if no worker saw a value."""

    _size = 2  # the extreme, and whether any value was seen (1) or not (0)
    _reduce_op = "max"
    _sign = 1.0

    def _initial(self) -> torch.Tensor:
        return torch.tensor([-math.inf * self._sign, 0.0], dtype=torch.float64)

    def update(self, values: Any) -> None:
        t = _tensor(values).to(torch.float64).reshape(-1)
        if t.numel() == 0:
            return
        extreme = t.max() if self._sign > 0 else t.min()
        stats = self._stats.to(t.device)
        pick = torch.maximum if self._sign > 0 else torch.minimum
        self._stats = torch.stack([pick(stats[0], extreme), stats[0].new_tensor(self._sign)])

    def _value(self, stats: torch.Tensor) -> float:
        return float(stats[0]) if stats[1] * self._sign > 0 else math.nan


class Min(Max):
    """The smallest value given to ``update`` on any worker; NaN if no worker saw a value."""

    _reduce_op = "min"
    _sign = -1.0  # "seen" is -1 so that the minimum keeps it


class _ErrorMean(Metric):
    _size = 2  # error sum, count

    def update(self, preds: Any, labels: Any) -> None:
        """``preds`` and ``labels``: one prediction per label, any shapes with the same number of elements."""
        p, y = _pairs(preds, labels, type(self).__name__)
        err = self._error(p - y)
        self._add(torch.stack([err.sum(), err.new_tensor(float(err.numel()))]))

    @staticmethod
    def _error(diff: torch.Tensor) -> torch.Tensor:
        return diff.abs()

    def _value(self, stats: torch.Tensor) -> float:
        return float(stats[0] / stats[1]) if stats[1] else math.nan


class MAE(_ErrorMean):
    """Mean absolute error ``mean(|pred - label|)`` over every worker's pairs; NaN if none."""


class RMSE(_ErrorMean):
    """Root mean squared error ``sqrt(mean((pred - label)**2))`` over every worker's pairs; NaN if none."""

    @staticmethod
    def _error(diff: torch.Tensor) -> torch.Tensor:
        return diff * diff

    def _value(self, stats: torch.Tensor) -> float:
        return math.sqrt(super()._value(stats))


class Accuracy(Metric):
    """The share of correct predictions over every worker's examples; NaN if none.

    ``update(preds, labels)``, ``labels`` holding N class indices (shape [N] or [N, 1]):

    - ``preds`` of shape [N, C] with C >= 2: scores per class (logits, probabilities):
      the predicted class is the highest-scoring one (argmax);
    - otherwise N values: floating point values are binary scores, class 1 when
      ``pred >= threshold`` (0.5 for probabilities; pass ``threshold=0.0`` for logits),
      integers (or bools) are predicted classes compared as they are.
    """

    _size = 2  # correct, count

    def __init__(self, threshold: float = 0.5) -> None:
        self.threshold = float(threshold)
        super().__init__()

    def update(self, preds: Any, labels: Any) -> None:
        p, y = _tensor(preds), _tensor(labels).reshape(-1)
        if p.dim() == 2 and p.shape[1] >= 2:
            predicted = p.argmax(dim=1)
        elif p.is_floating_point():
            predicted = (p.reshape(-1) >= self.threshold).to(torch.int64)
        else:
            predicted = p.reshape(-1).to(torch.int64)
        if predicted.numel() != y.numel():
            raise ValueError(
                f"Accuracy.update: {predicted.numel()} predictions (preds of shape {list(p.shape)}) for {y.numel()} "
                "labels; give preds [N, C] (class scores) or N values (binary scores or classes) for N labels."
            )
        correct = (predicted == y.to(device=predicted.device, dtype=torch.int64)).sum().to(torch.float64)
        self._add(torch.stack([correct, correct.new_tensor(float(y.numel()))]))

    def _value(self, stats: torch.Tensor) -> float:
        return float(stats[0] / stats[1]) if stats[1] else math.nan

    def __repr__(self) -> str:
        return f"Accuracy(threshold={self.threshold})"


class AUC(Metric):
    """Area under the ROC curve over every worker's examples, from histograms summed over the workers.

    ``update(preds, labels)``: ``preds`` are probabilities of the positive class in [0, 1],
    shape [N] or [N, 1], or Paddle's [N, 2] (class 0, class 1) of which column 1 is taken;
    ``labels`` hold N values, nonzero meaning positive (as Paddle). Predictions fall into
    ``num_thresholds + 1`` buckets (``int(p * num_thresholds)``); the value is within about
    1e-4 of the exact AUC for predictions spread over [0, 1] with the default (see the module's
    docstring). 0.5 when all examples so far have one label (as Paddle).
    """

    def __init__(self, num_thresholds: int = DEFAULT_NUM_THRESHOLDS) -> None:
        if int(num_thresholds) < 1:
            raise ValueError(f"num_thresholds={num_thresholds}; it must be at least 1")
        self.num_thresholds = int(num_thresholds)
        self._size = 2 * (self.num_thresholds + 1)  # positives per bucket, then negatives
        super().__init__()

    def update(self, preds: Any, labels: Any) -> None:
        p = _tensor(preds)
        if p.dim() == 2 and p.shape[1] == 2:
            p = p[:, 1]  # Paddle's two-column form: the probability of class 1
        p, y = _pairs(p, labels, "AUC")
        if p.numel() == 0:
            return
        outside = ~((p >= 0) & (p <= 1))  # NaN too
        if outside.any():
            raise ValueError(
                f"AUC.update takes probabilities in [0, 1]; got {p[outside][0].item()!r} among {p.numel()} "
                "predictions. Apply torch.sigmoid to logits (or softmax to two-class scores) first."
            )
        buckets = self.num_thresholds + 1
        index = (p * self.num_thresholds).to(torch.int64) + buckets * (y == 0).to(torch.int64)
        self._add(torch.bincount(index, minlength=2 * buckets).to(torch.float64))

    def _value(self, stats: torch.Tensor) -> float:
        half = stats.numel() // 2
        return _auc_of(stats[:half], stats[half:])

    def __repr__(self) -> str:
        return f"AUC(num_thresholds={self.num_thresholds})"


def _auc_of(pos: torch.Tensor, neg: torch.Tensor) -> float:
    """AUC from positive and negative counts per bucket (bucket i: predictions in the i-th slice of [0, 1])."""
    pos, neg = pos.flip(0), neg.flip(0)  # highest predictions first
    above = torch.cumsum(pos, 0) - pos  # positives ranked above each bucket
    area = (neg * (above + pos / 2)).sum()  # pairs a negative loses: the positives above it, half of its bucket's
    total_pos, total_neg = pos.sum(), neg.sum()
    if total_pos == 0 or total_neg == 0:
        return 0.5
    return float(area / (total_pos * total_neg))


# --- Paddle's functional forms: statistics accumulated by the script, reduced over the workers ---------


def _reduce_like(input: Any, op: str) -> Any:
    """``input`` reduced element-wise over the workers, as the same kind of object (shape, dtype, device)."""
    t = _tensor(input)
    reduced = _all_reduce(t.detach().to("cpu", torch.float64).reshape(-1).clone(), op).reshape(t.shape)
    if isinstance(input, torch.Tensor):
        return reduced.to(device=input.device, dtype=input.dtype)
    if isinstance(input, (bool, int, float)):
        return float(reduced)
    import numpy as np

    return np.asarray(reduced.numpy(), dtype=np.asarray(input).dtype)


def sum(input: Any) -> Any:  # noqa: A001 - Paddle's name
    """Paddle's ``fleet.metrics.sum``: ``input`` (tensor, numpy array or number) summed element-wise over the workers.

    Returns the same kind of object: a tensor or array of the same shape and dtype, a float for a number.
    """
    return _reduce_like(input, "sum")


def max(input: Any) -> Any:  # noqa: A001 - Paddle's name
    """Paddle's ``fleet.metrics.max``: the element-wise maximum over the workers (same kind of object)."""
    return _reduce_like(input, "max")


def min(input: Any) -> Any:  # noqa: A001 - Paddle's name
    """Paddle's ``fleet.metrics.min``: the element-wise minimum over the workers (same kind of object)."""
    return _reduce_like(input, "min")


def _two_sums(a: Any, b: Any) -> tuple[float, float]:
    """The totals of ``a`` and ``b`` (all their elements) over every worker, in one reduction."""
    local = torch.stack([_tensor(x).to("cpu", torch.float64).sum() for x in (a, b)])
    total = _all_reduce(local, "sum")
    return float(total[0]), float(total[1])


def auc(stat_pos: Any, stat_neg: Any) -> float:
    """Paddle's ``fleet.metrics.auc``: the AUC of the histograms ``stat_pos``/``stat_neg`` summed over the workers.

    The histograms count positives and negatives per prediction bucket, bucket ``int(p *
    num_thresholds)`` (as ``paddle.static.auc``'s ``stat_pos``/``stat_neg``): shape [B] or [1, B],
    the same on every worker. 0.5 when there are no positives or no negatives.
    """
    pos, neg = _tensor(stat_pos), _tensor(stat_neg)
    if pos.shape != neg.shape or pos.dim() not in (1, 2) or (pos.dim() == 2 and pos.shape[0] != 1):
        raise ValueError(
            f"auc(stat_pos, stat_neg) takes two histograms of shape [B] or [1, B]; got {list(pos.shape)} and "
            f"{list(neg.shape)}"
        )
    stats = torch.cat([pos.reshape(-1), neg.reshape(-1)]).to("cpu", torch.float64)
    total = _all_reduce(stats, "sum")
    half = total.numel() // 2
    return _auc_of(total[:half], total[half:])


def mae(abserr: Any, total_ins_num: Any) -> float:
    """Paddle's ``fleet.metrics.mae``: the workers' absolute errors summed over their example counts."""
    err, count = _two_sums(abserr, total_ins_num)
    return err / count if count else math.nan


def mse(sqrerr: Any, total_ins_num: Any) -> float:
    """Paddle's ``fleet.metrics.mse``: the workers' squared errors summed over their example counts."""
    err, count = _two_sums(sqrerr, total_ins_num)
    return err / count if count else math.nan


def rmse(sqrerr: Any, total_ins_num: Any) -> float:
    """Paddle's ``fleet.metrics.rmse``: the square root of :func:`mse`."""
    return math.sqrt(mse(sqrerr, total_ins_num))


def acc(correct: Any, total: Any) -> float:
    """Paddle's ``fleet.metrics.acc``: the workers' correct predictions over their example counts."""
    right, count = _two_sums(correct, total)
    return right / count if count else math.nan
