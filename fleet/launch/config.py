"""What one ``fleetrun`` invocation asked for, checked in one place.

Every check raises :class:`LaunchError` with a one-paragraph message that
names the thing at fault and the fix; the CLI prints it and exits with
:data:`fleet.runtime.env.EXIT_USER_ERROR`. Nothing here imports torch or pydantic: the
strategy file is read (:mod:`fleet.strategy_file`) only to catch a launch that
contradicts it (servers for a collective strategy, a parameter-server strategy
without servers). The training side validates the rest of the file.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from fleet import strategy_file
from fleet.runtime import env


class LaunchError(ValueError):
    """A mistake in the fleetrun command line, explained for the user."""


@dataclass(frozen=True)
class StrategyFile:
    """The little fleetrun needs to know about a strategy file."""

    path: Path  # absolute
    mode: str | None  # "collective", "ps" or None when the file does not say
    digest: str = field(default="", compare=False)  # of the settings, to tell the nodes' files apart

    @property
    def is_ps(self) -> bool:
        return self.mode == "ps"


@dataclass(frozen=True)
class LaunchConfig:
    """A checked fleetrun command line."""

    script: Path
    script_args: tuple[str, ...] = ()
    workers: int = 1  # per node
    servers: int = 0  # per node
    strategy: StrategyFile | None = None
    log_dir: Path | None = None  # None: <user state dir>/fleet/logs/<timestamp>
    max_restarts: int = 0
    nnodes: int = 1
    node_rank: int = 0
    master: tuple[str, int] | None = None  # rendezvous host and port
    host: str | None = None  # this node's address as other nodes reach it
    server_grace: float = 10.0
    stop_timeout: float = 5.0
    join_timeout: float = 300.0
    node_timeout: float = 10.0  # a node silent this long on the control channel is lost
    node_counts: tuple[tuple[int, int], ...] | None = None
    """(workers, servers) of every node in node order, as the nodes agreed at the rendezvous
    (:mod:`fleet.launch.agree`); None: every node runs what this one was asked for."""

    def _counts(self) -> tuple[tuple[int, int], ...]:
        return self.node_counts or ((self.workers, self.servers),) * self.nnodes

    @property
    def is_ps(self) -> bool:
        return self.world_servers > 0

    @property
    def world_workers(self) -> int:
        return sum(w for w, _ in self._counts())

    @property
    def world_servers(self) -> int:
        return sum(s for _, s in self._counts())

    @property
    def first_worker(self) -> int:
        """The global index of this node's first worker (the workers of the nodes before it come first)."""
        return sum(w for w, _ in self._counts()[: self.node_rank])

    @property
    def first_server(self) -> int:
        """The global index of this node's first server."""
        return sum(s for _, s in self._counts()[: self.node_rank])


def check_node_counts(workers: int, servers: int, nnodes: int) -> None:
    """``--workers``/``--servers`` of one node; a node may run servers only (or workers only) when there are several."""
    check_count("--servers", servers, 0)
    if nnodes == 1 or workers != 0:
        if workers == 0:
            raise LaunchError(
                "--workers 0 leaves the job without a worker. A node of servers only (--workers 0) is for a "
                "job over several nodes (--nnodes M), where other nodes run the workers; on one node give "
                "--workers 1 or more, for example: fleetrun --workers 2 train.py"
            )
        check_count("--workers", workers, 1)
    elif servers == 0:
        raise LaunchError(
            "--workers 0 --servers 0 gives this node nothing to run. Give it workers (--workers N), servers "
            "(--servers S, for example --servers 2 --workers 0 on a node of servers only), or both."
        )


def check_count(flag: str, value: int, minimum: int) -> int:
    if value < minimum:
        least = "at least 1" if minimum == 1 else "0 or more"
        raise LaunchError(
            f"{flag} {value} is not a usable count: {flag} must be {least}. "
            f"For example: fleetrun {flag} {max(minimum, 2)} train.py"
        )
    return value


