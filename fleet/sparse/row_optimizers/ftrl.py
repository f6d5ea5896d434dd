"""FTRL-Proximal (McMahan et al., "Ad Click Prediction: a View from the Trenches", KDD 2013) as a row optimizer.

The CTR staple (Paddle's and TensorFlow's ``Ftrl``): per-coordinate learning rates, and an L1 term that
makes weights exactly zero, so a table trained with it holds many all-zero rows (cheap to serve, and a
sign of a feature that does not help). Per element, with ``alpha`` the learning rate, ``n`` the summed
squared gradients (state ``accumulator``), ``z`` the linear term (state ``linear``) and ``p`` = ``lr_power``
(-0.5: the paper's square root), as TensorFlow's ``ApplyFtrl`` computes it::

    n' = n + g*g
    sigma = (n'^(-p) - n^(-p)) / alpha
    z = z + g - sigma * w
    w = 0                                                    if |z| <= l1
        (sign(z) * l1 - z) / ((beta + n'^(-p)) / alpha + 2 * l2)   otherwise
    n = n'

``beta`` is the paper's (TF2 Keras's ``beta``: it adds ``beta / alpha`` to the denominator); ``l2`` is
TensorFlow's ``l2_regularization_strength`` (hence ``2 * l2``). The learning rate travels with each update
(the worker's current one), as for every rule. A table's own rule only: it has no ``torch.optim`` class, so a
``SparseEmbedding`` gets it as data (``optimizer={"kind": "ftrl", "l1": ...}``).
"""

from __future__ import annotations

import math
from typing import Any

import pydantic
import torch

from fleet.sparse.row_optimizers.base import Hyper, RowOptimizer, finite_non_negative


class FTRLHyper(Hyper, frozen=True):
    beta: float = 0.0
    """Added to each coordinate's ``sqrt(n)`` in the denominator (smooths the first steps)."""
    l1: float = 0.0
    """L1 strength: a coordinate whose ``|z|`` is at most ``l1`` is exactly zero."""
    l2: float = 0.0
    """L2 strength (TensorFlow's ``l2_regularization_strength``)."""
    lr_power: float = -0.5
    """The per-coordinate learning rate is ``alpha / n**(-lr_power)``; -0.5 is the paper's (and TF's default)."""
    initial_accumulator_value: float = 0.1
    """A new row's ``n`` (TensorFlow's default, 0.1)."""

    @pydantic.model_validator(mode="after")
    def _check(self) -> FTRLHyper:
        finite_non_negative(self, "beta", "l1", "l2", "initial_accumulator_value")
        if not math.isfinite(self.lr_power) or self.lr_power > 0:
            raise ValueError(f"lr_power must be a finite number <= 0, got {self.lr_power}")
        return self


class FTRL(RowOptimizer):
    name = "ftrl"
    hyper = FTRLHyper
    native_kind = 5

    def state_names(self, spec: Any) -> tuple[str, ...]:
        return ("accumulator", "linear")

    def initial_state(self, spec: Any, name: str) -> float:
        return spec.initial_accumulator_value if name == "accumulator" else 0.0

    def update(self, spec: Any, param: torch.Tensor, g: torch.Tensor, state: dict, step: Any, lr: float) -> None:
        n, z = state["accumulator"], state["linear"]
        n_new = n.addcmul(g, g)
        if spec.lr_power == -0.5:
            root_new, root = n_new.sqrt(), n.sqrt()
        else:
            root_new, root = n_new.pow(-spec.lr_power), n.pow(-spec.lr_power)
        sigma = (root_new - root) / lr
        z.add_(g - sigma * param)
        quadratic = (root_new + spec.beta) / lr + 2 * spec.l2
        shrunk = (z.sign() * spec.l1 - z) / quadratic
        param.copy_(torch.where(z.abs() > spec.l1, shrunk, torch.zeros_like(shrunk)))
        n.copy_(n_new)

    def native_params(self, spec: Any) -> tuple[float, ...]:
        return (float(spec.beta), float(spec.l1), float(spec.l2), float(spec.lr_power))
