"""fleet: Fleet-style distributed training for PyTorch.

    import fleet
    fleet.init()
    opt = fleet.distributed_optimizer(opt, strategy)
    loader = fleet.distributed_loader(loader)
"""

from fleet import errors as _errors
from fleet.api import (
    barrier_worker,
    distributed_loader,
    distributed_model,
    distributed_optimizer,
    init,
    init_server,
    is_first_worker,
    is_server,
    is_worker,
    role_info,
    run_server,
    server_endpoints,
    server_index,
    server_num,
    stop_worker,
    worker_index,
    worker_num,
)
from fleet.env import EnvError
from fleet.errors import FleetError, ModelMismatchError, PeerError
from fleet.roles import PaddleCloudRoleMaker, Role, RoleInfo, UserDefinedRoleMaker
from fleet.strategies import Strategy, register_strategy
from fleet.strategy import DistributedStrategy, StrategyError
from fleet import nn
from fleet.usererrors import install_excepthook as _install_excepthook

__version__ = "0.1.0"

__all__ = [
    "DistributedStrategy",
    "EnvError",
    "FleetError",
    "ModelMismatchError",
    "PaddleCloudRoleMaker",
    "PeerError",
    "Role",
    "RoleInfo",
    "Strategy",
    "StrategyError",
    "UserDefinedRoleMaker",
    "barrier_worker",
    "distributed_loader",
    "distributed_model",
    "distributed_optimizer",
    "init",
    "init_server",
    "is_first_worker",
    "is_server",
    "is_worker",
    "register_strategy",
    "role_info",
    "run_server",
    "server_endpoints",
    "server_index",
    "server_num",
    "stop_worker",
    "worker_index",
    "worker_num",
]

_install_excepthook()
del _errors
