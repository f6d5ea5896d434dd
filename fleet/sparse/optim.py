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

import functools
import json
import math
from typing import Any, Literal

import pydantic
import torch

from fleet.sparse import row_optimizers
from fleet.sparse.native import kernels
from fleet.sparse.row_optimizers.base import number

_COMMON = ("kind", "lr", "weight_decay", "maximize")


def _error_parts(err: pydantic.ValidationError) -> str:
    """Each error of ``err``, naming its field (a model's own check names its fields itself)."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        parts.append(f"field '{loc}': {msg}" if loc else msg)
    return "; ".join(parts)


def _format_validation_error(what: str, err: pydantic.ValidationError) -> str:
    return f"invalid {what} config: " + _error_parts(err)


def _validate(model: type[pydantic.BaseModel], what: str, data: Any) -> Any:
    """Validate ``data`` into ``model``; errors become ``ValueError`` naming each field."""
    if not isinstance(data, dict):
        raise ValueError(f"invalid {what} config: expected a dict, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as err:
        raise ValueError(_format_validation_error(what, err)) from None


class OptimizerSpec(pydantic.BaseModel, frozen=True, extra="allow"):
    """A row optimizer's kind and hyper-parameters, as plain data for the wire.

    ``kind`` names a rule of :mod:`fleet.sparse.row_optimizers` (sgd, adam, adamw, adagrad,
    rowwise_adagrad, ftrl), which declares the rest of the fields (``momentum``, ``betas``, ``l1``, ...:
    attributes of the spec, with the rule's defaults), their checks and the math.
    """

    kind: str
    """The rule's name (:func:`fleet.sparse.row_optimizers.names`)."""
    lr: float
    """Default learning rate; each update passes its own (the worker's current one)."""
    weight_decay: float = 0.0
    """L2 penalty added to the gradient; decoupled decay for adamw."""
    maximize: bool = False

    @pydantic.model_validator(mode="before")
    @classmethod
    def _rule_fields(cls, data: Any) -> Any:
        """The rule's own hyper-parameters, validated by it and given its defaults (extra fields of the spec)."""
        if not isinstance(data, dict) or "kind" not in data:
            return data
        rule = row_optimizers.get(data["kind"])
        own = dict(rule.hyper.model_fields)
        hyper, common = {}, {}
        for key, value in data.items():
            if key in _COMMON:
                common[key] = value
            elif key in own:
                hyper[key] = value
            elif not _default_elsewhere(key, value):
                reads = sorted({*_COMMON, *own} - {"kind"})
                if not any(key in r.hyper.model_fields for r in row_optimizers.all_rules()):
                    raise ValueError(
                        f"field '{key}': no optimizer kind has this hyper-parameter (kind '{rule.name}' reads {reads})"
                    )
                raise ValueError(f"{key} does not apply to optimizer kind '{rule.name}' (it reads {reads})")
        try:
            checked = rule.hyper.model_validate(hyper)
        except pydantic.ValidationError as err:
            raise ValueError(_error_parts(err)) from None
        return {**common, **checked.model_dump()}

    @pydantic.model_validator(mode="after")
    def _check(self) -> OptimizerSpec:
        for name in ("lr", "weight_decay"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        return self

    @property
    def rule(self) -> row_optimizers.RowOptimizer:
        """The :class:`~fleet.sparse.row_optimizers.RowOptimizer` this spec configures."""
        return row_optimizers.get(self.kind)

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
        if not isinstance(optimizer_class, type):
            raise ValueError(f"optimizer_class must be a class, got {optimizer_class!r}")
        g = param_group
        common = {
            "lr": number(g, "lr", 0.0),
            "weight_decay": number(g, "weight_decay", 0.0),
            "maximize": bool(g.get("maximize")),
        }
        for rule in row_optimizers.all_rules():
            own = rule.from_torch(optimizer_class, g, rows, where)
            if own is not None:
                return cls(kind=rule.name, **own, **common)
        supported = [n for rule in row_optimizers.all_rules() for n in rule.torch_names]
        raise ValueError(
            f"optimizer {optimizer_class.__name__} is not supported {where}; supported: {', '.join(supported)}"
        )

    def to_config(self) -> dict[str, Any]:
        """JSON-able dict holding only the fields this kind reads (``from_config`` inverts it)."""
        return self.model_dump(mode="json")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> OptimizerSpec:
        """Inverse of :meth:`to_config`; a bad config raises ``ValueError`` naming the field."""
        return _validate(cls, "optimizer", config)


def _default_elsewhere(key: str, value: Any) -> bool:
    """Whether ``key`` is another rule's hyper-parameter given at its default (accepted and dropped, as always)."""
    for rule in row_optimizers.all_rules():
        field = rule.hyper.model_fields.get(key)
        if field is not None and not field.is_required():
            default = field.default
            if value == default or (isinstance(default, tuple) and isinstance(value, list) and tuple(value) == default):
                return True
    return False


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
    kernels.uniform_rows(ids.contiguous().numpy(), _seed_key(seed), float(init.low), init.high - init.low, out.numpy())
    return out


@functools.lru_cache(maxsize=64)
def _seed_key(seed: int) -> int:
    """_uniform01's key for stream 0 (every new row of a table asks for its table's; a few big-int steps each)."""
    return _signed(_mix_int(seed * _GAMMA + 1))


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
    if ids.dtype is not torch.int64:
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
    """Applies one :class:`OptimizerSpec` to parameter blocks and their state tensors, in plain torch.

    ``update`` is called with ``step`` either as an ``int`` (dense: every
    element is on the same step, and the code is torch's single-tensor path
    line by line) or as an int64 tensor ``[rows]`` (row-wise: each row's own
    step count, already incremented for this update). The math is the spec's rule's
    (:mod:`fleet.sparse.row_optimizers`); this applies what every rule shares (``maximize``, weight decay).
    """

    def __init__(self, spec: OptimizerSpec) -> None:
        self.spec = spec
        self.rule = spec.rule
        self.state_names: tuple[str, ...] = self.rule.state_names(spec)
        #: columns of each state tensor: None for one per element, else that many (1: row-wise Adagrad)
        self.state_width = self.rule.state_width(spec)
        # Whether updates read the step count (momentum's first step, Adam's bias correction, Adagrad's
        # lr decay). When False, ``update`` accepts any step value, so callers may skip counting.
        self.needs_step = self.rule.needs_step(spec)

    def fill_new_state(self, state: dict[str, torch.Tensor]) -> None:
        """Set freshly created state (slices of the state tensors) to its initial value."""
        for name, t in state.items():
            t.fill_(self.rule.initial_state(self.spec, name))

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
        if s.weight_decay != 0 and not self.rule.decoupled_weight_decay:
            g = g.add(param, alpha=s.weight_decay)
        self.rule.update(s, param, g, state, step, lr)


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
