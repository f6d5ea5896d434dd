"""Which processes a node runs and the environment each one gets.

Pure functions over a :class:`~fleet.launch.config.LaunchConfig` and a
:class:`JobLayout` (addresses and secret), so the variables every child sees
can be tested without starting anything. Variables are set only through the
names in :mod:`fleet.runtime.env`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from fleet.launch.config import LaunchConfig
from fleet.runtime import env

WORKER = "worker"
SERVER = "server"


@dataclass(frozen=True)
class ProcessSpec:
    """One process of the job on this node."""

    role: str  # WORKER or SERVER
    rank: int  # index within its role, over all nodes
    local_rank: int  # index on this node: workers 0..W-1, then servers W..W+S-1

    @property
    def label(self) -> str:
        return f"{self.role} {self.rank}"

    @property
    def key(self) -> str:
        return f"{self.role}.{self.rank}"


@dataclass(frozen=True)
class JobLayout:
    """Where the job's peers meet, shared by every process (and every node)."""

    master: str  # "host:port" of the rendezvous store, hosted by worker 0
    server_endpoints: tuple[str, ...]  # every server of the job, server index order
    secret: str


def local_specs(config: LaunchConfig) -> list[ProcessSpec]:
    """This node's processes: servers first (workers connect to them), then workers."""
    servers = [ProcessSpec(SERVER, config.first_server + j, config.workers + j) for j in range(config.servers)]
    workers = [ProcessSpec(WORKER, config.first_worker + i, i) for i in range(config.workers)]
    return servers + workers


def child_env(
    spec: ProcessSpec,
    config: LaunchConfig,
    layout: JobLayout,
    *,
    restart_count: int,
    log_dir: str,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The full environment of one child process."""
    values = {
        env.FLEET_ROLE: spec.role,
        env.FLEET_WORKER_INDEX: str(spec.rank if spec.role == WORKER else -1),
        env.FLEET_WORKER_NUM: str(config.world_workers),
        env.FLEET_SERVER_INDEX: str(spec.rank if spec.role == SERVER else -1),
        env.FLEET_SERVER_NUM: str(config.world_servers),
        env.FLEET_SERVER_ENDPOINTS: ",".join(layout.server_endpoints),
        env.FLEET_MASTER: layout.master,
        env.FLEET_SECRET: layout.secret,
        env.FLEET_LOG_DIR: log_dir,
        env.FLEET_RESTART_COUNT: str(restart_count),
        env.FLEET_MAX_RESTARTS: str(config.max_restarts),
        env.FLEET_LOCAL_RANK: str(spec.local_rank),
        env.PYTHONUNBUFFERED: "1",
    }
    if spec.role == WORKER:
        values.update(torchrun_variables(spec, config, layout))
    inherited = os.environ if base is None else base
    dropped = {env.TORCHELASTIC_USE_AGENT_STORE}  # fleet's store is worker 0's, never an outer torchrun agent's
    if config.strategy is not None:
        values[env.FLEET_STRATEGY_FILE] = str(config.strategy.path)
        dropped.add(env.FLEET_STRATEGY)  # --strategy wins over a strategy inherited as JSON (read first otherwise)
    if spec.role == SERVER:
        dropped.update(env.TORCHRUN_VARIABLES)  # a server is no rank of torchrun's world, not even an outer one's
    here = config.workers + config.servers  # the job's processes on this node
    # Whether a waiting worker may spin before it sleeps depends on every process of the job here, servers
    # included (fleet.collective.shm.spinning_pays)
    values[env.FLEET_LOCAL_PROCESSES] = str(here)
    if env.OMP_NUM_THREADS not in inherited:
        # Like torchrun: without this each process starts one thread per core and they thrash.
        values[env.OMP_NUM_THREADS] = str(max(1, (os.cpu_count() or 1) // here))
    base = {k: v for k, v in inherited.items() if k not in dropped}
    return env.child_environment(base, **values)


def torchrun_variables(spec: ProcessSpec, config: LaunchConfig, layout: JobLayout) -> dict[str, str]:
    """torchrun's variables for a worker, with torchrun's meaning over the job's workers (servers excluded).

    MASTER_ADDR:MASTER_PORT is the job's rendezvous store (hosted by worker 0), as under torchrun.
    Parameter-server workers get them too (LOCAL_RANK picks a GPU in every mode), although they have
    no process group: a script whose own distributed mode they switch on is refused by the strategy,
    naming the init_process_group call (docs/migrating-from-ddp.md).
    """
    host, port = env.split_endpoint(layout.master)
    return {
        env.RANK: str(spec.rank),
        env.LOCAL_RANK: str(spec.local_rank),
        env.WORLD_SIZE: str(config.world_workers),
        env.LOCAL_WORLD_SIZE: str(config.workers),
        env.GROUP_RANK: str(config.node_rank),
        env.MASTER_ADDR: host,
        env.MASTER_PORT: str(port),
    }
