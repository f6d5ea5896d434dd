"""Where a parameter server listens: one ROUTER socket (TCP, and this host's Unix socket), its ZAP handler,
and the direct same-host socket.

Authentication (see :mod:`fleet.ps.protocol.auth`) is ZeroMQ's ZAP with the PLAIN mechanism; its
handler is one more socket polled by the server loop. The ROUTER listens on TCP and, for workers on
this host, on a Unix socket too (:mod:`fleet.ps.protocol.local`): one socket, so authentication, the
frame cap and the request limits are the same on both. Before authentication a peer can make the
server allocate one frame, :data:`~fleet.ps.protocol.wire.FRAME_BYTES` (``zmq.MAXMSGSIZE``, with room
for CURVE's envelope). Same-host callers' small blocking requests may also come over a plain Unix
stream (:mod:`fleet.ps.protocol.unix`, :mod:`fleet.ps.server.direct_conns`), never with CURVE.
The loop waits on them all through :class:`Waiter`.
"""

from __future__ import annotations

import logging
import os
import secrets
import select
import time
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


# The server loop's wait for work (Waiter): ZeroMQ's poll, or one plain ``poll`` call while only raw sockets are busy.
#
# Why: a small pull on the direct path (:mod:`fleet.ps.server.direct_conns`) costs the server a
# wait, a read and a write. Through ``zmq.Poller.poll`` the wait alone was ~10 us of CPU before
# blocking (pyzmq builds its item list, libzmq polls every descriptor once without waiting, asks
# each ZeroMQ socket for its events -- each a call into its mailbox, a ``poll`` and a ``getpid`` --
# then polls again to block, and asks again on waking): measured on 2 cores, ~3.7 ``poll`` and
# 2.5 ``getpid`` calls per request, the largest part of the server's time around a 16-byte pull.
#
# A ZeroMQ socket's ``FD`` becomes readable whenever something may have changed for it, but only
# after its events were last read (it is edge-triggered: a message already waiting makes no new
# edge). So once a ZeroMQ poll has found no ZeroMQ socket ready, and the loop has not touched a
# ZeroMQ socket since (no receive, no send: :meth:`Waiter.settle` is told), any new message makes
# one of those ``FD`` readable. Until then the loop waits in one ``poll`` over the raw descriptors
# and the ZeroMQ ``FD``; when a ZeroMQ ``FD`` wakes it, it polls ZeroMQ again (without waiting),
# which reads the events properly. Nothing is missed: a message for ZeroMQ either came before the
# last ZeroMQ poll (which reported it) or after (its edge wakes the plain poll).

# plain ints: ZeroMQ's flags are enum members, and their arithmetic costs a call per wake-up
_ZIN, _ZOUT, _ZERR = int(zmq.POLLIN), int(zmq.POLLOUT), int(zmq.POLLERR)
_IN, _OUT = select.POLLIN, select.POLLOUT


def _os_flags(flags: int) -> int:
    return (_IN if flags & _ZIN else 0) | (_OUT if flags & _ZOUT else 0)


class Waiter:
    """A ``zmq.Poller`` (same ``register``/``modify``/``unregister``) that waits in a plain ``poll`` while it may.

    :meth:`poll` answers as ``dict(zmq.Poller.poll(...))`` does: ZeroMQ sockets and raw descriptors
    (ints) mapped to ZeroMQ's event flags.
    """

    def __init__(self) -> None:
        self._zmq = zmq.Poller()
        self._os = select.poll()
        self._zmq_fds: set[int] = set()  # the ZeroMQ sockets' FD: readable when their events may have changed
        #: True while the plain poll may stand for ZeroMQ's (see the module's docstring)
        self.quiet = False
        self.plain_waits = 0  # wake-ups served by the plain poll (for tests and stats)
        self.empty_wakes = 0  # ZeroMQ FD wake-ups with nothing to read (for tests and stats)

    def register(self, what: Any, flags: int) -> None:
        self._zmq.register(what, flags)
        if isinstance(what, int):
            self._os.register(what, _os_flags(int(flags)))
        else:
            fd = what.getsockopt(zmq.FD)
            self._zmq_fds.add(fd)
            self._os.register(fd, _IN)
        self.quiet = False

    modify = register

    def unregister(self, what: Any) -> None:
        self._zmq.unregister(what)
        if isinstance(what, int):
            self._os.unregister(what)
        else:
            fd = what.getsockopt(zmq.FD)
            self._zmq_fds.discard(fd)
            self._os.unregister(fd)
        self.quiet = False

    def poll(self, timeout_ms: int) -> dict[Any, int]:
        """Wait up to ``timeout_ms`` for any registered socket; what is ready, as ``dict(zmq.Poller.poll())``."""
        if not self.quiet:
            return dict(self._zmq.poll(timeout_ms))
        deadline = time.monotonic() + timeout_ms / 1000 if timeout_ms > 0 else 0.0
        spurious = False
        while True:
            ready: dict[Any, int] = {}
            for fd, events in self._os.poll(timeout_ms):
                if fd in self._zmq_fds:  # ZeroMQ may have something: ask it properly (it sees the raw ones too)
                    ready = dict(self._zmq.poll(0))
                    break
                ready[fd] = (
                    (_ZIN if events & _IN else 0)
                    | (_ZOUT if events & _OUT else 0)
                    | (_ZERR if events & ~(_IN | _OUT) else 0)
                )
            else:
                self.plain_waits += 1
                return ready
            if ready or timeout_ms == 0:
                self.quiet = False
                return ready
            # ZeroMQ's FD is readable whenever events *may* have changed (a peer's handshake, a pipe
            # attached): a wake-up with nothing to read. That poll read every socket's events, so the
            # plain poll may stand for ZeroMQ's again for what is left of the wait (an empty answer
            # means the time is up, as ZeroMQ's own poll would say); a second such wake-up hands the
            # rest of the wait to ZeroMQ's poll, so an FD that stays readable cannot spin this loop.
            self.empty_wakes += 1
            if timeout_ms > 0:
                timeout_ms = max(0, round((deadline - time.monotonic()) * 1000))
            if spurious:
                self.quiet = False
                return dict(self._zmq.poll(timeout_ms))
            spurious = True

    def settle(self, ready: dict[Any, int], touched_zmq: bool) -> None:
        """After the loop acted on ``ready`` (this wait's answer): may the next wait be the plain poll?

        Only when no ZeroMQ socket was in it and the loop received or sent nothing on one since
        (``touched_zmq``): then ZeroMQ's last poll read every socket's events, and a new message
        makes an edge on its ``FD``.
        """
        if touched_zmq:
            self.quiet = False
            return
        for key in ready:
            if type(key) is not int:
                self.quiet = False
                return
        self.quiet = True