def check_script(script: str | None) -> Path:
    if not script:
        raise LaunchError(
            "No training script given. Name the script after fleetrun's own options, for example: "
            "fleetrun --workers 2 train.py --epochs 3 (arguments after the script go to the script)."
        )
    path = Path(script)
    if not path.is_file():
        where = f" (looked in {Path.cwd()})" if not path.is_absolute() else ""
        raise LaunchError(
            f"The training script {script!r} does not exist{where}. "
            "Check the path, or run fleetrun from the directory that holds the script."
        )
    return path


def parse_master(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 as ``[::1]:PORT``) for ``--master``."""
    try:
        endpoint = env.parse_endpoint("--master", text)
    except env.EnvError:
        raise LaunchError(
            f"--master {text!r} is not a HOST:PORT address. Give the address of node 0 and a free port "
            "on it, for example --master 10.0.0.1:6170 (IPv6: --master [fe80::1]:6170)."
        ) from None
    host, port = env.split_endpoint(endpoint)
    return host, port


def check_nodes(nnodes: int, node_rank: int, master: str | None) -> tuple[str, int] | None:
    check_count("--nnodes", nnodes, 1)
    if node_rank < 0 or node_rank >= nnodes:
        raise LaunchError(
            f"--node-rank {node_rank} is out of range for --nnodes {nnodes}: node ranks run from 0 to "
            f"{nnodes - 1}. Start node 0 with --node-rank 0, node 1 with --node-rank 1, and so on."
        )
    parsed = parse_master(master) if master is not None else None
    if nnodes > 1 and parsed is None:
        raise LaunchError(
            f"--nnodes {nnodes} needs --master HOST:PORT, the address of node 0 where the nodes meet. "
            "Pass the same --master to every node, for example --master 10.0.0.1:6170."
        )
    return parsed


def load_strategy_file(text: str) -> StrategyFile:
    try:
        data = strategy_file.read(text, given="given to --strategy")
    except strategy_file.StrategyFileError as error:
        hint = " Check the path, or leave --strategy out to let the script choose its strategy."
        raise LaunchError(f"{error}{hint if 'does not exist' in str(error) else ''}") from None
    digest = hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return StrategyFile(path=Path(text).expanduser().resolve(), mode=strategy_file.mode_of(data), digest=digest)


def check_strategy_against_servers(strategy: StrategyFile | None, servers: int, nnodes: int = 1) -> None:
    """``nnodes`` > 1: a parameter-server strategy on a node without servers waits for the rendezvous,
    where node 0 checks it against the servers of every node (:mod:`fleet.launch.agree`)."""
    if strategy is None:
        return
    if strategy.mode == "collective" and servers > 0:
        raise LaunchError(
            f"--servers {servers} asks for a parameter-server job, but the strategy file "
            f'{str(strategy.path)!r} says mode = "collective". Drop --servers for a collective job, '
            'or set mode = "ps" in the strategy file.'
        )
    if strategy.is_ps and servers == 0 and nnodes == 1:
        raise LaunchError(
            f'The strategy file {str(strategy.path)!r} describes a parameter-server job (mode "ps" or '
            "a_sync), but no servers were asked for. Add --servers N (for example --servers 1), "
            'or set mode = "collective" in the strategy file.'
        )


def default_log_dir(base: Path | None = None) -> Path:
    """A fresh ``<state dir>/fleet/logs/<YYYYmmdd-HHMMSS>`` directory (suffixed when taken).

    The user's state directory (``$XDG_STATE_HOME``, else ``~/.local/state``), not the working
    directory: a launch must not litter the user's source tree. fleetrun prints where it is.
    """
    import time

    root = (base or Path(env.user_state_dir())) / "fleet" / "logs"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        candidate = root / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            candidate.mkdir(parents=True, exist_ok=False)
            return candidate
        except FileExistsError:
            continue
    raise LaunchError(f"Could not create a fresh log directory under {root}. Pass --log-dir DIR.")


def make_log_dir(text: str | None) -> Path:
    if text is None:
        return default_log_dir()
    path = Path(text).expanduser().resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LaunchError(
            f"--log-dir {text!r} cannot be used as a log directory ({exc.strerror}). "
            "Pick a writable directory, or leave --log-dir out for ~/.local/state/fleet/logs/<timestamp>."
        ) from None
    if not os.access(path, os.W_OK):
        raise LaunchError(f"--log-dir {text!r} is not writable. Pick a writable directory.")
    return path
