"""The native kernels of the sparse-table engine (``fleet/sparse/csrc/``), and the checks in front of them.

The kernels take buffers (``tensor.numpy()``: zero copy), never torch tensors, so the build does
not depend on torch. Each tensor is checked here first (a torch tensor, on the CPU, of the
expected dtype and dimensions, contiguous), so that a mistake names the argument at fault; the
kernels check element type, dimensions, contiguity, lengths and slot bounds again and raise
rather than crash. They run with the GIL released.

Built by ``pip install -e .`` / ``pip wheel .``; in a source tree used with ``PYTHONPATH=$PWD``,
``python setup.py build_ext --inplace`` builds (or rebuilds, after a change under ``csrc/``) the
module next to its source (docs/development.md).

The compiled module is optional (fleet installs without a compiler, setup.py): it is imported on
first use, through :data:`kernels`, so a collective or sharding job without sparse tables never
loads it. Whoever needs it -- a ``fleet.nn.SparseEmbedding``, a parameter-server job -- calls
:func:`require` first, and a missing or stale build is a :class:`NativeEngineError` naming the
command that builds it, at the line that asked, rather than an ``ImportError`` at ``import fleet``.
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from fleet.errors import FleetError

#: the kernels' interface version this Python code was written for (kAbiVersion in csrc/module.cpp)
ABI_VERSION = 13
_COMPILER = "a C++17 compiler and the Python headers (Debian/Ubuntu: `apt-get install g++ python3-dev`)"


class NativeEngineError(FleetError, ImportError):
    """fleet's native sparse-table engine is not built here, or is a stale build (sparse tables and
    parameter-server jobs need it; collective and sharding jobs without sparse tables do not)."""


def build_command() -> str:
    """The command that (re)builds the engine for this installation of fleet, quoted for a message."""
    root = Path(__file__).resolve().parents[2]
    if (root / "setup.py").is_file() and (root / "fleet" / "sparse" / "csrc").is_dir():  # a source tree
        return (
            f"`pip install --force-reinstall --no-deps -e {root}` (or, with the tree on PYTHONPATH, "
            f"`python setup.py build_ext --inplace` in {root})"
        )
    return f"`pip install --force-reinstall --no-deps {_installed_from() or 'fleet'}`"


def _installed_from() -> str | None:
    """What pip installed this fleet from (its direct_url.json, PEP 610): a path or URL, or None."""
    try:
        dist = metadata.distribution("fleet")
        if Path(str(dist.locate_file("fleet"))).resolve() != Path(__file__).resolve().parents[1]:
            return None  # that distribution is another installation of fleet than this one
        url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
    except (metadata.PackageNotFoundError, ValueError, OSError):
        return None
    if url.startswith("file:"):
        return urllib.request.url2pathname(urllib.parse.urlparse(url).path)
    return url or None


_module: Any = None


def load(what: str = "This use of a sparse table") -> Any:
    """The compiled module, imported on the first call; :class:`NativeEngineError` if it is missing or stale.

    ``what``: who needs it, for the message ("fleet.nn.SparseEmbedding", "A parameter-server job").
    """
    global _module
    if _module is not None:
        return _module
    try:
        from fleet.sparse import _native as module
    except ImportError as err:  # installed without a compiler, or a source tree never built
        raise NativeEngineError(
            f"{what} needs fleet's native sparse-table engine, which is not built in this installation ({err}). "
            f"Collective and sharding jobs without sparse tables run without it. To build it, install {_COMPILER}, "
            f"then run {build_command()}."
        ) from err
    if module.abi_version() != ABI_VERSION:
        raise NativeEngineError(
            f"fleet's native sparse-table engine ({module.__file__}) is a stale build (interface "
            f"{module.abi_version()}, this code needs {ABI_VERSION}): rebuild it with {build_command()}."
        )
    _module = module
    return module


def require(what: str) -> None:
    """Raise :class:`NativeEngineError` naming ``what`` and the build command unless the engine loads."""
    load(what)


class _Kernels:
    """The compiled module's functions, the module imported on the first one used (:func:`load`)."""

    def __getattr__(self, name: str) -> Any:
        value = getattr(load(), name)
        self.__dict__[name] = value  # later calls find it here: no cost on the hot path
        return value


kernels: Any = _Kernels()
"""``kernels.apply_rows(...)`` and the rest of ``fleet/sparse/csrc/module.cpp``'s functions."""


def buf(t: Any, name: str, dtype: torch.dtype, ndim: int, strided: bool = False) -> Any:
    """``t`` as a zero-copy buffer for a kernel, after checking that it is what the kernel expects.

    ``strided``: rows may lie apart (a field of :mod:`fleet.sparse.records`), each row's elements adjacent.
    """
    # Every kernel call passes several buffers through here: what passes every check below takes the fewest
    # calls into torch (the checks are the same; a tensor that fails one goes the long way, to its message).
    if type(t) is torch.Tensor and t.dtype is dtype and t.is_cpu and ndim in (1, 2) and t.dim() == ndim:
        if strided:
            stride = t.stride()
            if stride[0] > 0 and (ndim == 1 or stride[1] == 1 or t.shape[1] <= 1) and not t.requires_grad:
                return t.numpy()
        elif not t.requires_grad and t.is_contiguous():
            return t.numpy()
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
