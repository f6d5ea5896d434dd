"""Role makers, Paddle's way of telling fleet.init who this process is."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fleet.roles.detect import detect
from fleet.roles.role import Role, RoleInfo
from fleet.runtime import env


class RoleMaker:
    """Produces a RoleInfo; ``fleet.init(role_maker=...)`` uses it instead of detection."""

    def role_info(self, servers: int = 0) -> RoleInfo:
        raise NotImplementedError


class UserDefinedRoleMaker(RoleMaker):
    """Explicit role, for scripts that know their place without a launcher."""

    def __init__(
        self,
        role: Role = Role.WORKER,
        current_id: int = 0,
        worker_num: int = 1,
        server_endpoints: Sequence[str] = (),
        master: str | None = None,
    ):
        endpoints = tuple(env.parse_endpoint("server_endpoints", e) for e in server_endpoints)
        is_worker = Role(role) is Role.WORKER
        self._info = RoleInfo(
            role=Role(role),
            worker_index=current_id if is_worker else 0,
            worker_num=worker_num,
            server_index=-1 if is_worker else current_id,
            server_num=len(endpoints),
            server_endpoints=endpoints,
            master=master,
            rank=current_id if is_worker else worker_num + current_id,
            world_size=worker_num + len(endpoints),
            source="user",
        )

    def role_info(self, servers: int = 0) -> RoleInfo:
        return self._info


class PaddleCloudRoleMaker(RoleMaker):
    """Detect the role from the environment (any supported launcher, Paddle's included)."""

    def __init__(self, is_collective: bool = False, environ: Mapping[str, str] | None = None):
        self.is_collective = is_collective
        self._reader = env.EnvReader(environ) if environ is not None else None

    def role_info(self, servers: int = 0) -> RoleInfo:
        return detect(self._reader, servers=servers)
