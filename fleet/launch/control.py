"""The launchers' control channel across nodes: JSON lines signed with HMAC-SHA256.

Each line is ``{"body": "<json>", "mac": "<hex>"}`` where ``mac`` is
HMAC-SHA256 of ``body`` under the job's shared secret (``FLEET_SECRET``).
Lines that do not verify are dropped, so a stranger on the port can neither
join the job nor stop it. Messages are small and rare; no pickle, ever.

A node whose host went away, whose link was cut or whose fleetrun was stopped
(SIGSTOP) closes nothing: its socket just falls silent, and TCP would wait
many minutes to call it dead. So once the job runs, both ends send a ``ping``
several times per ``silent_after_s`` (:meth:`Peer.keep_alive`), and a peer
that sent nothing for that long counts as lost; every send and read is bounded
by the same time, and TCP keepalive and ``TCP_USER_TIMEOUT`` back this up in
the kernel. :meth:`Peer.close` shuts the socket down, which wakes a thread
blocked reading it, and never frees what that thread reads into.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import threading

MAX_LINE = 1 << 20  # a control message is a few hundred bytes; anything longer comes from a stranger
PINGS_PER_TIMEOUT = 4


class Peer:
    """One signed JSON-lines connection."""

    def __init__(self, sock: socket.socket, secret: str):
        self.sock = sock
        self._key = secret.encode()
        self._buffer = bytearray()
        self._send_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._reading = False
        self._closed = False
        self._stopped = threading.Event()  # the ping thread's end
        self.lost = ""  # why the connection ended, when it was not a clean close: "silent for 10 s"

    def keep_alive(self, silent_after_s: float) -> None:
        """From now on a peer silent for ``silent_after_s`` is lost, and this end pings so it is not."""
        self.sock.settimeout(silent_after_s)
        _tcp_keepalive(self.sock, silent_after_s)
        every = silent_after_s / PINGS_PER_TIMEOUT
        threading.Thread(target=self._ping, args=(every,), name="fleetrun-ping", daemon=True).start()

    def _ping(self, every: float) -> None:
        while not self._stopped.wait(every):
            if not self.send(type="ping"):
                return

    def send(self, **body: object) -> bool:
        payload = json.dumps(body, sort_keys=True)
        mac = hmac.new(self._key, payload.encode(), hashlib.sha256).hexdigest()
        line = json.dumps({"body": payload, "mac": mac}).encode() + b"\n"
        try:
            with self._send_lock:
                if self._closed:
                    return False
                self.sock.sendall(line)  # bounded by the socket's timeout once keep_alive ran
            return True
        except (OSError, ValueError):
            return False

    def recv(self) -> dict | None:
        """The next authentic message; None when the connection closed or fell silent. Forged lines are dropped."""
        with self._state_lock:
            if self._closed:
                return None
            self._reading = True
        try:
            while True:
                line = self._readline()
                if line is None:
                    return None
                try:
                    frame = json.loads(line)
                    payload, mac = frame["body"], frame["mac"]
                    expected = hmac.new(self._key, payload.encode(), hashlib.sha256).hexdigest()
                    if hmac.compare_digest(expected, mac):
                        message = json.loads(payload)
                        if message.get("type") != "ping":
                            return message
                except (ValueError, KeyError, TypeError, AttributeError):
                    pass
        finally:
            with self._state_lock:
                self._reading = False
                closed = self._closed
            if closed:
                self._release()  # close() left the descriptor to this reader

    def _readline(self) -> bytes | None:
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0:
                line = bytes(self._buffer[:end])
                del self._buffer[: end + 1]
                return line
            if len(self._buffer) > MAX_LINE:
                self.lost = f"sent a line over {MAX_LINE} bytes"
                return None
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                self.lost = f"silent for {self.sock.gettimeout():g} s"
                return None
            except (OSError, ValueError):  # reset, or closed under us: the connection is gone either way
                return None
            if not chunk:
                return None
            self._buffer += chunk

    def close(self) -> None:
        """End the connection now: a blocked reader wakes up (and then lets go of the socket itself)."""
        self._stopped.set()
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
            reading = self._reading
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked recv or sendall; never blocks itself
        except OSError:
            pass
        if not reading:
            self._release()

    def _release(self) -> None:
        with self._send_lock:  # a sender woken by the shutdown lets go first: no write to a reused descriptor
            try:
                self.sock.close()
            except OSError:
                pass


def _tcp_keepalive(sock: socket.socket, silent_after_s: float) -> None:
    """The kernel gives up on a peer that stopped acknowledging within about ``silent_after_s`` too."""
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    idle = max(1, int(silent_after_s / 2))
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", max(1, idle // 3)), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            options.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    if hasattr(socket, "TCP_USER_TIMEOUT"):  # unacknowledged data: fail the send instead of retrying for minutes
        options.append((socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(silent_after_s * 1000)))
    for level, name, value in options:
        try:
            sock.setsockopt(level, name, value)
        except OSError:
            pass  # a socketpair or another family: the application pings still bound every wait
