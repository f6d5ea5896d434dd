"""Peer authentication with a shared secret, via ZeroMQ's ZAP and the PLAIN mechanism.

The server side is a ZAP handler (a REP socket on ``inproc://zeromq.zap.01``
of the server's own context) that the server's event loop polls like any
other socket, so no extra thread is needed. It accepts a peer only if its
PLAIN password equals the secret (constant-time compare). A refused peer is
disconnected by ZeroMQ during the handshake, before any of its frames reach
the server loop; the client sees ``EVENT_HANDSHAKE_FAILED_AUTH`` on its
socket monitor and reports :class:`~fleet.ps.errors.PSAuthError` instead of
waiting for a timeout.

PLAIN carries the secret in clear text on the connection: it keeps strangers
and stale jobs off a trusted network; it is not encryption.
"""

from __future__ import annotations

import hmac
import logging

import zmq

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"fleet"
_MAX_BATCH = 64


def check_secret(secret: bytes) -> bytes:
    """Validate and return the secret (PLAIN passwords are 1..255 bytes)."""
    if not isinstance(secret, bytes | bytearray) or not 1 <= len(secret) <= 255:
        raise ValueError("the shared secret must be 1..255 bytes (fleetrun passes it hex-encoded in FLEET_SECRET)")
    return bytes(secret)


def configure_server(sock: zmq.Socket) -> None:
    """Make ``sock`` require PLAIN credentials checked by this context's ZAP handler."""
    sock.plain_server = True
    sock.zap_domain = ZAP_DOMAIN


def configure_client(sock: zmq.Socket, secret: bytes, username: str) -> None:
    """Present ``secret`` as the PLAIN password; ``username`` shows up in the server's log."""
    sock.plain_username = username.encode()
    sock.plain_password = secret


class ZapHandler:
    """The server side of ZAP, polled by the server loop (call :meth:`serve` when readable)."""

    def __init__(self, ctx: zmq.Context, secret: bytes):
        self._secret = check_secret(secret)
        self.socket = ctx.socket(zmq.REP)
        self.socket.linger = 0
        self.socket.bind(ZAP_ENDPOINT)  # must exist before the authenticated socket binds
        self.rejected = 0

    def serve(self) -> None:
        """Answer the ZAP requests that are waiting (bounded)."""
        for _ in range(_MAX_BATCH):
            try:
                req = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(req) < 6:  # not a ZAP request; a REP socket must still answer to stay usable
                self.socket.send_multipart([b"1.0", b"", b"500", b"malformed ZAP request", b"", b""])
                continue
            version, request_id, _domain, address, _identity, mechanism = req[:6]
            creds = req[6:]
            ok = mechanism == b"PLAIN" and len(creds) == 2 and hmac.compare_digest(creds[1], self._secret)
            if not ok:
                self.rejected += 1
                log.warning("refused a peer from %s: wrong shared secret (mechanism %s)", address.decode(), mechanism)
            status = (b"200", b"OK") if ok else (b"400", b"wrong shared secret")
            self.socket.send_multipart([version, request_id, *status, creds[0] if ok else b"", b""])

    def close(self) -> None:
        self.socket.close()
