"""How a worker's IO thread reaches one parameter server: TCP, or the server's Unix socket on this host.

A route owns the socket the IO thread sends a server's requests on, and decides which one that
is (:mod:`fleet.ps.protocol.local` says when a server's Unix socket may be used). Requests go
over TCP from the start, while the route:

* **asks**: a HELLO goes to the server over TCP (again every second while the server is not up);
* **tries** the Unix socket the server offered, when this worker may use it: a second socket
  connects there and asks HELLO too;
* is **verified** when that HELLO was answered by the same server process as over TCP (the same
  incarnation): the IO thread moves the server's requests to the Unix socket, and closes the TCP
  one, at the first moment none of them is on the wire (:meth:`Route.switch`);
* **settles** on TCP otherwise: no offer, another host, a relay in between, no answer within
  :data:`TRY_S`, or a failed handshake there. With the same-host path off, a route starts settled
  on TCP, exactly as before it existed.

Why wait for a moment with nothing on the wire: one worker's requests to a server must arrive in
the order sent (a push before the pull behind it), and two connections keep no order between them.

After the switch nothing differs from TCP: a server that dies drops the connection (the monitor
reports it), a server restarted at the same endpoint binds the same path and the socket
reconnects by itself, and its new incarnation shows in the next HELLO.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator

import zmq
from zmq.utils.monitor import recv_monitor_message

from fleet.ps.protocol import local as same_host
from fleet.ps.protocol.wire import Message, Op, Status, encode

log = logging.getLogger(__name__)

#: how long a Unix socket the server offered may take to answer HELLO before the route keeps TCP
TRY_S = 5.0
ASK_EVERY_S = 1.0
#: what the IO thread hears from a socket's monitor
EVENTS = (
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
)
_FAILED = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL

_ASKING, _TRYING, _VERIFIED, _SETTLED = "asking", "trying", "verified", "settled"


class Route:
    """The socket to one server, and the choice between TCP and its Unix socket (see the module's docstring)."""

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        configure: Callable[[zmq.Socket, str], None],
        secret: bytes,
        worker_index: int,
        request_ids: Iterator[int],
        same_host_path: bool,
    ):
        self.endpoint = endpoint
        self._ctx, self._configure, self._secret = ctx, configure, secret
        self._worker, self._ids = worker_index, request_ids
        #: where :attr:`socket` is connected (a caller's own socket to this server follows it: fleet.ps.client.direct)
        self.address = f"tcp://{endpoint}"
        self.socket, self.monitor = self._open(self.address)
        self._trial_address = ""
        self._direct_offer: str | None = None
        #: the server's direct-path socket (fleet.ps.protocol.unix), once requests go over its Unix socket; else None
        self.direct_path: str | None = None
        #: "tcp" or "ipc": how requests travel now
        self.transport = "tcp"
        self._trial: tuple[zmq.Socket, zmq.Socket] | None = None
        self._asked: set[int] = set()  # request ids of this route's HELLOs
        self._state = _ASKING if same_host_path else _SETTLED
        self._next_ask = 0.0
        self._give_up = 0.0
        self._incarnation = 0
        #: set when the sockets to poll changed (the IO thread rebuilds its poller: :meth:`polled` clears it)
        self.changed = False

    @property
    def verified(self) -> bool:
        """Whether the server's Unix socket answered as the same process: call :meth:`switch` when nothing is on the wire."""
        return self._state == _VERIFIED

    def polled(self, rebuilding: bool = False) -> list[tuple[zmq.Socket, zmq.Socket]]:
        """(socket, monitor) pairs to poll: the route's own, and the Unix socket on trial.

        ``rebuilding``: the caller registers them anew, so :attr:`changed` is cleared.
        """
        if rebuilding:
            self.changed = False
        return [(self.socket, self.monitor), *([self._trial] if self._trial else [])]

    def _open(self, address: str) -> tuple[zmq.Socket, zmq.Socket]:
        sock = self._ctx.socket(zmq.DEALER)
        try:
            self._configure(sock, address)
            monitor = sock.get_monitor_socket(EVENTS)
            sock.connect(address)
        except BaseException:
            sock.close(linger=0)
            raise
        return sock, monitor

    def _ask(self, sock: zmq.Socket) -> None:
        msg = Message(op=Op.HELLO, peer=self._worker, request_id=next(self._ids), timeout_ms=int(TRY_S * 1000))
        self._asked.add(msg.request_id)
        try:
            sock.send_multipart(encode(msg), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            pass  # asked again in a second

    def tick(self, now: float) -> None:
        """Ask a server that has not answered yet again; give up a Unix socket that stays silent."""
        if self._state == _ASKING and now >= self._next_ask:
            self._next_ask = now + ASK_EVERY_S
            self._ask(self.socket)
        elif self._state == _TRYING and now >= self._give_up:
            log.info(
                "parameter server at %s: its Unix socket did not answer in %.0f s; keeping TCP", self.endpoint, TRY_S
            )
            self._settle_on_tcp()

    def answer(self, sock: zmq.Socket, reply: Message) -> bool:
        """Take ``reply`` if it answers one of this route's HELLOs (True); other replies are the IO thread's."""
        if reply.request_id not in self._asked:
            return False
        self._asked.discard(reply.request_id)
        if reply.op != Op.HELLO or reply.status != Status.OK:
            return True  # an error answer: asked again (asking) or given up at the deadline (trying)
        if self._state == _ASKING and sock is self.socket:
            self._incarnation = reply.arg
            try:
                offer = json.loads(bytes(reply.blob).decode("utf-8"))
            except ValueError:
                offer = {}
            address = same_host.usable(self._secret, offer, self.endpoint) if isinstance(offer, dict) else None
            if address is not None:
                self._direct_offer = same_host.usable_direct(self._secret, offer)
            if address is None:
                self._settle_on_tcp()
                return True
            try:
                self._trial = self._open(address)
                self._trial_address = address
            except zmq.ZMQError as exc:
                log.info("parameter server at %s: cannot connect to %s (%s); keeping TCP", self.endpoint, address, exc)
                self._settle_on_tcp()
                return True
            self._state, self._give_up, self.changed = _TRYING, time.monotonic() + TRY_S, True
            self._ask(self._trial[0])
        elif self._state == _TRYING and self._trial is not None and sock is self._trial[0]:
            if reply.arg == self._incarnation:
                self._state = _VERIFIED
            else:  # another process answers there: not the server this worker dialled
                self._settle_on_tcp()
        return True

    def trial_events(self, monitor: zmq.Socket) -> None:
        """Events of the Unix socket on trial: a failed handshake there keeps TCP."""
        while self._trial is not None and monitor is self._trial[1]:
            try:
                kind = recv_monitor_message(monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if kind & _FAILED and self._state in (_TRYING, _VERIFIED):
                log.info("parameter server at %s: handshake on its Unix socket failed; keeping TCP", self.endpoint)
                self._settle_on_tcp()
                return

    def switch(self) -> None:
        """Send on the verified Unix socket from now on (the caller knows no request is on the wire over TCP)."""
        assert self._state == _VERIFIED and self._trial is not None
        _close(self.socket, self.monitor)
        (self.socket, self.monitor), self._trial = self._trial, None
        self.address = self._trial_address
        self.direct_path = self._direct_offer
        self._state, self.transport, self.changed = _SETTLED, "ipc", True
        log.debug("parameter server at %s: reached through its Unix socket", self.endpoint)

    def _settle_on_tcp(self) -> None:
        if self._trial is not None:
            _close(*self._trial)
            self._trial = None
        self._state, self.changed = _SETTLED, True

    def close(self) -> None:
        if self._trial is not None:
            _close(*self._trial)
            self._trial = None
        _close(self.socket, self.monitor)


def _close(sock: zmq.Socket, monitor: zmq.Socket) -> None:
    try:
        sock.disable_monitor()
    except zmq.ZMQError:
        pass
    monitor.close(linger=0)
    sock.close(linger=0)
