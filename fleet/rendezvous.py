"""Rendezvous: the torch.distributed store every process of a job meets at.

The process of rank 0 hosts the store on a socket it binds itself, so the store
listens only on the configured address (loopback for local runs), never on all
interfaces. Under torchrun the launcher's agent already hosts it.
"""

from __future__ import annotations

import errno
import hmac
import socket
from datetime import timedelta

import torch.distributed as dist

from fleet import env
from fleet.errors import FleetError, PeerError
from fleet.roles import RoleInfo

_listeners: list[socket.socket] = []


class PortInUseError(FleetError):
    """The rendezvous port is taken by another program."""


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            raise PortInUseError(
                f"The rendezvous address {host}:{port} is already in use by another program."
            ) from None
        raise FleetError(
            f"Cannot listen on the rendezvous address {host}:{port} ({error.strerror}). The process of rank 0 must "
            "run on the master host; check MASTER_ADDR / FLEET_MASTER."
        ) from None
    sock.listen(256)
    return sock


def connect(role: RoleInfo, timeout_s: float, namespace: str = "fleet") -> dist.Store:
    """The job's store, hosted here if this is rank 0."""
    assert role.master is not None
    host, port = env.split_endpoint(role.master)
    timeout = timedelta(seconds=timeout_s)
    if role.external_store or role.rank != 0:
        try:
            store = dist.TCPStore(host, port, role.world_size, False, timeout=timeout, wait_for_workers=False)
        except (RuntimeError, dist.DistStoreError) as error:
            raise PeerError(
                f"{role.name} could not reach the rendezvous store at {host}:{port} within {timeout_s:g} s: "
                f"{str(error).strip().splitlines()[0]}. Is the process of rank 0 running?"
            ) from None
    else:
        listener = _bind(host, port)
        store = dist.TCPStore(
            host,
            port,
            role.world_size,
            True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=listener.fileno(),
        )
        _listeners.append(listener)  # the store serves on this socket: keep it open for the process's life
    return dist.PrefixStore(namespace, store)


def authenticate(store: dist.Store, role: RoleInfo, secret: bytes | None, timeout_s: float) -> None:
    """Every process proves it holds the job's secret; a process with a wrong secret is named and refused."""
    if not secret:
        return
    tag = hmac.new(secret, f"fleet-join:{role.rank}".encode(), "sha256").hexdigest()
    store.set(f"auth/{role.rank}", tag)
    for rank in range(role.world_size):
        expected = hmac.new(secret, f"fleet-join:{rank}".encode(), "sha256").hexdigest()
        try:
            seen = store.get(f"auth/{rank}").decode()
        except (RuntimeError, dist.DistStoreError):
            raise PeerError(
                f"process of rank {rank} did not join the rendezvous within {timeout_s:g} s; it may have failed to "
                "start (see its log)."
            ) from None
        if not hmac.compare_digest(seen, expected):
            raise PeerError(
                f"process of rank {rank} joined with the wrong secret (FLEET_SECRET); refusing to train with it."
            )


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")
