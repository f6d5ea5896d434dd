"""Joining a parameter-server job: the secret, the server endpoints, and serving on a server process.

Under fleetrun and Paddle-style environments the endpoints and the secret come from
the environment. Under rank-only launchers (torchrun, mpirun, srun) the first S
ranks are servers: each binds an ephemeral port and publishes its endpoint in the
rendezvous store under ``ps/endpoint/<i>`` (a value under the job's MAC, so nobody
can point the workers elsewhere); the secret comes from the environment, or rank 0
makes one and shares it on this host (:mod:`fleet.runtime.job_secret`), never through the store.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import zmq

from fleet.errors import FleetError
from fleet.runtime import env, job_secret, rendezvous

log = logging.getLogger(__name__)


def resolve_secret(runtime: Any) -> bytes:
    """The job's secret; under rank-only launchers without one, rank 0's, shared on this host (never via the store)."""
    if runtime.secret:
        return runtime.secret
    role = runtime.role
    if role.source in job_secret.RANK_ONLY and role.master:
        runtime.rendezvous_store()  # settles the secret before it authenticates the join (fleet.runtime.job_secret)
        return runtime.secret
    raise env.EnvError(
        f"A parameter-server job needs a shared secret in {env.FLEET_SECRET} (hex) so that servers can "
        f"authenticate workers; fleetrun sets it. When starting processes by hand, export the same value "
        f"everywhere, e.g. {env.FLEET_SECRET}=$(python -c 'import secrets; print(secrets.token_hex(16))')."
    )


def _bind_host(role: Any) -> str:
    host, _ = env.split_endpoint(role.master) if role.master else ("127.0.0.1", 0)
    return "127.0.0.1" if not host or rendezvous.is_loopback(host) else host


def init_server(
    runtime: Any,
    timeout_s: float,
    limits: Any = None,
    encryption: str = "none",
    ipc: bool = True,
    threads: int | None = None,
) -> Any:
    """Build (bind) this process's ParameterServer; publish its endpoint under rank-only launchers.

    ``limits``: the request limits (a :class:`fleet.ps.protocol.limits.RequestLimits`; the defaults when None);
    ``encryption``: the transport's, "none" or "curve" (see :mod:`fleet.ps.protocol.auth`);
    ``ipc``: also listen on a Unix socket for workers on this host (:mod:`fleet.ps.protocol.local`);
    ``threads``: table threads (:mod:`fleet.ps.server.lanes`; None: by the machine's cores).
    """
    from fleet.ps.server.loop import ParameterServer

    role = runtime.role
    if not role.is_server:
        raise FleetError(f"fleet.init_server() was called on {role.name}; only server processes serve.")
    secret = resolve_secret(runtime)
    publish = not role.server_endpoints
    endpoint = f"{_bind_host(role)}:0" if publish else role.server_endpoints[role.server_index]
    environ = env.current()
    record_dir = environ.str(env.FLEET_LOG_DIR) or None
    try:
        server = ParameterServer(
            endpoint,
            secret,
            role.server_index,
            role.worker_num,
            timeout_s,
            rejoin=(environ.int(env.FLEET_MAX_RESTARTS, 0) or 0) > 0,
            checkpoint_record_dir=record_dir,
            limits=limits,
            encryption=encryption,
            ipc=ipc,
            threads=threads,
        )
    except zmq.ZMQError as exc:
        if exc.errno == zmq.EADDRINUSE and role.source == "fleetrun":
            print(f"fleet: server {role.server_index} cannot bind {endpoint}: address in use", file=sys.stderr)
            sys.exit(env.EXIT_PORT_IN_USE)
        raise FleetError(f"server {role.server_index} cannot bind {endpoint}: {exc}") from None
    if (environ.int(env.FLEET_RESTART_COUNT, 0) or 0) > 0:
        _restore_after_restart(server, record_dir)
    if publish:
        store, key = runtime.rendezvous_store(), f"ps/endpoint/{role.server_index}"
        rendezvous.bounded(lambda: store.set(key, server.endpoint), timeout_s, role.master, role.name)
    return server


def _restore_after_restart(server: Any, record_dir: str | None) -> None:
    """A restarted server loads its shards from the last checkpoint it saved, before it serves anyone."""
    from fleet.ps.server import shard_io

    dirname = shard_io.last_checkpoint(record_dir, server.server_index) if record_dir else None
    if dirname is None:
        print(
            f"fleet: parameter server {server.server_index} restarted with no checkpoint of its shards "
            f"recorded (fleet.save_persistables was not called yet): its tables start again from the "
            "workers' current values",
            file=sys.stderr,
            flush=True,
        )
        return
    try:
        tables = server.restore(dirname)
    except Exception:
        server.shutdown()
        server.close()
        raise
    print(
        f"fleet: parameter server {server.server_index} restarted from the checkpoint in {dirname} (tables {tables})",
        flush=True,
    )


def run_server(server: Any, server_index: int) -> None:
    """Serve until every worker has stopped, then exit the process with status 0."""
    log.info("fleet parameter server %d serving on %s", server_index, server.endpoint)
    stats = server.serve()
    gone = sorted(set(stats.get("gone_workers", [])) - set(stats.get("stopped_workers", [])))
    if gone:
        names = ", ".join(f"worker {w}" for w in gone)
        print(
            f"fleet: parameter server {server_index}: {names} died or hung (no heartbeat) "
            "and never came back; the job did not finish cleanly.",
            file=sys.stderr,
        )
        sys.exit(1)
    sys.exit(0)


def worker_endpoints(runtime: Any) -> tuple[str, ...]:
    """The servers' endpoints in index order, read from the store when the launcher did not give them."""
    role = runtime.role
    if role.server_endpoints:
        return tuple(role.server_endpoints)
    store, timeout_s = runtime.rendezvous_store(), runtime.strategy.timeout_s
    # a get waits (up to the store's timeout) for the server to publish; a silent store fails it, naming the store
    return tuple(
        rendezvous.bounded(lambda i=i: store.get(f"ps/endpoint/{i}"), timeout_s, role.master, role.name).decode()
        for i in range(role.server_num)
    )
