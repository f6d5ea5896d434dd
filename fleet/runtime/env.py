"""Every environment variable fleet reads or sets, in one place.

Nothing else in fleet touches ``os.environ``: other modules receive an
:class:`EnvReader` (or a plain mapping) and use the names declared here, so a
test can hand in a dictionary instead of patching the process environment, and
a reader of the code can see every variable the project depends on.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

# --- fleetrun's own variables (set by fleet.launch, read by fleet.roles) -----
FLEET_ROLE = "FLEET_ROLE"  # "worker" or "server"
FLEET_WORKER_INDEX = "FLEET_WORKER_INDEX"
FLEET_WORKER_NUM = "FLEET_WORKER_NUM"
FLEET_SERVER_INDEX = "FLEET_SERVER_INDEX"
FLEET_SERVER_NUM = "FLEET_SERVER_NUM"
FLEET_SERVER_ENDPOINTS = "FLEET_SERVER_ENDPOINTS"  # "host:port,host:port", server index order
FLEET_MASTER = "FLEET_MASTER"  # "host:port" of the rendezvous store, hosted by worker 0
FLEET_STRATEGY = "FLEET_STRATEGY"  # a DistributedStrategy as JSON
FLEET_STRATEGY_FILE = "FLEET_STRATEGY_FILE"  # path to a TOML or JSON strategy file
FLEET_SECRET = "FLEET_SECRET"  # shared secret authenticating peers (hex)
FLEET_SECRET_FILE = "FLEET_SECRET_FILE"  # a file only its owner reads, holding that secret (hex)
FLEET_LOG_DIR = "FLEET_LOG_DIR"  # where fleetrun keeps logs; metrics reports land here
FLEET_RESTART_COUNT = "FLEET_RESTART_COUNT"  # how often fleetrun restarted this process
FLEET_MAX_RESTARTS = "FLEET_MAX_RESTARTS"  # fleetrun --max-restarts: > 0 lets PS servers wait for workers to rejoin
FLEET_INJECT = "FLEET_INJECT"  # fault / straggler injection spec for tests and demos
FLEET_LOCAL_RANK = "FLEET_LOCAL_RANK"  # process index on this node
FLEET_TIMEOUT_S = "FLEET_TIMEOUT_S"  # seconds: DistributedStrategy.timeout_s where the strategy does not set it
FLEET_REPORT = "FLEET_REPORT"  # "0": no "where the time went" table at the end of a job run without fleetrun
FLEET_PS_IPC = "FLEET_PS_IPC"  # "0": workers reach parameter servers on their host over TCP, not a Unix socket
FLEET_LOCAL_PROCESSES = "FLEET_LOCAL_PROCESSES"  # the job's processes on this host (workers and servers)

# --- PaddlePaddle's launch conventions ---------------------------------------
TRAINING_ROLE = "TRAINING_ROLE"  # "TRAINER" or "PSERVER"
PADDLE_TRAINER_ID = "PADDLE_TRAINER_ID"
PADDLE_TRAINERS_NUM = "PADDLE_TRAINERS_NUM"
PADDLE_PSERVERS_IP_PORT_LIST = "PADDLE_PSERVERS_IP_PORT_LIST"
PADDLE_TRAINER_ENDPOINTS = "PADDLE_TRAINER_ENDPOINTS"
PADDLE_PORT = "PADDLE_PORT"
POD_IP = "POD_IP"

# --- torchrun / torch.distributed.launch -------------------------------------
RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_RANK = "LOCAL_RANK"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
GROUP_RANK = "GROUP_RANK"
# What fleetrun sets for every worker with torchrun's meaning, so code written for torchrun runs unchanged.
TORCHRUN_VARIABLES = (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT)

# --- MPI (Open MPI, MPICH / Intel MPI via PMI) --------------------------------
OMPI_COMM_WORLD_RANK = "OMPI_COMM_WORLD_RANK"
OMPI_COMM_WORLD_SIZE = "OMPI_COMM_WORLD_SIZE"
OMPI_COMM_WORLD_LOCAL_RANK = "OMPI_COMM_WORLD_LOCAL_RANK"
OMPI_COMM_WORLD_LOCAL_SIZE = "OMPI_COMM_WORLD_LOCAL_SIZE"
OMPI_JOB_ID = "OMPI_MCA_ess_base_jobid"
PMI_RANK = "PMI_RANK"
PMI_SIZE = "PMI_SIZE"
MPI_LOCALRANKID = "MPI_LOCALRANKID"
MPI_LOCALNRANKS = "MPI_LOCALNRANKS"

# --- Slurm --------------------------------------------------------------------
SLURM_PROCID = "SLURM_PROCID"
SLURM_NTASKS = "SLURM_NTASKS"
SLURM_LOCALID = "SLURM_LOCALID"
SLURM_JOB_ID = "SLURM_JOB_ID"
SLURM_STEP_ID = "SLURM_STEP_ID"
SLURM_STEP_NUM_NODES = "SLURM_STEP_NUM_NODES"
SLURM_NNODES = "SLURM_NNODES"

# --- variables fleet sets for the libraries below it --------------------------
GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
PYTHONUNBUFFERED = "PYTHONUNBUFFERED"
OMP_NUM_THREADS = "OMP_NUM_THREADS"  # fleetrun shares the cores among its processes unless the user chose


class EnvError(ValueError):
    """An environment variable holds a value fleet cannot use."""


class EnvReader:
    """Typed, read-only access to an environment mapping.

    Every error names the variable and the value, because the user's fix is
    almost always in a launch script far away from the traceback.
    """

    def __init__(self, mapping: Mapping[str, str] | None = None):
        self._env: Mapping[str, str] = dict(os.environ if mapping is None else mapping)

    def has(self, name: str) -> bool:
        return bool(self._env.get(name, "").strip())

    def str(self, name: str, default: str | None = None) -> str | None:
        value = self._env.get(name, "").strip()
        return value if value else default

    def require(self, name: str, why: str) -> str:
        value = self.str(name)
        if value is None:
            raise EnvError(f"{name} is not set, but {why}. Set {name} or launch with fleetrun.")
        return value

    def int(self, name: str, default: int | None = None) -> int | None:
        value = self.str(name)
        if value is None:
            return default
        try:
            return int(value)
        except ValueError:
            raise EnvError(f"{name}={value!r} is not an integer.") from None

    def float(self, name: str, default: float | None = None) -> float | None:
        value = self.str(name)
        if value is None:
            return default
        try:
            return float(value)
        except ValueError:
            raise EnvError(f"{name}={value!r} is not a number (seconds, for example 1800).") from None

    def flag(self, name: str, default: bool = True) -> bool:
        """A switch: "0", "false", "no" or "off" (any case) turn it off, anything else set turns it on."""
        value = self.str(name)
        if value is None:
            return default
        return value.lower() not in ("0", "false", "no", "off")

    def endpoints(self, name: str) -> tuple[str, ...]:
        """A comma-separated list of host:port, each checked."""
        value = self.str(name)
        if value is None:
            return ()
        return tuple(parse_endpoint(name, part) for part in value.split(",") if part.strip())


def parse_endpoint(name: str, text: str) -> str:
    """Check one "host:port" (IPv6 as "[::1]:port") and return it stripped."""
    text = text.strip()
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise EnvError(f"{name} holds {text!r}, which is not a host:port endpoint (for example 127.0.0.1:6170).")
    return text


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


XDG_STATE_HOME = "XDG_STATE_HOME"
XDG_RUNTIME_DIR = "XDG_RUNTIME_DIR"  # the user's private runtime directory (a tmpfs), where one is set


def user_state_dir() -> str:
    """Where per-user program state and logs go (XDG's state directory: ``~/.local/state`` by default)."""
    return os.environ.get(XDG_STATE_HOME) or os.path.join(os.path.expanduser("~"), ".local", "state")


def current() -> EnvReader:
    """The process environment, read once."""
    return EnvReader()


def set_default(name: str, value: str, target: MutableMapping[str, str] | None = None) -> None:
    """Set a variable for libraries fleet drives, unless the user already chose one."""
    target = os.environ if target is None else target
    target.setdefault(name, value)


def child_environment(base: Mapping[str, str] | None = None, **values: str) -> dict[str, str]:
    """The environment for a process fleetrun starts: ``base`` plus ``values``."""
    env = dict(os.environ if base is None else base)
    env.update(values)
    return env


# --- exit statuses the launcher and the training side agree on -----------------
EXIT_PORT_IN_USE = 75  # a process could not bind the port fleetrun gave it; fleetrun picks new ports and relaunches
EXIT_USER_ERROR = 2  # a mistake in the launch or the strategy, already explained in one paragraph on stderr

# torchrun's agent hosts the rendezvous store itself and says so with this variable.
TORCHELASTIC_USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
# torchrun's restart attempt: its agent's store outlives the workers, so each attempt meets under its own keys.
TORCHELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
