"""RowWiseAdagrad: Adagrad with one accumulator per embedding row, as a ``torch.optim`` optimizer.

torch has no row-wise Adagrad, the usual optimizer for large embedding tables, so fleet provides
one (``fleet.nn.RowWiseAdagrad``). It is a plain ``torch.optim.Optimizer``, usable in one process
without fleet, and fleet recognises it: a ``fleet.nn.SparseEmbedding`` in its param groups gets the
row optimizer ``rowwise_adagrad`` (:class:`fleet.sparse.optim.OptimizerSpec`) in every mode.

The math follows DLRM's ``RWSAdagrad`` (``dlrm/optim/rwsadagrad.py``), which FBGEMM's
``EXACT_ROWWISE_ADAGRAD`` and caffe2's ``RowWiseSparseAdagrad`` share: for a row's gradient ``g``
(``d`` elements), with ``clr = lr / (1 + (step - 1) * lr_decay)``::

    sum_row += mean(g * g)                  # one float per row, not d
    row     -= clr * g / (sqrt(sum_row) + eps)

It applies to *rows*: fleet's sparse tables and sparse gradients (``nn.Embedding(sparse=True)``,
rows = the first dimension). A dense gradient gets ``torch.optim.Adagrad``'s element-wise rule,
as in DLRM's ``RWSAdagrad`` (a model's MLPs train with Adagrad beside row-wise tables).
:func:`accumulate_rows` is its accumulation on a sparse table's rows (fleet's row optimizer, whose
update is otherwise Adagrad's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class RowWiseAdagrad(torch.optim.Optimizer):
    """Row-wise Adagrad for embedding rows, torch's Adagrad for dense gradients (see the module docstring).

    Arguments as ``torch.optim.Adagrad`` (``lr``, ``lr_decay``, ``weight_decay``,
    ``initial_accumulator_value``, ``eps``, ``maximize``). The step count (for ``lr_decay``) is per
    parameter here, as in torch and DLRM; fleet's sparse tables count it per row, as for every row
    optimizer: the two agree for rows that receive a gradient every step. ``weight_decay`` on a
    sparse gradient decays the rows the gradient touches (fleet's tables do the same).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        *,
        maximize: bool = False,
    ) -> None:
        for name, value in (
            ("lr", lr),
            ("lr_decay", lr_decay),
            ("weight_decay", weight_decay),
            ("initial_accumulator_value", initial_accumulator_value),
            ("eps", eps),
        ):
            if not value >= 0.0:
                raise ValueError(f"RowWiseAdagrad: {name} must be >= 0, got {value}")
        defaults = {
            "lr": lr,
            "lr_decay": lr_decay,
            "weight_decay": weight_decay,
            "initial_accumulator_value": initial_accumulator_value,
            "eps": eps,
            "maximize": maximize,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # noqa: D102
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "step" not in state:
                    state["step"] = torch.tensor(0.0)
                state["step"] += 1
                clr = group["lr"] / (1 + (float(state["step"]) - 1) * group["lr_decay"])
                grad = -p.grad if group["maximize"] else p.grad
                if grad.is_sparse:
                    self._rows(p, grad, state, group, clr)
                else:
                    self._dense(p, grad, state, group, clr)
        return loss

    @staticmethod
    def _dense(p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, clr: float) -> None:
        """torch.optim.Adagrad's single-tensor rule, line by line."""
        if "sum" not in state:
            state["sum"] = torch.full_like(p, group["initial_accumulator_value"], memory_format=torch.preserve_format)
        if group["weight_decay"] != 0:
            grad = grad.add(p, alpha=group["weight_decay"])
        state["sum"].addcmul_(grad, grad, value=1)
        std = state["sum"].sqrt().add_(group["eps"])
        p.addcdiv_(grad, std, value=-clr)

    @staticmethod
    def _rows(p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, clr: float) -> None:
        """One accumulator per row of ``p`` (``state["row_sum"]``); only the rows in ``grad`` change."""
        if "row_sum" not in state:
            state["row_sum"] = torch.full((p.shape[0],), float(group["initial_accumulator_value"]), dtype=p.dtype)
        grad = grad.coalesce()  # the update is not linear in the gradient: one total per row
        rows = grad.indices()[0]
        values = grad.values().reshape(rows.numel(), -1)
        flat = p.view(p.shape[0], -1)
        if group["weight_decay"] != 0:
            values = values.add(flat.index_select(0, rows), alpha=group["weight_decay"])
        row_sum = state["row_sum"]
        row_sum.index_add_(0, rows, values.square().mean(dim=1))
        std = row_sum.index_select(0, rows).sqrt().add_(group["eps"]).unsqueeze(1)
        flat.index_add_(0, rows, values / std, alpha=-clr)


def accumulate_rows(rows: torch.Tensor, g: torch.Tensor, state_sum: torch.Tensor) -> None:
    """A table's row-wise accumulation in place: ``rows``/``g`` ``[n, dim]``, ``state_sum`` ``[n, 1]``.

    The rest of the row update (``lr_decay``, ``eps``, per-row steps) is Adagrad's, in
    :class:`fleet.sparse.optim.ServerOptimizer`; ``g`` already carries weight decay and ``maximize``.
    """
    if rows.dim() != 2:  # a dense table's flat block has no rows
        raise ValueError("optimizer kind 'rowwise_adagrad' updates a sparse table's rows, not a dense block")
    state_sum.add_(g.square().mean(dim=1, keepdim=True))
