"""One server's shard of the job's dense parameters, as a flat float32 vector.

Why flat: the worker flattens all dense parameters into one vector and shards
it across servers by size, so a server's piece has no tensor structure, and
the update rules are element-wise anyway. Keeping one contiguous vector lets
the server send it and apply a pushed gradient without any reshaping or copy.

Every operation is all-or-nothing. An update that changes the values with one in-place op
(plain SGD) runs in place; any other (optimizer state, or pieces updated one by one) runs
on copies that replace the live tensors only once complete, so a failure -- an allocation
when memory runs out -- leaves the table as it was. The copies cost one more pass over the
shard's values and state per update.
"""

from __future__ import annotations

from typing import Any

import torch

from fleet.sparse.optim import (
    OptimizerSpec,
    ServerOptimizer,
    check_saved_optimizer,
    check_table_config,
    optimizer_config_json,
)

_CONFIG_KEYS = ("size", "optimizer", "pieces")
_REQUIRED = ("size", "optimizer")


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

    ``pieces``: the ``[lo, hi)`` slices of this vector that belong to one parameter each
    (default: one piece, the whole vector). A gradient may leave pieces out (parameters no
    worker has a gradient for: frozen, or unused this step); like ``torch.optim``, which
    skips a parameter whose ``.grad`` is None, the table then leaves their values and
    optimizer state alone, and each piece keeps its own step count (Adam's bias correction).

    Not thread-safe: the server applies requests to a table one at a time.
    """

    def __init__(
        self,
        size: int,
        optimizer: OptimizerSpec,
        init: torch.Tensor | None = None,
        pieces: list[tuple[int, int]] | None = None,
    ) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"size must be an int >= 0, got {size!r}")
        if not isinstance(optimizer, OptimizerSpec):
            raise TypeError(f"optimizer must be an OptimizerSpec, got {type(optimizer).__name__}")
        self.size = size
        self.optimizer = optimizer
        self.pieces = _check_pieces(pieces, size)
        self._opt = ServerOptimizer(optimizer)
        self._values = torch.zeros(size, dtype=torch.float32)
        self._state = {name: torch.zeros(size, dtype=torch.float32) for name in self._opt.state_names}
        self._opt.fill_new_state(self._state)
        self._step = 0
        self._piece_steps = [0] * len(self.pieces)
        if init is not None:
            self.set(init)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> DenseTable:
        """Build from ``{"size": int, "optimizer": {...}}`` (an :meth:`OptimizerSpec.to_config` dict)."""
        check_table_config("dense", config, _CONFIG_KEYS, _REQUIRED)
        size = config["size"]
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"dense table config: 'size' must be an int >= 0, got {size!r}")
        try:
            spec = OptimizerSpec.from_config(config["optimizer"])
        except ValueError as err:
            raise ValueError(f"dense table config: 'optimizer': {err}") from None
        pieces = config.get("pieces")
        return cls(size, spec, pieces=[tuple(p) for p in pieces] if pieces is not None else None)

    @property
    def step(self) -> int:
        """Number of gradients applied so far."""
        return self._step

    def pull(self) -> torch.Tensor:
        """The live value vector (flat, float32, contiguous) — not a copy.

        The server serialises it straight onto the wire, so copying here would
        only cost bandwidth. The tensor is updated in place by later
        ``add_delta``/``set`` calls (``apply_gradient`` may replace it instead): send or
        clone it before the next update, and never write to it.
        """
        return self._values

    def set(self, values: torch.Tensor) -> None:
        """Overwrite the values (the job's initial parameters, sent by worker 0)."""
        self._values.copy_(_check_vector("values", values, self.size))

    def apply_gradient(self, grad: torch.Tensor, lr: float, present: list[bool] | None = None) -> None:
        """One optimizer step with the worker's current learning rate ``lr``.

        ``present``: per piece, whether it has a gradient (None: all of them).
        """
        g = _check_vector("grad", grad, self.size)
        steps = list(self._piece_steps)
        whole = (present is None or all(present)) and all(s == steps[0] for s in steps)
        if not whole and present is not None and len(present) != len(self.pieces):
            raise ValueError(f"dense table: {len(present)} presence flags for {len(self.pieces)} pieces")
        if whole and not self._state:  # one in-place op: all-or-nothing as it is
            self._opt.update(self._values, g, self._state, steps[0] + 1 if steps else self._step + 1, float(lr))
        else:
            values = self._values.clone()
            state = {name: t.clone() for name, t in self._state.items()}
            if whole:
                self._opt.update(values, g, state, steps[0] + 1 if steps else self._step + 1, float(lr))
            else:
                self._update_pieces(values, g, state, steps, present, float(lr))
            self._values, self._state = values, state
        self._piece_steps = [s + 1 for s in steps] if whole else steps
        self._step += 1

    def _update_pieces(
        self,
        values: torch.Tensor,
        g: torch.Tensor,
        state: dict,
        steps: list[int],
        present: list[bool] | None,
        lr: float,
    ) -> None:
        """Runs of consecutive present pieces on the same step: one update each (``steps`` advance in place)."""
        index = 0
        while index < len(self.pieces):
            if present is not None and not present[index]:
                index += 1
                continue
            end = index + 1
            while end < len(self.pieces) and (present is None or present[end]) and steps[end] == steps[index]:
                end += 1
            lo, hi = self.pieces[index][0], self.pieces[end - 1][1]
            piece_state = {name: t[lo:hi] for name, t in state.items()}
            self._opt.update(values[lo:hi], g[lo:hi], piece_state, steps[index] + 1, lr)
            for k in range(index, end):
                steps[k] += 1
            index = end

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
            "piece_steps": torch.tensor(self._piece_steps, dtype=torch.int64),
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
        check_saved_optimizer("dense", state, self.optimizer)
        for name in self._opt.state_names:
            if f"state.{name}" not in state:
                raise ValueError(f"dense table state_dict: missing optimizer state 'state.{name}'")
        # Checked and copied aside first; swapped in only when all of it is there.
        values = _check_vector("values", state["values"], self.size).clone()
        new_state = {
            name: _check_vector(f"state.{name}", state[f"state.{name}"], self.size).clone() for name in self._state
        }
        step = int(state["step"])
        steps = state.get("piece_steps")
        if steps is not None and len(steps) == len(self.pieces):
            piece_steps = [int(s) for s in steps]
        else:  # a checkpoint from before per-parameter steps: every piece took every step
            piece_steps = [step] * len(self.pieces)
        self._values, self._state, self._step, self._piece_steps = values, new_state, step, piece_steps


def _check_pieces(pieces: list[tuple[int, int]] | None, size: int) -> list[tuple[int, int]]:
    """Consecutive [lo, hi) slices that cover [0, size) exactly."""
    if pieces is None:
        return [(0, size)] if size else []
    expected = 0
    for piece in pieces:
        if len(piece) != 2 or piece[0] != expected or not piece[0] < piece[1] <= size:
            raise ValueError(f"dense table: pieces {pieces} do not cut [0, {size}) into consecutive slices")
        expected = piece[1]
    if expected != size:
        raise ValueError(f"dense table: pieces {pieces} do not cover [0, {size})")
    return [(int(lo), int(hi)) for lo, hi in pieces]
