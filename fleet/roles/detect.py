"""Find this process's role from the launcher's environment variables.

Order (the first convention whose marker variable is set wins):

1. fleetrun (``FLEET_ROLE``)
2. PaddlePaddle (``TRAINING_ROLE`` or ``PADDLE_TRAINER_ID``)
3. torchrun (``RANK`` and ``WORLD_SIZE``)
4. MPI (``OMPI_COMM_WORLD_RANK`` or ``PMI_RANK``)
5. Slurm (``SLURM_PROCID`` and ``SLURM_NTASKS``)
6. nothing: a single process, worker 0 of 1.

An explicit role maker passed to ``fleet.init`` comes before all of them.
"""

from __future__ import annotations

import hashlib

from fleet.roles.role import Role, RoleInfo
from fleet.runtime import env
from fleet.runtime.env import EnvError, EnvReader

DEFAULT_MASTER_PORT = 29500


def detect(reader: EnvReader | None = None, servers: int = 0) -> RoleInfo:
    """The RoleInfo of this process. ``servers`` splits rank-only launches into S servers + workers."""
    reader = reader or env.current()
    for marker, build in _CONVENTIONS:
        if marker(reader):
            return build(reader, servers)
    return RoleInfo()


# --- fleetrun -------------------------------------------------------------------


def _fleetrun(reader: EnvReader, servers: int) -> RoleInfo:
    role = _role(reader, env.FLEET_ROLE, {"worker": Role.WORKER, "server": Role.SERVER})
    worker_num = _count(reader, env.FLEET_WORKER_NUM, minimum=1)
    server_num = _count(reader, env.FLEET_SERVER_NUM, minimum=0, default=0)
    endpoints = reader.endpoints(env.FLEET_SERVER_ENDPOINTS)
    if server_num and len(endpoints) != server_num:
        raise EnvError(
            f"{env.FLEET_SERVER_ENDPOINTS}={reader.str(env.FLEET_SERVER_ENDPOINTS)!r} lists {len(endpoints)} "
            f"endpoints but {env.FLEET_SERVER_NUM}={server_num}."
        )
    master = reader.str(env.FLEET_MASTER)
    if master is not None:
        env.parse_endpoint(env.FLEET_MASTER, master)
    if role is Role.WORKER:
        index = _index(reader, env.FLEET_WORKER_INDEX, env.FLEET_WORKER_NUM, worker_num)
        server_index, rank = -1, index
    else:
        if server_num == 0:
            raise EnvError(f"{env.FLEET_ROLE}=server but {env.FLEET_SERVER_NUM} is 0 or not set.")
        index, server_index = 0, _index(reader, env.FLEET_SERVER_INDEX, env.FLEET_SERVER_NUM, server_num)
        rank = worker_num + server_index
    if worker_num > 1 and master is None and server_num == 0:
        raise EnvError(f"{env.FLEET_WORKER_NUM}={worker_num} but {env.FLEET_MASTER} (host:port) is not set.")
    return RoleInfo(
        role=role,
        worker_index=index,
        worker_num=worker_num,
        server_index=server_index,
        server_num=server_num,
        server_endpoints=endpoints,
        master=master,
        rank=rank,
        world_size=worker_num + server_num,
        local_rank=reader.int(env.FLEET_LOCAL_RANK, rank),
        source="fleetrun",
    )


# --- PaddlePaddle ------------------------------------------------------------------


def _paddle(reader: EnvReader, servers: int) -> RoleInfo:
    role = _role(reader, env.TRAINING_ROLE, {"TRAINER": Role.WORKER, "PSERVER": Role.SERVER}, default="TRAINER")
    worker_num = _count(reader, env.PADDLE_TRAINERS_NUM, minimum=1)
    server_endpoints = reader.endpoints(env.PADDLE_PSERVERS_IP_PORT_LIST)
    trainer_endpoints = reader.endpoints(env.PADDLE_TRAINER_ENDPOINTS)
    if role is Role.SERVER:
        if not server_endpoints:
            raise EnvError(f"{env.TRAINING_ROLE}=PSERVER needs {env.PADDLE_PSERVERS_IP_PORT_LIST}, which is not set.")
        here = f"{reader.require(env.POD_IP, 'a PSERVER needs its own address')}:" + reader.require(
            env.PADDLE_PORT, "a PSERVER needs its own port"
        )
        if here not in server_endpoints:
            raise EnvError(
                f"{env.POD_IP}:{env.PADDLE_PORT} = {here!r} is not in "
                f"{env.PADDLE_PSERVERS_IP_PORT_LIST}={','.join(server_endpoints)!r}."
            )
        server_index = server_endpoints.index(here)
        return RoleInfo(
            role=role,
            worker_num=worker_num,
            server_index=server_index,
            server_num=len(server_endpoints),
            server_endpoints=server_endpoints,
            rank=worker_num + server_index,
            world_size=worker_num + len(server_endpoints),
            source="paddle",
        )
    index = _index(reader, env.PADDLE_TRAINER_ID, env.PADDLE_TRAINERS_NUM, worker_num)
    master = None
    if not server_endpoints and worker_num > 1:
        if not trainer_endpoints:
            raise EnvError(
                f"{env.PADDLE_TRAINERS_NUM}={worker_num} for a collective job, but "
                f"{env.PADDLE_TRAINER_ENDPOINTS} (the trainers' host:port list) is not set."
            )
        if len(trainer_endpoints) != worker_num:
            raise EnvError(
                f"{env.PADDLE_TRAINER_ENDPOINTS} lists {len(trainer_endpoints)} endpoints but "
                f"{env.PADDLE_TRAINERS_NUM}={worker_num}."
            )
        master = trainer_endpoints[0]
    return RoleInfo(
        role=role,
        worker_index=index,
        worker_num=worker_num,
        server_num=len(server_endpoints),
        server_endpoints=server_endpoints,
        master=master,
        rank=index,
        world_size=worker_num + len(server_endpoints),
        source="paddle",
    )


