"""Role and RoleInfo: who this process is in the job."""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, ConfigDict, model_validator


class Role(str, Enum):
    WORKER = "worker"
    SERVER = "server"


class RoleInfo(BaseModel):
    """Everything fleet needs to know about this process's place in the job. Frozen."""

    model_config = ConfigDict(frozen=True)

    role: Role = Role.WORKER
    worker_index: int = 0
    worker_num: int = 1
    server_index: int = -1
    """-1 on workers."""
    server_num: int = 0
    server_endpoints: tuple[str, ...] = ()
    """host:port of each server, in server index order; empty until exchanged under rank-only launchers."""
    master: str | None = None
    """host:port of the rendezvous store; None for a single process."""
    rank: int = 0
    """This process's rank among all processes the launcher started (servers first under rank-only launchers)."""
    world_size: int = 1
    local_rank: int = 0
    source: str = "single"
    """Which convention this came from: user, fleetrun, paddle, torchrun, mpi, slurm or single."""
    external_store: bool = False
    """True when the launcher (torchrun's agent) already hosts the rendezvous store at ``master``."""

    @model_validator(mode="after")
    def _consistent(self) -> RoleInfo:
        if self.worker_num < 1:
            raise ValueError(f"worker_num({self.worker_num}) must be at least 1")
        if self.server_num < 0:
            raise ValueError(f"server_num({self.server_num}) must not be negative")
        if self.role is Role.WORKER and not 0 <= self.worker_index < self.worker_num:
            raise ValueError(f"worker_index({self.worker_index}) must be below worker_num({self.worker_num})")
        if self.role is Role.SERVER and not 0 <= self.server_index < self.server_num:
            raise ValueError(f"server_index({self.server_index}) must be below server_num({self.server_num})")
        if self.server_endpoints and len(self.server_endpoints) != self.server_num:
            raise ValueError(
                f"{len(self.server_endpoints)} server endpoints were given for server_num({self.server_num})"
            )
        return self

    @property
    def is_worker(self) -> bool:
        return self.role is Role.WORKER

    @property
    def is_server(self) -> bool:
        return self.role is Role.SERVER

    @property
    def is_first_worker(self) -> bool:
        return self.is_worker and self.worker_index == 0

    @property
    def name(self) -> str:
        """ "worker 1" or "server 0": how messages name a process."""
        index = self.worker_index if self.is_worker else self.server_index
        return f"{self.role.value} {index}"
