"""torch.optim.Adagrad and row-wise Adagrad (one accumulator per row: fleet.nn.RowWiseAdagrad) as row optimizers."""

from __future__ import annotations

from typing import Any

import pydantic
import torch

from fleet.sparse.row_optimizers.base import Hyper, RowOptimizer, finite_non_negative, number
from fleet.sparse.row_optimizers.rowwise_adagrad import RowWiseAdagrad, accumulate_rows

_EPS = 1e-10  # torch.optim.Adagrad's default, unlike Adam's 1e-8


class AdagradHyper(Hyper, frozen=True):
    eps: float = _EPS
    lr_decay: float = 0.0
    initial_accumulator_value: float = 0.0

    @pydantic.model_validator(mode="after")
    def _check(self) -> AdagradHyper:
        finite_non_negative(self, "eps", "lr_decay", "initial_accumulator_value")
        return self


class Adagrad(RowOptimizer):
    name = "adagrad"
    hyper = AdagradHyper
    native_kind = 1
    torch_names = ("torch.optim.Adagrad",)

    def state_names(self, spec: Any) -> tuple[str, ...]:
        return ("sum",)

    def needs_step(self, spec: Any) -> bool:
        return spec.lr_decay != 0

    def initial_state(self, spec: Any, name: str) -> float:
        return spec.initial_accumulator_value

    def accumulate(self, param: torch.Tensor, g: torch.Tensor, state_sum: torch.Tensor) -> None:
        state_sum.addcmul_(g, g, value=1)

    def update(self, spec: Any, param: torch.Tensor, g: torch.Tensor, state: dict, step: Any, lr: float) -> None:
        state_sum = state["sum"]
        self.accumulate(param, g, state_sum)
        std = state_sum.sqrt().add_(spec.eps)
        if isinstance(step, int) or spec.lr_decay == 0:
            n = step if isinstance(step, int) else 1
            clr = lr / (1 + (n - 1) * spec.lr_decay)
            param.addcdiv_(g, std, value=-clr)
            return
        neg_clr = (-lr / (1 + (step.to(torch.float64) - 1) * spec.lr_decay)).to(torch.float32).unsqueeze(1)
        param.add_(neg_clr * g / std)

    def native_params(self, spec: Any) -> tuple[float, ...]:
        return (float(spec.eps), float(spec.lr_decay))

    def from_torch(self, optimizer_class: type, group: dict[str, Any], rows: bool, where: str) -> dict | None:
        # RowWiseAdagrad's dense path is torch's Adagrad: it is this rule except on a table's rows
        if not issubclass(optimizer_class, torch.optim.Adagrad | RowWiseAdagrad):
            return None
        return {
            "eps": number(group, "eps", _EPS),
            "lr_decay": number(group, "lr_decay", 0.0),
            "initial_accumulator_value": number(group, "initial_accumulator_value", 0.0),
        }

    def torch_state(self, pieces: dict[str, torch.Tensor], step: int) -> dict[str, Any]:
        # torch makes Adagrad's state at construction, step 0 included
        return {"step": torch.tensor(float(max(step, 0))), **pieces}


class RowWiseAdagradRule(Adagrad):
    name = "rowwise_adagrad"
    native_kind = 2
    torch_names = ("fleet.nn.RowWiseAdagrad",)

    def state_width(self, spec: Any) -> int | None:
        return 1  # one accumulator per row

    def accumulate(self, param: torch.Tensor, g: torch.Tensor, state_sum: torch.Tensor) -> None:
        accumulate_rows(param, g, state_sum)

    def from_torch(self, optimizer_class: type, group: dict[str, Any], rows: bool, where: str) -> dict | None:
        return (
            super().from_torch(optimizer_class, group, rows, where)
            if rows and issubclass(optimizer_class, RowWiseAdagrad)
            else None
        )
