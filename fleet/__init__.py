"""fleet: Fleet-style distributed training for PyTorch.

    import fleet
    fleet.init()
    opt = fleet.distributed_optimizer(opt, strategy)
    loader = fleet.distributed_loader(loader)

Names load on first use (PEP 562), so ``fleetrun`` (fleet.launch) starts without
importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fleet.runtime.excepthook import install_excepthook as _install_excepthook

__version__ = "0.1.0"

_EXPORTS = {
    "DistributedStrategy": "fleet.strategy",
    "StrategyError": "fleet.errors",
    "EnvError": "fleet.runtime.env",
    "FleetError": "fleet.errors",
    "DiskFullError": "fleet.errors",
    "ModelMismatchError": "fleet.errors",
    "PeerError": "fleet.errors",
    "StoreTamperedError": "fleet.errors",
    "PaddleCloudRoleMaker": "fleet.roles",
    "Role": "fleet.roles",
    "RoleInfo": "fleet.roles",
    "UserDefinedRoleMaker": "fleet.roles",
    "Strategy": "fleet.strategies",
    "register_strategy": "fleet.strategies",
    "barrier_worker": "fleet.api",
    "distributed_loader": "fleet.api",
    "distributed_model": "fleet.api",
    "distributed_optimizer": "fleet.api",
    "init": "fleet.api",
    "init_server": "fleet.api",
    "run_server": "fleet.api",
    "save": "fleet.checkpoint",
    "save_persistables": "fleet.checkpoint",
    "load_persistables": "fleet.checkpoint",
    "save_checkpoint": "fleet.checkpoint",
    "load_checkpoint": "fleet.checkpoint",
    "is_first_worker": "fleet.api",
    "join": "fleet.api",
    "is_server": "fleet.api",
    "is_worker": "fleet.api",
    "role_info": "fleet.api",
    "server_endpoints": "fleet.api",
    "shrink": "fleet.api",
    "CountFilterEntry": "fleet.sparse.lifecycle",
    "export_for_inference": "fleet.export",
    "load_for_inference": "fleet.export",
    "ProbabilityEntry": "fleet.sparse.lifecycle",
    "server_index": "fleet.api",
    "server_num": "fleet.api",
    "stop_worker": "fleet.api",
    "worker_index": "fleet.api",
    "local_rank": "fleet.api",
    "worker_num": "fleet.api",
    "progress": "fleet.telemetry.progress",
    "report": "fleet.api",
    "file_shard": "fleet.data.files",
    "SlotDataset": "fleet.data.slot_dataset",
}

__all__ = sorted(_EXPORTS)

PUBLIC_MODULES = ("metrics", "nn")
"""Documented submodules reachable as ``fleet.<name>`` (Paddle's ``fleet.metrics``; ``fleet.nn``)."""


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        if name in PUBLIC_MODULES:
            return importlib.import_module(f"fleet.{name}")
        raise AttributeError(
            f"module 'fleet' has no attribute {name!r}; its public names are fleet.__all__ and the submodules "
            f"{', '.join(PUBLIC_MODULES)} (the other packages are internal: import them by their full name)"
        )
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(_EXPORTS) | set(PUBLIC_MODULES) | {n for n in globals() if n.startswith("__")})


if TYPE_CHECKING:
    from fleet.api import (  # noqa: F401
        barrier_worker,
        distributed_loader,
        distributed_model,
        distributed_optimizer,
        init,
        init_server,
        is_first_worker,
        is_server,
        is_worker,
        join,
        local_rank,
        report,
        role_info,
        run_server,
        server_endpoints,
        server_index,
        server_num,
        shrink,
        stop_worker,
        worker_index,
        worker_num,
    )
    from fleet.checkpoint import (  # noqa: F401
        load_checkpoint,
        load_persistables,
        save,
        save_checkpoint,
        save_persistables,
    )
    from fleet.data.files import file_shard  # noqa: F401
    from fleet.data.slot_dataset import SlotDataset  # noqa: F401
    from fleet.errors import (  # noqa: F401
        DiskFullError,
        FleetError,
        ModelMismatchError,
        PeerError,
        StoreTamperedError,
        StrategyError,
    )
    from fleet.export import export_for_inference, load_for_inference  # noqa: F401
    from fleet.roles import PaddleCloudRoleMaker, Role, RoleInfo, UserDefinedRoleMaker  # noqa: F401
    from fleet.runtime.env import EnvError  # noqa: F401
    from fleet.sparse.lifecycle import CountFilterEntry, ProbabilityEntry  # noqa: F401
    from fleet.strategies import Strategy, register_strategy  # noqa: F401
    from fleet.strategy import DistributedStrategy  # noqa: F401
    from fleet.telemetry.progress import progress  # noqa: F401

_install_excepthook()
