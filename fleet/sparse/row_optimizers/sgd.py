"""torch.optim.SGD, with momentum, dampening and Nesterov, as a row optimizer."""

from __future__ import annotations

from typing import Any

import pydantic
import torch

from fleet.sparse.row_optimizers.base import Hyper, RowOptimizer, finite_non_negative, number


class SGDHyper(Hyper, frozen=True):
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False

    @pydantic.model_validator(mode="after")
    def _check(self) -> SGDHyper:
        finite_non_negative(self, "momentum", "dampening")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError(
                f"nesterov needs momentum > 0 and dampening == 0 (got momentum={self.momentum}, "
                f"dampening={self.dampening}), as in torch.optim.SGD"
            )
        return self


class SGD(RowOptimizer):
    name = "sgd"
    hyper = SGDHyper
    native_kind = 0
    torch_names = ("torch.optim.SGD",)

    def state_names(self, spec: Any) -> tuple[str, ...]:
        return ("momentum_buffer",) if spec.momentum != 0 else ()

    def needs_step(self, spec: Any) -> bool:
        return spec.momentum != 0  # a row's first step copies the gradient into its buffer

    def update(self, spec: Any, param: torch.Tensor, g: torch.Tensor, state: dict, step: Any, lr: float) -> None:
        if spec.momentum != 0:
            buf = state["momentum_buffer"]
            if isinstance(step, int):
                if step == 1:
                    buf.copy_(g)
                else:
                    buf.mul_(spec.momentum).add_(g, alpha=1 - spec.dampening)
            else:
                # A row's first update copies the gradient, later ones accumulate (torch's buf is None).
                buf.mul_(spec.momentum).add_(g, alpha=1 - spec.dampening)
                torch.where((step == 1).unsqueeze(1), g, buf, out=buf)
            g = g.add(buf, alpha=spec.momentum) if spec.nesterov else buf
        param.add_(g, alpha=-lr)

    def native_params(self, spec: Any) -> tuple[float, ...]:
        return (float(spec.momentum), float(spec.dampening), float(spec.nesterov))

    def from_torch(self, optimizer_class: type, group: dict[str, Any], rows: bool, where: str) -> dict | None:
        if not issubclass(optimizer_class, torch.optim.SGD):
            return None
        return {
            "momentum": number(group, "momentum", 0.0),
            "dampening": number(group, "dampening", 0.0),
            "nesterov": bool(group.get("nesterov", False)),
        }

    def torch_state(self, pieces: dict[str, torch.Tensor], step: int) -> dict[str, Any]:
        return pieces if step > 0 else {}  # the momentum buffer, or nothing without momentum
