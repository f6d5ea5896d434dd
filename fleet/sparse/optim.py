"""Server-side optimizers and deterministic row initialisation for the parameter server.

Why the server runs the optimizer: in a parameter-server job the parameters
live on the servers, so the update rule has to run there. It must be the
worker's own ``torch.optim`` class with its hyper-parameters (an
:class:`OptimizerSpec`, built by :meth:`OptimizerSpec.from_torch`), and it must
produce the numbers ``torch.optim`` would, so that switching a script from one
process to a parameter-server job changes where the math runs, not the math.
The learning rate is *not* taken from the spec at update time: it travels with
every push, so LR schedulers on the worker keep working.

:class:`ServerOptimizer` applies one rule to a block of parameters in two ways:

- dense: the whole block gets a gradient every step and shares one step count
  (exactly ``torch.optim``'s single-tensor code path);
- row-wise ("lazy"): only the rows in an update change, and each row keeps its
  own state and step count, so Adam's bias correction and Adagrad's lr decay
  are per row. A row that receives a gradient every step follows torch exactly.

:func:`initial_rows` makes a sparse row's initial value a pure function of
``(seed, id, column)``, so it does not matter which server creates a row, in
which batch, or in what order.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

import pydantic
import torch

from fleet.sparse.native import kernels
from fleet.sparse.rowwise_adagrad import RowWiseAdagrad, accumulate_rows

Kind = Literal["sgd", "adam", "adamw", "adagrad", "rowwise_adagrad"]

# Fields each optimizer kind reads; setting any other hyper-parameter is a mistake we report.
_FIELDS_FOR: dict[str, frozenset[str]] = {
    "sgd": frozenset({"momentum", "dampening", "nesterov"}),
    "adam": frozenset({"betas", "eps"}),
    "adamw": frozenset({"betas", "eps"}),
    "adagrad": frozenset({"eps", "lr_decay", "initial_accumulator_value"}),
    "rowwise_adagrad": frozenset({"eps", "lr_decay", "initial_accumulator_value"}),
}
_COMMON = frozenset({"kind", "lr", "weight_decay", "maximize"})
_ADAGRAD_EPS = 1e-10  # torch.optim.Adagrad's default, unlike Adam's 1e-8


def _format_validation_error(what: str, err: pydantic.ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "<root>"
        parts.append(f"field '{loc}': {e['msg']}")
    return f"invalid {what} config: " + "; ".join(parts)


def _validate(model: type[pydantic.BaseModel], what: str, data: Any) -> Any:
    """Validate ``data`` into ``model``; errors become ``ValueError`` naming each field."""
    if not isinstance(data, dict):
        raise ValueError(f"invalid {what} config: expected a dict, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as err:
        raise ValueError(_format_validation_error(what, err)) from None


class OptimizerSpec(pydantic.BaseModel, frozen=True, extra="forbid"):
    """A ``torch.optim`` optimizer's rule and hyper-parameters, as plain data for the wire."""

    kind: Kind
    """Update rule: torch.optim.SGD, Adam, AdamW (decoupled weight decay), Adagrad, or row-wise Adagrad
    (``fleet.nn.RowWiseAdagrad`` on a sparse table: one accumulator per row, see :mod:`fleet.sparse.rowwise_adagrad`)."""
    lr: float
    """Default learning rate; each update passes its own (the worker's current one)."""
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    """L2 penalty added to the gradient (sgd, adam, adagrad); decoupled decay for adamw."""
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    """Adam's default; Adagrad's default (1e-10) is filled in when ``eps`` is not given."""
    lr_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    maximize: bool = False

    @pydantic.model_validator(mode="before")
    @classmethod
    def _kind_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("kind") in ("adagrad", "rowwise_adagrad") and "eps" not in data:
            data = {**data, "eps": _ADAGRAD_EPS}
        return data

    @pydantic.model_validator(mode="after")
    def _check(self) -> OptimizerSpec:
        for name in ("lr", "momentum", "dampening", "weight_decay", "eps", "lr_decay", "initial_accumulator_value"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        for i, beta in enumerate(self.betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"betas[{i}] must be in [0, 1), got {beta}")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError(
                f"nesterov needs momentum > 0 and dampening == 0 (got momentum={self.momentum}, "
                f"dampening={self.dampening}), as in torch.optim.SGD"
            )
        allowed = _FIELDS_FOR[self.kind] | _COMMON
        defaults = {name: f.default for name, f in type(self).model_fields.items()}
        for name in sorted(self.model_fields_set - allowed):
            if getattr(self, name) != defaults[name]:
                raise ValueError(f"{name} does not apply to optimizer kind '{self.kind}' (it reads {sorted(allowed)})")
        return self

    @classmethod
    def from_torch(
        cls, optimizer_class: type, param_group: dict, *, rows: bool = False, where: str = "by fleet's sparse tables"
    ) -> OptimizerSpec:
        """Spec for a ``torch.optim`` class and one of its ``param_groups``.

        Supported: SGD, Adam, AdamW, Adagrad (subclasses resolve to their base) and
        ``fleet.nn.RowWiseAdagrad``, which is ``rowwise_adagrad`` for a sparse table's rows
        (``rows=True``) and torch's Adagrad for dense parameters, as its dense path is.
        Options that change the math but are not implemented (``amsgrad``) raise
        rather than being silently dropped; device/implementation switches
        (``foreach``, ``fused``, ``capturable``, ``differentiable``) are ignored.
        ``where`` names the context in errors ("in one process", "by the parameter server").
        """
        g = param_group

        def num(key: str, default: float) -> float:
            v = g.get(key, default)
            return float(v.item()) if isinstance(v, torch.Tensor) else float(v)

        if not isinstance(optimizer_class, type):
            raise ValueError(f"optimizer_class must be a class, got {optimizer_class!r}")
        common = {"lr": num("lr", 0.0), "weight_decay": num("weight_decay", 0.0), "maximize": bool(g.get("maximize"))}
        if issubclass(optimizer_class, torch.optim.SGD):
            return cls(
                kind="sgd",
                momentum=num("momentum", 0.0),
                dampening=num("dampening", 0.0),
                nesterov=bool(g.get("nesterov", False)),
                **common,
            )
        if issubclass(optimizer_class, torch.optim.Adam | torch.optim.AdamW):
            if g.get("amsgrad"):
                raise ValueError(f"{optimizer_class.__name__}(amsgrad=True) is not supported {where}")
            decoupled = issubclass(optimizer_class, torch.optim.AdamW) or bool(g.get("decoupled_weight_decay"))
            betas = tuple(
                float(b.item()) if isinstance(b, torch.Tensor) else float(b) for b in g.get("betas", (0.9, 0.999))
            )
            return cls(kind="adamw" if decoupled else "adam", betas=betas, eps=num("eps", 1e-8), **common)
        rowwise = issubclass(optimizer_class, RowWiseAdagrad)
        if issubclass(optimizer_class, torch.optim.Adagrad) or rowwise:
            return cls(
                kind="rowwise_adagrad" if rowwise and rows else "adagrad",
                eps=num("eps", _ADAGRAD_EPS),
                lr_decay=num("lr_decay", 0.0),
                initial_accumulator_value=num("initial_accumulator_value", 0.0),
                **common,
            )
        raise ValueError(
            f"optimizer {optimizer_class.__name__} is not supported {where}; supported: torch.optim.SGD, "
            "torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, fleet.nn.RowWiseAdagrad"
        )

    def to_config(self) -> dict[str, Any]:
        """JSON-able dict holding only the fields this kind reads (``from_config`` inverts it)."""
        keep = _FIELDS_FOR[self.kind] | _COMMON
        return self.model_dump(mode="json", include=set(keep))

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> OptimizerSpec:
        """Inverse of :meth:`to_config`; a bad config raises ``ValueError`` naming the field."""
        return _validate(cls, "optimizer", config)


class InitializerSpec(pydantic.BaseModel, frozen=True, extra="forbid"):
    """How a sparse row's initial values are drawn (per element, from a counter-based hash)."""

    kind: Literal["uniform", "normal", "zeros", "constant"] = "uniform"
    low: float = -0.01
    high: float = 0.01
    mean: float = 0.0
    std: float = 0.01
    value: float = 0.0
    """The constant, for kind 'constant'."""

    @pydantic.model_validator(mode="after")
    def _check(self) -> InitializerSpec:
        if self.kind == "uniform" and not self.low <= self.high:
            raise ValueError(f"low must be <= high, got low={self.low}, high={self.high}")
        if self.kind == "normal" and not self.std >= 0:
            raise ValueError(f"std must be >= 0, got {self.std}")
        return self

    def to_config(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> InitializerSpec:
        return _validate(cls, "initializer", config)


# --------------------------------------------------------------------------- initial rows
_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # splitmix64 increment
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _signed(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


def _srl(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic: it copies the sign bit)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors; multiplication wraps modulo 2**64."""
    z = (z ^ _srl(z, 30)) * _signed(_MIX1)
    z = (z ^ _srl(z, 27)) * _signed(_MIX2)
    return z ^ _srl(z, 31)


def _mix_int(z: int) -> int:
    """The same finaliser on a Python int (unsigned 64-bit), for per-call constants."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def _mix_(z: torch.Tensor, scratch: torch.Tensor) -> None:
    """:func:`_mix` in place (``scratch``: a tensor like ``z``), for the ``[n, dim]`` hashes of new rows.

    Why: out of place, each of its eleven steps allocates and writes a fresh ``[n, dim]`` int64
    tensor; in place, the same integer arithmetic (so the same bits) takes 25-40 % less time
    for 1,700-100,000 new rows here: creating rows is a large part of a growing table's pull.
    """
    for shift, factor in ((30, _signed(_MIX1)), (27, _signed(_MIX2)), (31, None)):
        torch.bitwise_right_shift(z, shift, out=scratch)
        scratch &= (1 << (64 - shift)) - 1
        z ^= scratch
        if factor is not None:
            z *= factor


def _uniform01(ids: torch.Tensor, dim: int, seed: int, stream: int) -> torch.Tensor:
    """float64 [n, dim] in (0, 1]: 53 random bits of hash(seed, id, column, stream)."""
    seed_key = _signed(_mix_int(seed * _GAMMA + stream + 1))
    row = _mix(ids ^ seed_key)
    cols = torch.tensor([_signed((c + 1) * _GAMMA) for c in range(dim)], dtype=torch.int64)
    z = row.unsqueeze(1) + cols
    scratch = torch.empty_like(z)
    _mix_(z, scratch)
    torch.bitwise_right_shift(z, 11, out=scratch)
    scratch &= (1 << 53) - 1
    scratch += 1
    return scratch.to(torch.float64).mul_(2.0**-53)


def _uniform_rows(ids: torch.Tensor, dim: int, init: InitializerSpec, seed: int, out: torch.Tensor) -> torch.Tensor:
    """The "uniform" rows, natively, into ``out``: the bits of :func:`_uniform_rows_torch` (creating rows is much
    of a growing table's pull, and the torch version makes a dozen ``[n, dim]`` int64 passes)."""
    seed_key = _signed(_mix_int(seed * _GAMMA + 1))  # _uniform01's key for stream 0
    kernels.uniform_rows(ids.contiguous().numpy(), seed_key, float(init.low), init.high - init.low, out.numpy())
    return out


def _uniform_rows_torch(ids: torch.Tensor, dim: int, init: InitializerSpec, seed: int) -> torch.Tensor:
    """The definition of the "uniform" rows (tests hold the kernel to it)."""
    u = _uniform01(ids, dim, seed, 0) - 2.0**-53  # [0, 1)
    return (u * (init.high - init.low) + init.low).to(torch.float32)


def initial_rows(
    ids: torch.Tensor, dim: int, init: InitializerSpec, seed: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Initial values of the rows for ``ids``: float32 ``[len(ids), dim]``.

    Element ``(i, c)`` depends only on ``(seed, ids[i], c)`` — never on the
    batch it arrives in, its position, or which server shard creates it. The
    arithmetic runs in float64 and is rounded to float32 once at the end, so
    vectorised and scalar kernel paths agree bit for bit after rounding.
    ``out``: float32 ``[len(ids), dim]`` to write them into (a table's new rows, in place; each row's
    elements adjacent), returned.
    """
    if ids.dim() != 1:
        raise ValueError(f"ids must be 1-D, got shape {tuple(ids.shape)}")
    ids = ids.to(torch.int64)
    n = ids.numel()
    if out is not None and (tuple(out.shape) != (n, dim) or out.dtype != torch.float32):
        raise ValueError(f"out must be float32 {(n, dim)}, got {out.dtype} {tuple(out.shape)}")
    if init.kind == "uniform":
        if out is not None and (out.stride(-1) == 1 or dim <= 1):  # written in place, rows apart or not
            return _uniform_rows(ids, dim, init, seed, out)
        rows = _uniform_rows(ids, dim, init, seed, torch.empty(n, dim, dtype=torch.float32))
        return rows if out is None else out.copy_(rows)
    if init.kind == "zeros":
        rows = torch.zeros(n, dim, dtype=torch.float32) if out is None else out.zero_()
    elif init.kind == "constant":
        rows = torch.full((n, dim), init.value, dtype=torch.float32) if out is None else out.fill_(init.value)
    else:  # Box-Muller on two independent streams.
        u1 = _uniform01(ids, dim, seed, 1)
        u2 = _uniform01(ids, dim, seed, 2)
        z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)
        rows = (z * init.std + init.mean).to(torch.float32)
        if out is not None:
            out.copy_(rows)
    return rows if out is None else out


# --------------------------------------------------------------------------- update rules
class ServerOptimizer:
    """Applies one :class:`OptimizerSpec` to parameter blocks and their state tensors.

    ``update`` is called with ``step`` either as an ``int`` (dense: every
    element is on the same step, and the code is torch's single-tensor path
    line by line) or as an int64 tensor ``[rows]`` (row-wise: each row's own
    step count, already incremented for this update).
    """

    def __init__(self, spec: OptimizerSpec) -> None:
        self.spec = spec
        if spec.kind == "sgd":
            self.state_names: tuple[str, ...] = ("momentum_buffer",) if spec.momentum != 0 else ()
        elif spec.kind in ("adam", "adamw"):
            self.state_names = ("exp_avg", "exp_avg_sq")
        else:
            self.state_names = ("sum",)
        # Row-wise Adagrad keeps one accumulator per row, not one per element.
        self.state_width = 1 if spec.kind == "rowwise_adagrad" else None
        # Whether updates read the step count (momentum's first step, Adam's bias correction, Adagrad's
        # lr decay). When False, ``update`` accepts any step value, so callers may skip counting.
        self.needs_step = spec.kind in ("adam", "adamw") or spec.momentum != 0 or spec.lr_decay != 0

    def fill_new_state(self, state: dict[str, torch.Tensor]) -> None:
        """Set freshly created state (slices of the state tensors) to its initial value."""
        for name, t in state.items():
            t.fill_(self.spec.initial_accumulator_value if name == "sum" else 0.0)

    def update(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, torch.Tensor],
        step: int | torch.Tensor,
        lr: float,
    ) -> None:
        """Update ``param`` and ``state`` in place; ``grad`` is left untouched."""
        s = self.spec
        g = -grad if s.maximize else grad
        if s.weight_decay != 0 and s.kind != "adamw":
            g = g.add(param, alpha=s.weight_decay)
        if s.kind == "sgd":
            self._sgd(param, g, state, step, lr)
        elif s.kind in ("adagrad", "rowwise_adagrad"):
            self._adagrad(param, g, state, step, lr)
        else:
            self._adam(param, g, state, step, lr)

    def _sgd(self, param: torch.Tensor, g: torch.Tensor, state: dict, step: int | torch.Tensor, lr: float) -> None:
        s = self.spec
        if s.momentum != 0:
            buf = state["momentum_buffer"]
            if isinstance(step, int):
                if step == 1:
                    buf.copy_(g)
                else:
                    buf.mul_(s.momentum).add_(g, alpha=1 - s.dampening)
            else:
                # A row's first update copies the gradient, later ones accumulate (torch's buf is None).
                buf.mul_(s.momentum).add_(g, alpha=1 - s.dampening)
                torch.where((step == 1).unsqueeze(1), g, buf, out=buf)
            g = g.add(buf, alpha=s.momentum) if s.nesterov else buf
        param.add_(g, alpha=-lr)

    def _adam(self, param: torch.Tensor, g: torch.Tensor, state: dict, step: int | torch.Tensor, lr: float) -> None:
        s = self.spec
        beta1, beta2 = s.betas
        if s.kind == "adamw" and s.weight_decay != 0:
            param.mul_(1 - lr * s.weight_decay)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        if isinstance(step, int):
            step_size = lr / (1 - beta1**step)
            bias_correction2_sqrt = (1 - beta2**step) ** 0.5
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(s.eps)
            param.addcdiv_(exp_avg, denom, value=-step_size)
            return
        t = step.to(torch.float64)
        # Python computes these per-step scalars in float64 and torch rounds them to float32 at use.
        neg_step_size = (-lr / (1 - torch.pow(beta1, t))).to(torch.float32).unsqueeze(1)
        bias_correction2_sqrt = torch.sqrt(1 - torch.pow(beta2, t)).to(torch.float32).unsqueeze(1)
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(s.eps)
        param.add_(neg_step_size * exp_avg / denom)

    def _adagrad(self, param: torch.Tensor, g: torch.Tensor, state: dict, step: int | torch.Tensor, lr: float) -> None:
        s = self.spec
        state_sum = state["sum"]
        if s.kind == "rowwise_adagrad":
            accumulate_rows(param, g, state_sum)  # one accumulator per row
        else:
            state_sum.addcmul_(g, g, value=1)
        std = state_sum.sqrt().add_(s.eps)
        if isinstance(step, int) or s.lr_decay == 0:
            n = step if isinstance(step, int) else 1
            clr = lr / (1 + (n - 1) * s.lr_decay)
            param.addcdiv_(g, std, value=-clr)
            return
        neg_clr = (-lr / (1 + (step.to(torch.float64) - 1) * s.lr_decay)).to(torch.float32).unsqueeze(1)
        param.add_(neg_clr * g / std)


def optimizer_config_json(spec: OptimizerSpec) -> str:
    """The spec as a compact JSON string (for state dicts, which hold only tensors and scalars)."""
    return json.dumps(spec.to_config(), sort_keys=True)


def check_saved_optimizer(kind: str, state: dict[str, Any], spec: OptimizerSpec) -> None:
    """A ``kind`` ("dense", "sparse") table's state_dict was saved for this table's optimizer kind (if it says)."""
    if "optimizer" in state:
        saved = json.loads(state["optimizer"]).get("kind")
        if saved != spec.kind:
            raise ValueError(f"{kind} table state_dict is for optimizer '{saved}', this table uses '{spec.kind}'")


def check_table_config(kind: str, config: Any, allowed: tuple[str, ...], required: tuple[str, ...]) -> None:
    """A table config from the wire: a dict with only ``allowed`` keys and every ``required`` one."""
    if not isinstance(config, dict):
        raise ValueError(f"{kind} table config must be a dict, got {type(config).__name__}")
    unknown = sorted(set(config) - set(allowed))
    if unknown:
        raise ValueError(f"{kind} table config: unknown key(s) {unknown}; expected {list(allowed)}")
    for key in required:
        if key not in config:
            raise ValueError(f"{kind} table config: missing key '{key}'")
