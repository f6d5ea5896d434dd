"""Which network interface reaches a peer, so gloo binds there and not to whatever the hostname resolves to."""

from __future__ import annotations

import fcntl
import socket
import struct

_SIOCGIFADDR = 0x8915


def local_address_towards(host: str, port: int) -> str:
    """The local IP the kernel would use to reach ``host`` (no packet is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return probe.getsockname()[0]


def interface_with_address(address: str) -> str | None:
    """The name of the IPv4 interface holding ``address`` (Linux), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    return None


def interface_towards(host: str, port: int) -> str | None:
    try:
        return interface_with_address(local_address_towards(host, port))
    except OSError:
        return None
