"""Peer authentication with a shared secret, via ZeroMQ's ZAP and the PLAIN mechanism.

The server side is a ZAP handler (a REP socket on ``inproc://zeromq.zap.01``
of the server's own context) that the server's event loop polls like any
other socket, so no extra thread is needed. It accepts a peer only if its
PLAIN password equals the secret (constant-time compare). A refused peer is
disconnected by ZeroMQ during the handshake, before any of its frames reach
the server loop; the client sees ``EVENT_HANDSHAKE_FAILED_AUTH`` on its
socket monitor and reports :class:`~fleet.ps.protocol.errors.PSAuthError` instead of
waiting for a timeout.

PLAIN carries the secret in clear text on the connection: it keeps strangers
and stale jobs off a trusted network; it is not encryption. The ``curve``
option (``DistributedStrategy.ps_encryption``) uses ZeroMQ's CURVE mechanism
instead: every connection is encrypted and authenticated both ways, and the
secret itself never travels. Both key pairs are derived from the job's secret
(HMAC-SHA256 with fixed labels), so whoever holds the secret knows the
server's public key and the workers' key pair, and nobody else can take part:
a client that does not know the servers' secret key cannot complete the
handshake with it, a server that does not know it cannot pretend to be one,
and the ZAP handler admits only the workers' public key.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
from typing import Literal

import zmq
from zmq.utils import z85

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"fleet"
_MAX_BATCH = 64

Encryption = Literal["none", "curve"]
ENCRYPTIONS = ("none", "curve")


def check_secret(secret: bytes) -> bytes:
    """Validate and return the secret (PLAIN passwords are 1..255 bytes)."""
    if not isinstance(secret, bytes | bytearray) or not 1 <= len(secret) <= 255:
        raise ValueError("the shared secret must be 1..255 bytes (fleetrun passes it hex-encoded in FLEET_SECRET)")
    return bytes(secret)


def check_encryption(encryption: str) -> Encryption:
    """Validate the transport's encryption; CURVE needs a libzmq built with it."""
    if encryption not in ENCRYPTIONS:
        raise ValueError(f"encryption={encryption!r}; expected one of {', '.join(ENCRYPTIONS)}")
    if encryption == "curve" and not zmq.has("curve"):
        raise ValueError(
            "encryption='curve' needs a libzmq built with CURVE support (libsodium), and this one "
            f"(libzmq {zmq.zmq_version()}, zmq.has('curve') is False) has none: install pyzmq's own wheel"
        )
    return encryption  # type: ignore[return-value]


def _key(secret: bytes, role: str) -> bytes:
    """A CURVE secret key (Z85) for ``role``, derived from the job's secret: any 32 bytes are a valid one."""
    return z85.encode(hmac.new(secret, f"fleet-ps-curve:{role}".encode(), hashlib.sha256).digest())


def curve_keys(secret: bytes) -> dict[str, bytes]:
    """The servers' and the workers' CURVE key pairs (Z85), as derived from ``secret``."""
    server, client = _key(secret, "server"), _key(secret, "worker")
    return {
        "server_secret": server,
        "server_public": zmq.curve_public(server),
        "client_secret": client,
        "client_public": zmq.curve_public(client),
    }


def configure_server(sock: zmq.Socket, encryption: Encryption = "none", secret: bytes = b"") -> None:
    """Make ``sock`` require credentials checked by this context's ZAP handler (PLAIN, or CURVE)."""
    if encryption == "curve":
        keys = curve_keys(check_secret(secret))
        sock.curve_server = True
        sock.curve_secretkey = keys["server_secret"]
        sock.curve_publickey = keys["server_public"]
    else:
        sock.plain_server = True
    sock.zap_domain = ZAP_DOMAIN


def configure_client(sock: zmq.Socket, secret: bytes, username: str, encryption: Encryption = "none") -> None:
    """PLAIN: present ``secret`` as the password (``username`` shows up in the server's log). CURVE: the workers' keys."""
    if encryption == "curve":
        keys = curve_keys(secret)
        sock.curve_serverkey = keys["server_public"]
        sock.curve_secretkey = keys["client_secret"]
        sock.curve_publickey = keys["client_public"]
        return
    sock.plain_username = username.encode()
    sock.plain_password = secret


def _transport(address: bytes) -> str:
    """How a ZAP request's peer came: TCP gives its IP address; a Unix socket "localhost:<uid>:<gid>:<pid>"."""
    try:
        ipaddress.ip_address(address.decode(errors="replace"))
    except ValueError:
        return "ipc"
    return "tcp"


class ZapHandler:
    """The server side of ZAP, polled by the server loop (call :meth:`serve` when readable)."""

    def __init__(self, ctx: zmq.Context, secret: bytes, encryption: Encryption = "none"):
        self._secret = check_secret(secret)
        self._mechanism = b"CURVE" if encryption == "curve" else b"PLAIN"
        # CURVE's credential is the client's public key (32 bytes): only the workers' derived one is admitted
        self._client_key = z85.decode(curve_keys(self._secret)["client_public"]) if encryption == "curve" else b""
        self.socket = ctx.socket(zmq.REP)
        self.socket.linger = 0
        self.socket.bind(ZAP_ENDPOINT)  # must exist before the authenticated socket binds
        self.rejected = 0
        #: peers admitted, by how they came: "tcp", or "ipc" (a Unix socket, fleet.ps.protocol.local)
        self.admitted = {"tcp": 0, "ipc": 0}

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
            if self._mechanism == b"CURVE":
                ok = mechanism == b"CURVE" and len(creds) == 1 and hmac.compare_digest(creds[0], self._client_key)
                creds = [b"worker"]  # the user id reported to the socket
            else:
                ok = mechanism == b"PLAIN" and len(creds) == 2 and hmac.compare_digest(creds[1], self._secret)
            if ok:
                self.admitted[_transport(address)] += 1
            else:
                self.rejected += 1
                log.warning("refused a peer from %s: wrong shared secret (mechanism %s)", address.decode(), mechanism)
            status = (b"200", b"OK") if ok else (b"400", b"wrong shared secret")
            self.socket.send_multipart([version, request_id, *status, creds[0] if ok and creds else b"", b""])

    def close(self) -> None:
        self.socket.close()
