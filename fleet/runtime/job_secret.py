"""Where the job's secret comes from, and how it reaches processes no launcher gave it to.

The secret authenticates the rendezvous (:func:`fleet.runtime.rendezvous.join`) and is the password
of the parameter servers. In order:

1. ``FLEET_SECRET`` (hex): fleetrun sets it for every process it starts; by hand, export
   the same value everywhere (``mpirun -x FLEET_SECRET``; srun passes the environment).
2. ``FLEET_SECRET_FILE``: a file holding the hex secret, readable by its owner only (for a
   secret kept out of the environment, or on a filesystem every host mounts).
3. A parameter-server job under torchrun, mpirun or srun with neither, every process on this
   host: rank 0 makes a secret and hands it over in a file only this user can read (mode
   0600 in a 0700 directory); the store carries only the file's random name, and rank 0
   deletes the file as soon as every process has proved it holds the secret.

The secret never goes through the rendezvous store, in any form: the store has no access
control (torchrun's listens on every interface) and anyone who reads it can also write it.
A key exchange over it (Diffie-Hellman) would hide the secret from a reader that only
reads, but one that writes would sit in the middle and learn it, so fleet does not offer
that pretence: across hosts, without 1 or 2, a parameter-server job stops with an error
saying what to set.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from fleet.errors import FleetError, PeerError, StoreTamperedError
from fleet.roles import RoleInfo
from fleet.runtime import env, job_files
from fleet.runtime.env import EnvError, EnvReader
from fleet.runtime.rendezvous import bounded
from fleet.runtime.store_calls import StoreSilentError

RANK_ONLY = ("torchrun", "mpi", "slurm")
"""Launchers that give a process its rank but no secret."""

_FILE_KEY = "secret-file"
_TOKEN_CHARS = 32
_TOKEN = re.compile(r"\d+\.\d+-[0-9a-f]{32}")  # <owner tag>-<random hex>


def from_environment(reader: EnvReader | None = None) -> bytes | None:
    """FLEET_SECRET, else the content of FLEET_SECRET_FILE; None when neither is set."""
    reader = reader or env.current()
    text = reader.str(env.FLEET_SECRET)
    name = env.FLEET_SECRET
    path = reader.str(env.FLEET_SECRET_FILE)
    if text is None and path is not None:
        text, name = _read_private(path, env.FLEET_SECRET_FILE), f"{env.FLEET_SECRET_FILE}={path}"
    if text is None:
        return None
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise EnvError(f"{name} must hold the secret in hex; it holds {len(text)} other characters.") from None
    if not 1 <= len(secret) <= 255:
        raise EnvError(f"{name} must hold 1 to 255 bytes in hex (32 is good); it holds {len(secret)}.")
    return secret


def _read_private(path: str, name: str) -> str:
    try:
        with open(path) as handle:
            mode = os.fstat(handle.fileno()).st_mode
            text = handle.read().strip()
    except OSError as error:
        raise EnvError(f"{name}={path} cannot be read: {error.strerror}.") from None
    if mode & 0o077:
        raise EnvError(
            f"{name}={path} can be read by other users (mode {stat.S_IMODE(mode):04o}): anyone who reads it joins the "
            f"job. Make it private: chmod 600 {path}."
        )
    return text


def one_host(role: RoleInfo, reader: EnvReader | None = None) -> bool:
    """Whether the launcher says every process of the job runs on this host."""
    reader = reader or env.current()
    if role.source == "slurm":
        nodes = reader.int(env.SLURM_STEP_NUM_NODES) or reader.int(env.SLURM_NNODES)
        if nodes is not None:
            return nodes == 1
    local = {
        "torchrun": (env.LOCAL_WORLD_SIZE,),
        "mpi": (env.OMPI_COMM_WORLD_LOCAL_SIZE, env.MPI_LOCALNRANKS),
    }.get(role.source, ())
    for name in local:
        size = reader.int(name)
        if size is not None:
            return size == role.world_size
    host = env.split_endpoint(role.master)[0] if role.master else "127.0.0.1"
    return host in ("localhost", "::1") or host.startswith("127.")


def share_on_host(store: dist.Store, role: RoleInfo, timeout_s: float) -> tuple[bytes, Callable[[], None]]:
    """A new secret from rank 0, through a file only this user reads; returns it and how to delete the file.

    ``store`` (the raw rendezvous store) carries only the file's random name.
    """
    if not one_host(role):
        raise EnvError(
            f"This parameter-server job runs under {role.source} on more than one host and no secret was given: "
            f"set {env.FLEET_SECRET} (or {env.FLEET_SECRET_FILE}) to the same value for every process, e.g. "
            f"export {env.FLEET_SECRET}=$(python -c 'import secrets; print(secrets.token_hex(32))') and pass it on "
            f"(mpirun -x {env.FLEET_SECRET}; srun and torchrun pass the environment). fleet does not send a secret "
            "through the rendezvous store: anyone who can reach its port could read it and join the job."
        )
    folder = _private_dir()
    if role.rank == 0:
        # the name carries rank 0's owner tag: the next fleet start on this host removes it if a kill -9 left it
        secret, token = secrets.token_bytes(32), f"{job_files.owner_tag()}-{secrets.token_hex(_TOKEN_CHARS // 2)}"
        path = os.path.join(folder, f"{token}.secret")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secret.hex())
        bounded(lambda: store.set(_FILE_KEY, token), timeout_s, role.master, role.name)
        return secret, lambda: _unlink(path)
    try:
        bounded(lambda: store.wait([_FILE_KEY], timedelta(seconds=timeout_s)), timeout_s, role.master, role.name)
        token = bytes(bounded(lambda: store.get(_FILE_KEY), timeout_s, role.master, role.name)).decode("latin-1")
    except StoreSilentError:
        raise
    except (RuntimeError, dist.DistStoreError):
        raise PeerError(
            f"the process of rank 0 did not share the job's secret within {timeout_s:g} s; it may have failed to "
            "start (see its log)."
        ) from None
    if _TOKEN.fullmatch(token) is None:
        raise StoreTamperedError("the name of the job's secret file is malformed")
    path = os.path.join(folder, f"{token}.secret")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise FleetError(
            f"{path}, where rank 0 left the job's secret, does not exist: rank 0 ended before this process read "
            f"it, runs on another host (then set {env.FLEET_SECRET} for every process), or the rendezvous store was "
            "tampered with."
        ) from None
    with os.fdopen(fd) as handle:
        info = os.fstat(handle.fileno())
        if info.st_uid != os.geteuid() or info.st_mode & 0o077:
            raise FleetError(f"{path} is not a private file of this user; refusing to take a secret from it.")
        return bytes.fromhex(handle.read().strip()), lambda: None


def _private_dir() -> str:
    """A directory only this user can enter: $XDG_RUNTIME_DIR/fleet (a tmpfs) or the user's state directory."""
    path = job_files.secret_dir()
    os.makedirs(path, mode=0o700, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise FleetError(f"{path} is not a directory of this user; it cannot hold the job's secret.")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
