"""One server's shard of the job's dense parameters, as a flat float32 vector.

Why flat: the worker flattens all dense parameters into one vector and shards
it across servers by size, so a server's piece has no tensor structure, and
the update rules are element-wise anyway. Keeping one contiguous vector lets
the server send it and apply a pushed gradient without any reshaping or copy.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from fleet.ps.optim import OptimizerSpec, ServerOptimizer, check_table_config, optimizer_config_json

_CONFIG_KEYS = ("size", "optimizer")


def _check_vector(name: str, t: torch.Tensor, size: int) -> torch.Tensor:
    """Shape-check a pushed vector; accept any float dtype and return float32."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.numel() != size or t.dim() != 1:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({size},) for this dense table")
    if not t.dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    return t.to(torch.float32)


class DenseTable:
    """A flat float32 vector plus the optimizer state to update it, for one server.

    Not thread-safe: the server applies requests to a table one at a time.
    """

    def __init__(self, size: int, optimizer: OptimizerSpec, init: torch.Tensor | None = None) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"size must be an int >= 0, got {size!r}")
        if not isinstance(optimizer, OptimizerSpec):
            raise TypeError(f"optimizer must be an OptimizerSpec, got {type(optimizer).__name__}")
        self.size = size
        self.optimizer = optimizer
        self._opt = ServerOptimizer(optimizer)
        self._values = torch.zeros(size, dtype=torch.float32)
        self._state = {name: torch.zeros(size, dtype=torch.float32) for name in self._opt.state_names}
        self._opt.fill_new_state(self._state)
        self._step = 0
        if init is not None:
            self.set(init)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> DenseTable:
        """Build from ``{"size": int, "optimizer": {...}}`` (an :meth:`OptimizerSpec.to_config` dict)."""
        check_table_config("dense", config, _CONFIG_KEYS, _CONFIG_KEYS)
        size = config["size"]
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"dense table config: 'size' must be an int >= 0, got {size!r}")
        try:
            spec = OptimizerSpec.from_config(config["optimizer"])
        except ValueError as err:
            raise ValueError(f"dense table config: 'optimizer': {err}") from None
        return cls(size, spec)

    @property
    def step(self) -> int:
        """Number of gradients applied so far."""
        return self._step

    def pull(self) -> torch.Tensor:
        """The live value vector (flat, float32, contiguous) — not a copy.

        The server serialises it straight onto the wire, so copying here would
        only cost bandwidth. The tensor is updated in place by later
        ``apply_gradient``/``add_delta``/``set`` calls: send or clone it before
        the next update, and never write to it.
        """
        return self._values

    def set(self, values: torch.Tensor) -> None:
        """Overwrite the values (the job's initial parameters, sent by worker 0)."""
        self._values.copy_(_check_vector("values", values, self.size))

    def apply_gradient(self, grad: torch.Tensor, lr: float) -> None:
        """One optimizer step with the worker's current learning rate ``lr``."""
        g = _check_vector("grad", grad, self.size)
        self._step += 1
        self._opt.update(self._values, g, self._state, self._step, float(lr))

    def add_delta(self, delta: torch.Tensor) -> None:
        """Geo mode: add a worker's parameter change since its last sync; optimizer state untouched."""
        self._values.add_(_check_vector("delta", delta, self.size))

    def state_dict(self) -> dict[str, torch.Tensor | int | float | str]:
        """Copies of values and optimizer state, plus the step and optimizer config (JSON)."""
        out: dict[str, torch.Tensor | int | float | str] = {
            "size": self.size,
            "step": self._step,
            "optimizer": optimizer_config_json(self.optimizer),
            "values": self._values.clone(),
        }
        for name, t in self._state.items():
            out[f"state.{name}"] = t.clone()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the size and optimizer kind must match this table's."""
        for key in ("size", "step", "values"):
            if key not in state:
                raise ValueError(f"dense table state_dict: missing key '{key}'")
        if int(state["size"]) != self.size:
            raise ValueError(f"dense table state_dict has size {state['size']}, this table has size {self.size}")
        if "optimizer" in state:
            kind = json.loads(state["optimizer"]).get("kind")
            if kind != self.optimizer.kind:
                raise ValueError(
                    f"dense table state_dict is for optimizer '{kind}', this table uses '{self.optimizer.kind}'"
                )
        for name in self._opt.state_names:
            if f"state.{name}" not in state:
                raise ValueError(f"dense table state_dict: missing optimizer state 'state.{name}'")
        self._values.copy_(_check_vector("values", state["values"], self.size))
        for name, t in self._state.items():
            t.copy_(_check_vector(f"state.{name}", state[f"state.{name}"], self.size))
        self._step = int(state["step"])
