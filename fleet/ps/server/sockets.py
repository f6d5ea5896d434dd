"""Where a parameter server listens: one ROUTER socket (TCP, and this host's Unix socket), its ZAP handler,
and the direct same-host socket.

Authentication (see :mod:`fleet.ps.protocol.auth`) is ZeroMQ's ZAP with the PLAIN mechanism; its
handler is one more socket polled by the server loop. The ROUTER listens on TCP and, for workers on
this host, on a Unix socket too (:mod:`fleet.ps.protocol.local`): one socket, so authentication, the
frame cap and the request limits are the same on both. Before authentication a peer can make the
server allocate one frame, :data:`~fleet.ps.protocol.wire.FRAME_BYTES` (``zmq.MAXMSGSIZE``, with room
for CURVE's envelope). Same-host callers' small blocking requests may also come over a plain Unix
stream (:mod:`fleet.ps.protocol.unix`, :mod:`fleet.ps.server.direct_conns`), never with CURVE.
"""

from __future__ import annotations

import logging
import os
import secrets
from typing import Any

import zmq

from fleet.ps.protocol import auth
from fleet.ps.protocol import local as same_host
from fleet.ps.protocol import unix as direct_path
from fleet.ps.protocol.wire import MAX_WIRE_FRAME
from fleet.ps.server.direct_conns import DirectConnections

log = logging.getLogger(__name__)


def zmq_address(endpoint: str) -> str:
    """'host:port' -> 'tcp://host:port'; port 0 asks ZeroMQ for an ephemeral port."""
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"endpoint {endpoint!r} is not host:port (for example 127.0.0.1:6170)")
    return f"tcp://{host}:{'*' if int(port) == 0 else port}"


class ServerSockets:
    """The sockets of one server, bound at construction (a port clash surfaces at once; port 0 resolves to
    :attr:`endpoint`). The loop thread owns them: it polls, reads and sends; :meth:`close` releases them."""

    def __init__(self, endpoint: str, secret: bytes, server_index: int, encryption: str, ipc: bool):
        self.server_index = server_index
        self._ctx = zmq.Context(io_threads=1)
        try:
            self.zap = auth.ZapHandler(self._ctx, secret, encryption)
            sock = self._ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 2000)  # let the last STOP replies leave before the context closes
            auth.configure_server(sock, encryption, secret)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_WIRE_FRAME)  # what a peer not yet authenticated can make us allocate
            sock.setsockopt(zmq.SNDHWM, 10000)
            sock.setsockopt(zmq.RCVHWM, 10000)
            sock.setsockopt(zmq.SNDBUF, 4 << 20)  # fixed kernel buffers: fewer wake-ups per MB than autotuning
            sock.setsockopt(zmq.RCVBUF, 4 << 20)
            if ":" in endpoint.rpartition(":")[0]:
                sock.setsockopt(zmq.IPV6, 1)
            self.router = sock
            sock.bind(zmq_address(endpoint))
            bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except Exception:
            self._ctx.destroy(linger=0)
            raise
        self.endpoint = bound.removeprefix("tcp://")
        #: the Unix socket workers on this host use instead of TCP (None: off, or unusable here)
        self.ipc_path = self._bind_ipc(secret) if same_host.enabled(ipc) else None
        self.host = same_host.host_identity()
        # Tells this run of the server from an earlier one at the same endpoint: a worker whose request ZeroMQ
        # delivered to a restarted server learns from the next HELLO that the state it knew is gone.
        self.incarnation = secrets.randbits(62) + 1
        self.direct = self._bind_direct(secret) if self.ipc_path and encryption == "none" else None
        #: replies sent through ZeroMQ so far (the loop's waiter must know when a ZeroMQ socket was used)
        self.zmq_sends = 0

    def _bind_ipc(self, secret: bytes) -> str | None:
        """Bind the same socket to this job's Unix socket for the TCP endpoint; None when that is not possible."""
        path = same_host.prepare(secret, self.endpoint)
        if path is None:
            return None
        try:
            self.router.bind(f"ipc://{path}")
        except zmq.ZMQError as exc:
            log.warning("parameter server %d: no same-host socket at %s: %s", self.server_index, path, exc)
            return None
        return path

    def _bind_direct(self, secret: bytes) -> DirectConnections | None:
        """Listen for the direct path beside the ZeroMQ Unix socket; None when that is not possible."""
        assert self.ipc_path is not None
        path = self.ipc_path.removesuffix(same_host.SUFFIX) + direct_path.SUFFIX
        if len(path) > same_host.MAX_PATH:
            return None
        try:
            if os.path.exists(path):  # left by a killed server at this endpoint
                os.unlink(path)
            return DirectConnections(path, secret, self.incarnation)
        except OSError as exc:
            log.warning("parameter server %d: no direct same-host socket at %s: %s", self.server_index, path, exc)
            return None

    def hello(self) -> dict[str, Any]:
        """Where a worker may reach this server besides TCP (HELLO's answer; fleet.ps.protocol.local)."""
        if self.ipc_path is None:
            return {}
        info: dict[str, Any] = {"ipc": self.ipc_path, "host": self.host}
        if self.direct is not None:
            info["direct"] = self.direct.path
        return info

    def register(self, poller: Any) -> None:
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.zap.socket, zmq.POLLIN)
        if self.direct is not None:
            self.direct.attach(poller)

    def send(self, ident: Any, frames: list[Any]) -> bool:
        """Send a reply's frames to the peer ``ident``; False when it was dropped (a full or unknown peer)."""
        if self.direct is not None and self.direct.owns(ident):
            return self.direct.send(ident, frames)
        self.zmq_sends += 1
        # ROUTER drops rather than blocks on a full or unknown peer; NOBLOCK makes sure
        self.router.send_multipart([ident, *frames], flags=zmq.NOBLOCK, copy=False)
        return True

    def close(self) -> None:
        """Release every socket and the context, and remove the Unix socket's file (libzmq leaves it)."""
        if self.direct is not None:
            self.direct.close()
        self.router.close()
        self.zap.close()
        self._ctx.term()
        same_host.remove(self.ipc_path)
