"""The native kernels of the sparse-table engine (``fleet/sparse/csrc/``), and the checks in front of them.

The kernels take buffers (``tensor.numpy()``: zero copy), never torch tensors, so the build does
not depend on torch. Each tensor is checked here first (a torch tensor, on the CPU, of the
expected dtype and dimensions, contiguous), so that a mistake names the argument at fault; the
kernels check element type, dimensions, contiguity, lengths and slot bounds again and raise
rather than crash. They run with the GIL released.

Built by ``pip install -e .`` / ``pip wheel .``; in a source tree used with ``PYTHONPATH=$PWD``,
``python setup.py build_ext --inplace`` builds (or rebuilds, after a change under ``csrc/``) the
module next to its source (docs/development.md).
"""

from __future__ import annotations

from typing import Any

import torch

#: the kernels' interface version this Python code was written for (kAbiVersion in csrc/module.cpp)
ABI_VERSION = 8
_REBUILD = "python setup.py build_ext --inplace"

try:
    from fleet.sparse import _native as kernels
except ImportError as err:  # not built: a source tree used without an install
    raise ImportError(
        f"fleet's native sparse-table engine is not built ({err}). In a source tree, build it in place with "
        f"`{_REBUILD}` (needs g++ and the Python headers), or install fleet with `pip install -e .`"
    ) from err
if kernels.abi_version() != ABI_VERSION:
    raise ImportError(
        f"fleet's native sparse-table engine ({kernels.__file__}) is a stale build (interface "
        f"{kernels.abi_version()}, this code needs {ABI_VERSION}): rebuild it with `{_REBUILD}` or `pip install -e .`"
    )


def buf(t: Any, name: str, dtype: torch.dtype, ndim: int, strided: bool = False) -> Any:
    """``t`` as a zero-copy buffer for a kernel, after checking that it is what the kernel expects.

    ``strided``: rows may lie apart (a field of :mod:`fleet.sparse.records`), each row's elements adjacent.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got a tensor on {t.device}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if strided:
        if any(st <= 0 for st in t.stride()[:1]) or (ndim == 2 and t.shape[1] > 1 and t.stride(1) != 1):
            raise ValueError(f"{name} must have rows of adjacent elements, got strides {t.stride()}")
    elif not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return t.detach().numpy()


def native_hyper(spec: Any, lr: float) -> tuple:
    """An :class:`~fleet.sparse.optim.OptimizerSpec` as ``apply_rows`` takes it: the rule's kernel entry, what every
    rule reads, and the rule's own hyper-parameters (:meth:`fleet.sparse.row_optimizers.RowOptimizer.native_params`)."""
    rule = spec.rule
    return (
        rule.native_kind,
        float(lr),
        float(spec.weight_decay),
        bool(spec.maximize),
        bool(rule.decoupled_weight_decay),
        tuple(float(v) for v in rule.native_params(spec)),
    )


def with_lr(hyper: tuple, lr: float) -> tuple:
    """A :func:`native_hyper` tuple for another learning rate (the spec's part is built once per table: reading a
    rule's hyper-parameters off the spec costs several microseconds, a push's kernel call a few)."""
    return (hyper[0], float(lr), *hyper[2:])
