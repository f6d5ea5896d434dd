"""torch.optim.Adam and AdamW (decoupled weight decay) as row optimizers: per-row bias corrections."""

from __future__ import annotations

from typing import Any

import pydantic
import torch

from fleet.sparse.row_optimizers.base import Hyper, RowOptimizer, finite_non_negative, number


class AdamHyper(Hyper, frozen=True):
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    @pydantic.model_validator(mode="after")
    def _check(self) -> AdamHyper:
        finite_non_negative(self, "eps")
        for i, beta in enumerate(self.betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"betas[{i}] must be in [0, 1), got {beta}")
        return self


class Adam(RowOptimizer):
    name = "adam"
    hyper = AdamHyper
    native_kind = 3
    torch_names = ("torch.optim.Adam",)

    def state_names(self, spec: Any) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    def needs_step(self, spec: Any) -> bool:
        return True  # the bias corrections

    def update(self, spec: Any, param: torch.Tensor, g: torch.Tensor, state: dict, step: Any, lr: float) -> None:
        beta1, beta2 = spec.betas
        if self.decoupled_weight_decay and spec.weight_decay != 0:
            param.mul_(1 - lr * spec.weight_decay)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        if isinstance(step, int):
            step_size = lr / (1 - beta1**step)
            bias_correction2_sqrt = (1 - beta2**step) ** 0.5
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(spec.eps)
            param.addcdiv_(exp_avg, denom, value=-step_size)
            return
        t = step.to(torch.float64)
        # Python computes these per-step scalars in float64 and torch rounds them to float32 at use.
        neg_step_size = (-lr / (1 - torch.pow(beta1, t))).to(torch.float32).unsqueeze(1)
        bias_correction2_sqrt = torch.sqrt(1 - torch.pow(beta2, t)).to(torch.float32).unsqueeze(1)
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(spec.eps)
        param.add_(neg_step_size * exp_avg / denom)

    def native_params(self, spec: Any) -> tuple[float, ...]:
        return (float(spec.betas[0]), float(spec.betas[1]), float(spec.eps))

    def from_torch(self, optimizer_class: type, group: dict[str, Any], rows: bool, where: str) -> dict | None:
        if not issubclass(optimizer_class, torch.optim.Adam | torch.optim.AdamW):
            return None
        decoupled = issubclass(optimizer_class, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay"))
        if decoupled != self.decoupled_weight_decay:
            return None  # the other of the two
        if group.get("amsgrad"):
            raise ValueError(f"{optimizer_class.__name__}(amsgrad=True) is not supported {where}")
        betas = tuple(
            float(b.item()) if isinstance(b, torch.Tensor) else float(b) for b in group.get("betas", (0.9, 0.999))
        )
        return {"betas": betas, "eps": number(group, "eps", 1e-8)}


class AdamW(Adam):
    name = "adamw"
    native_kind = 4
    decoupled_weight_decay = True
    torch_names = ("torch.optim.AdamW",)