# --- rank-only launchers: torchrun, MPI, Slurm ---------------------------------------


def _rank_only(reader, source, rank_var, size_var, local_var, servers, master, external_store=False):
    world = _count(reader, size_var, minimum=1)
    rank = _index(reader, rank_var, size_var, world)
    if servers >= world:
        raise EnvError(
            f"The strategy asks for servers={servers}, but {size_var}={world} leaves no worker. "
            f"Launch at least {servers + 1} processes or lower servers."
        )
    is_server = rank < servers
    return RoleInfo(
        role=Role.SERVER if is_server else Role.WORKER,
        worker_index=0 if is_server else rank - servers,
        worker_num=world - servers,
        server_index=rank if is_server else -1,
        server_num=servers,
        master=master if world > 1 else None,
        rank=rank,
        world_size=world,
        local_rank=reader.int(local_var, rank) if local_var else rank,
        source=source,
        external_store=external_store,
    )


def _torchrun(reader: EnvReader, servers: int) -> RoleInfo:
    addr = reader.require(env.MASTER_ADDR, f"{env.RANK} and {env.WORLD_SIZE} are set (a torchrun-style launch)")
    port = reader.require(env.MASTER_PORT, f"{env.RANK} and {env.WORLD_SIZE} are set (a torchrun-style launch)")
    master = env.parse_endpoint(f"{env.MASTER_ADDR}:{env.MASTER_PORT}", f"{addr}:{port}")
    agent_store = (reader.str(env.TORCHELASTIC_USE_AGENT_STORE) or "").lower() == "true"
    return _rank_only(reader, "torchrun", env.RANK, env.WORLD_SIZE, env.LOCAL_RANK, servers, master, agent_store)


def _mpi(reader: EnvReader, servers: int) -> RoleInfo:
    if reader.has(env.OMPI_COMM_WORLD_RANK):
        names = env.OMPI_COMM_WORLD_RANK, env.OMPI_COMM_WORLD_SIZE, env.OMPI_COMM_WORLD_LOCAL_RANK
        job = reader.str(env.OMPI_JOB_ID)
    else:
        names = env.PMI_RANK, env.PMI_SIZE, env.MPI_LOCALRANKID
        job = None
    return _rank_only(reader, "mpi", *names, servers, _derived_master(reader, job))


def _slurm(reader: EnvReader, servers: int) -> RoleInfo:
    job = f"{reader.str(env.SLURM_JOB_ID)}.{reader.str(env.SLURM_STEP_ID)}"
    names = env.SLURM_PROCID, env.SLURM_NTASKS, env.SLURM_LOCALID
    return _rank_only(reader, "slurm", *names, servers, _derived_master(reader, job))


def _derived_master(reader: EnvReader, job_id: str | None) -> str:
    """MASTER_ADDR/MASTER_PORT when given; else loopback and a port derived from the job id.

    Deriving the port from the job id lets two mpirun jobs on one host pick different ports
    without talking to each other.
    """
    addr = reader.str(env.MASTER_ADDR, "127.0.0.1")
    port = reader.int(env.MASTER_PORT)
    if port is None:
        port = DEFAULT_MASTER_PORT
        if job_id:
            port = 20000 + int.from_bytes(hashlib.sha256(job_id.encode()).digest()[:4], "big") % 20000
    return env.parse_endpoint(f"{env.MASTER_ADDR}:{env.MASTER_PORT}", f"{addr}:{port}")


# --- shared checks -----------------------------------------------------------------


def _role(reader: EnvReader, name: str, allowed: dict[str, Role], default: str | None = None) -> Role:
    value = reader.str(name, default)
    if value not in allowed:
        choices = " or ".join(repr(v) for v in allowed)
        raise EnvError(f"{name}={value!r} is not a role fleet knows: expected {choices}.")
    return allowed[value]


def _count(reader: EnvReader, name: str, minimum: int, default: int | None = None) -> int:
    value = reader.int(name, default)
    if value is None:
        raise EnvError(f"{name} is not set; it must hold the number of processes of that kind.")
    if value < minimum:
        raise EnvError(f"{name}={value} must be at least {minimum}.")
    return value


def _index(reader: EnvReader, name: str, count_name: str, count: int) -> int:
    value = reader.int(name)
    if value is None:
        raise EnvError(f"{name} is not set, but {count_name}={count} is.")
    if not 0 <= value < count:
        raise EnvError(f"{name}={value} must be at least 0 and below {count_name}={count}.")
    return value


_CONVENTIONS = (
    (lambda r: r.has(env.FLEET_ROLE), _fleetrun),
    (lambda r: r.has(env.TRAINING_ROLE) or r.has(env.PADDLE_TRAINER_ID), _paddle),
    (lambda r: r.has(env.RANK) and r.has(env.WORLD_SIZE), _torchrun),
    (lambda r: r.has(env.OMPI_COMM_WORLD_RANK) or r.has(env.PMI_RANK), _mpi),
    (lambda r: r.has(env.SLURM_PROCID) and r.has(env.SLURM_NTASKS), _slurm),
)
