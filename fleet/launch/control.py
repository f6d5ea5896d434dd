"""The launchers' control channel across nodes: JSON lines signed with HMAC-SHA256.

Each line is ``{"body": "<json>", "mac": "<hex>"}`` where ``mac`` is
HMAC-SHA256 of ``body`` under the job's shared secret (``FLEET_SECRET``).
Lines that do not verify are dropped, so a stranger on the port can neither
join the job nor stop it. Messages are small and rare; no pickle, ever.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import threading


class Peer:
    """One signed JSON-lines connection."""

    def __init__(self, sock: socket.socket, secret: str):
        self.sock = sock
        self._key = secret.encode()
        self._reader = sock.makefile("rb")
        self._lock = threading.Lock()

    def send(self, **body: object) -> bool:
        payload = json.dumps(body, sort_keys=True)
        mac = hmac.new(self._key, payload.encode(), hashlib.sha256).hexdigest()
        line = json.dumps({"body": payload, "mac": mac}).encode() + b"\n"
        try:
            with self._lock:
                self.sock.sendall(line)
            return True
        except OSError:
            return False

    def recv(self) -> dict | None:
        """The next authentic message; None when the connection closed. Forged lines are dropped."""
        while True:
            try:
                line = self._reader.readline()
            except OSError:
                return None
            if not line:
                return None
            try:
                frame = json.loads(line)
                payload, mac = frame["body"], frame["mac"]
                expected = hmac.new(self._key, payload.encode(), hashlib.sha256).hexdigest()
                if hmac.compare_digest(expected, mac):
                    return json.loads(payload)
            except (ValueError, KeyError, TypeError, AttributeError):
                pass

    def close(self) -> None:
        for closer in (self._reader.close, lambda: self.sock.shutdown(socket.SHUT_RDWR), self.sock.close):
            try:
                closer()
            except OSError:
                pass
