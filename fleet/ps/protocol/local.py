"""The same-host path: a server's Unix domain socket (ZeroMQ ``ipc://``) beside its TCP endpoint.

Why: on one host TCP costs a worker and a server the loopback stack for every request (the
checksums, the segmentation, the acknowledgements) although both ends share a kernel. A Unix
domain socket moves the same frames with less work in the kernel and no Nagle or delayed-ACK
effects. Nothing else changes: the server binds its one ROUTER socket to both endpoints, so the
same ZAP handler (PLAIN or CURVE), the same frame cap and the same request limits apply to a
peer whichever way it came in.

How a worker finds it, with no setting: the server answers HELLO with its socket's path and its
host's identity (:func:`host_identity`). A worker whose own identity matches, that dialled the
port the server reports (so a relay or tunnel the user put in between stays in the path), and
that finds the path inside the job's private directory as a socket, connects there and asks
HELLO again; only when the answer comes from the same server process (its incarnation) does it
move its requests over (:mod:`fleet.ps.client.routes`). Anything else keeps TCP.

Where: ``<temp dir>/fleet-ps-<16 hex>/<12 hex>.sock``. The directory's name is an HMAC of the
job's secret (unpredictable without it, so nobody can make or squat it in advance), it is made
with mode 0700 and refused unless it is a directory owned by this user with that mode; the file's
name hashes the server's TCP endpoint, so a server restarted at the same endpoint binds the same
path (its workers' sockets reconnect by themselves, as over TCP) and two live servers never share
one. A server removes its file when it closes, and the directory once it is empty; one killed
outright leaves its file, which the next bind replaces and fleetrun removes with the directory at
the end of the job (:func:`fleet.runtime.job_files.remove_ps_sockets`).

Off switch: ``DistributedStrategy(ps_ipc=False)`` or ``FLEET_PS_IPC=0`` in the environment (either,
on servers or workers, keeps TCP).
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import stat

from fleet.runtime import env
from fleet.runtime.job_files import ps_socket_dir

log = logging.getLogger(__name__)

#: a Unix socket's path must fit ``sockaddr_un.sun_path`` (108 bytes on Linux, with its NUL)
MAX_PATH = 100
SUFFIX = ".sock"


def enabled(setting: bool = True) -> bool:
    """Whether this process uses the same-host path: the strategy's ``ps_ipc`` and ``FLEET_PS_IPC`` agree."""
    value = env.current().str(env.FLEET_PS_IPC)
    if value is not None and value.lower() in ("0", "false", "no", "off"):
        return False
    return bool(setting) and hasattr(socket, "AF_UNIX")


def host_identity() -> str:
    """This host as its kernel knows it: the host name and the boot id (machine id where there is none)."""
    for path in ("/proc/sys/kernel/random/boot_id", "/etc/machine-id"):
        try:
            with open(path) as f:
                return f"{socket.gethostname()}/{f.read().strip()}"
        except OSError:
            continue
    return socket.gethostname()


def socket_path(secret: bytes, endpoint: str) -> str:
    """Where the server bound at TCP ``endpoint`` puts its Unix socket."""
    name = hashlib.sha256(endpoint.encode()).hexdigest()[:12]
    return os.path.join(ps_socket_dir(secret.hex()), name + SUFFIX)


def _private(directory: str) -> bool:
    """Whether ``directory`` is a real directory of this user that nobody else may enter."""
    try:
        st = os.lstat(directory)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700


def prepare(secret: bytes, endpoint: str) -> str | None:
    """Server side: the path to bind for ``endpoint``, its directory made private; None (and a log line) if unusable."""
    path = socket_path(secret, endpoint)
    directory = os.path.dirname(path)
    if len(path) > MAX_PATH:
        log.info("no same-host socket: %s is longer than a Unix socket path may be (set TMPDIR shorter)", path)
        return None
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        log.warning("no same-host socket: cannot make %s: %s", directory, exc)
        return None
    if not _private(directory):
        log.warning("no same-host socket: %s is not a directory of this user with mode 0700", directory)
        return None
    try:  # a file left by a killed server at this endpoint: the bind replaces it
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    except OSError:
        pass
    return path


def remove(path: str | None) -> None:
    """Server side, on close: the socket's file, and the job's directory once no server uses it."""
    if not path:
        return
    try:
        os.unlink(path)
    except OSError:
        pass
    try:
        os.rmdir(os.path.dirname(path))
    except OSError:
        pass  # another server of the job still has its socket there


def usable(secret: bytes, offer: dict, dialled: str) -> str | None:
    """Worker side: the ``ipc://`` address to try for a server whose HELLO said ``offer``, or None.

    ``dialled``: the TCP endpoint this worker connects to. The server must be on this host, listen
    on the port dialled (not behind a relay), and offer a socket inside this job's private directory.
    """
    path, host, endpoint = offer.get("ipc"), offer.get("host"), offer.get("endpoint")
    if not isinstance(path, str) or not isinstance(endpoint, str) or host != host_identity():
        return None
    if endpoint.rpartition(":")[2] != dialled.rpartition(":")[2]:
        return None
    directory = ps_socket_dir(secret.hex())
    if os.path.dirname(path) != directory or not _private(directory):
        return None
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return None
    except OSError:
        return None
    return f"ipc://{path}"


def usable_direct(secret: bytes, offer: dict) -> str | None:
    """Worker side: the server's direct-path socket (:mod:`fleet.ps.protocol.unix`) from its HELLO ``offer``, or None.

    Only inside this job's private directory, as a socket; the caller has checked the rest with :func:`usable`.
    """
    path = offer.get("direct")
    if not isinstance(path, str):
        return None
    directory = ps_socket_dir(secret.hex())
    if os.path.dirname(path) != directory or not _private(directory):
        return None
    try:
        return path if stat.S_ISSOCK(os.lstat(path).st_mode) else None
    except OSError:
        return None
