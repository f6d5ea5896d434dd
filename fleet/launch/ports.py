"""Free TCP ports for servers and the rendezvous store.

A port is found by binding port 0 and releasing it, so there is a window in
which another program can take it; a child that then fails to bind exits with
:data:`fleet.runtime.env.EXIT_PORT_IN_USE` and the supervisor relaunches the job with
fresh ports. Within one fleetrun, a port is never handed out twice.
"""

from __future__ import annotations

import socket


class PortAllocator:
    """Hands out free ports on one host, each at most once."""

    def __init__(self, host: str = "127.0.0.1", max_tries: int = 100):
        self.host = host
        self.max_tries = max_tries
        self._given: set[int] = set()

    def _probe(self) -> int:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((self.host, 0))
            return sock.getsockname()[1]

    def take(self) -> int:
        """One free port never handed out before by this allocator."""
        for _ in range(self.max_tries):
            port = self._probe()
            if port not in self._given:
                self._given.add(port)
                return port
        raise OSError(f"no fresh free port found on {self.host} after {self.max_tries} tries")

    def take_many(self, count: int) -> list[int]:
        return [self.take() for _ in range(count)]

    def reserve(self, port: int) -> None:
        """Mark a port chosen elsewhere (e.g. --master) so it is never handed out."""
        self._given.add(port)


def endpoint(host: str, port: int) -> str:
    """``host:port``, with IPv6 hosts in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
