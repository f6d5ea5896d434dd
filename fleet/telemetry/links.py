"""Per-peer link accounting: what this process sent to and received from each other host, and how long the
kernel spent sending it, from the TCP counters of its own sockets.

Every byte fleet exchanges with another host goes over a TCP connection this process holds: gloo's
collectives (all-reduce, sharding's reduce-scatters and all-gathers), the rendezvous store and its
heartbeats, parameter-server requests (ZeroMQ's sockets are this process's file descriptors too). So
instead of timing each call per peer, which a ring all-reduce cannot do (gloo waits on its neighbours inside
one call), :class:`LinkCounters` reads the kernel's ``TCP_INFO`` of every TCP socket the process holds
(``/proc/self/fd``: a ``getsockopt`` on a duplicate of each socket descriptor) and sums it per peer:

- ``sent`` / ``received``: bytes acknowledged by the peer / received from it (``tcpi_bytes_acked``,
  ``tcpi_bytes_received``);
- ``busy_s``: seconds the connection had data in flight or waiting to be sent (``tcpi_busy_time``, Linux 4.10+,
  counted in jiffies), less the seconds it was stalled by the *peer's* receive window (``tcpi_rwnd_limited``:
  the peer process did not read, its slowness, not the link's). What is left is the time the link (or this
  side's send buffer, filled because the link drains slowly) held this process's data back. ``sent /
  busy_s`` is the rate the link gave this connection while it had something to send.

A peer is a host address; a parameter server this process knows (the role's ``server_endpoints``) is its
own peer, ``host:port``. Sockets to this host (loopback, or the peer's address equal to the socket's own
local address) are left out: only links to other hosts are accounted, so a one-host job records nothing.
A socket's counters are kept after it closes (the last sample of them), and :meth:`LinkCounters.mark`
sets the baseline at the first timed step, so the figures cover the same steps as the step timings.

Cost: one ``listdir`` of ``/proc/self/fd`` and a ``readlink`` per descriptor, and a few syscalls per TCP
connection to another host (a socket found to be anything else is not looked at again), taken when the worker's
summary is written (at most once a second, never on every step), and spaced so that sampling stays under
0.1 % of the run (:data:`MAX_SHARE`). The reports' rule that names a slow link is
:func:`fleet.telemetry.link_report.link_summary`. Linux only: elsewhere nothing is recorded.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import time
from collections.abc import Container
from typing import Any

TCP_INFO_LEN = 192
"""Bytes of ``struct tcp_info`` asked for: through ``tcpi_sndbuf_limited`` (Linux 4.10; an older kernel gives
less, and then no link time)."""
MAX_SHARE = 0.001
"""Sampling takes at most this share of the run's wall time (a slow sample spaces out the next one)."""
MIN_GAP_S = 1.0
"""Samples are at least this far apart, but for :meth:`LinkCounters.sample` with ``force``."""
MAX_SOCKETS = 4096
"""Closed sockets whose last counters are kept, at most (the oldest are folded into a per-peer remainder)."""

_FD_DIR = "/proc/self/fd"


def parse_tcp_info(info: bytes) -> dict[str, float] | None:
    """The counters fleet uses from a raw ``struct tcp_info`` (None when it is too short to hold them).

    Offsets (``include/uapi/linux/tcp.h``): bytes_acked 120, bytes_received 128, busy_time 168,
    rwnd_limited 176, sndbuf_limited 184 (u64, microseconds for the three times)."""
    if len(info) < 136:
        return None
    sent, received = struct.unpack_from("=QQ", info, 120)
    out = {"sent": float(sent), "received": float(received), "busy_s": 0.0, "timed": 0.0}
    if len(info) >= 192:
        busy, rwnd, _ = struct.unpack_from("=QQQ", info, 168)
        out["busy_s"] = max(busy - rwnd, 0) / 1e6
        out["timed"] = 1.0
    return out


def _host(address: str) -> str:
    """An address as one spelling: an IPv4-mapped IPv6 address as its IPv4 form."""
    try:
        parsed = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
        return str(parsed.ipv4_mapped)
    return str(parsed)


def other_host(local: str, peer: str) -> bool:
    """Whether a connection from ``local`` to ``peer`` leaves this host."""
    local, peer = _host(local), _host(peer)
    try:
        if ipaddress.ip_address(peer).is_loopback:
            return False
    except ValueError:
        pass
    return peer != local


def peer_name(peer: tuple[str, int], servers: frozenset[str] = frozenset()) -> str:
    """The peer a connection counts for: ``host:port`` for a known server endpoint, else the host address."""
    host = _host(peer[0])
    endpoint = f"[{host}]:{peer[1]}" if ":" in host else f"{host}:{peer[1]}"
    return endpoint if endpoint in servers else host


Row = tuple[int, "tuple[str, int] | None", "tuple[str, int] | None", bytes]
"""(inode, local address, peer address, raw tcp_info); the addresses None for a socket that is no TCP connection."""


def _own_sockets(ignore: Container[int] = ()) -> list[Row]:
    """A :data:`Row` for each socket this process holds, but those in ``ignore`` (by inode)."""
    found: list[Row] = []
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return found
    for name in names:
        try:
            link = os.readlink(f"{_FD_DIR}/{name}")
            if not link.startswith("socket:[") or int(link[8:-1]) in ignore:
                continue
            inode = int(link[8:-1])
            fd = os.dup(int(name))  # a duplicate: closing our socket object must not close the owner's
        except (OSError, ValueError):
            continue  # closed meanwhile (or the listdir's own descriptor)
        try:
            sock = socket.socket(fileno=fd)
        except (OSError, ValueError):  # a family Python does not know
            os.close(fd)
            found.append((inode, None, None, b""))
            continue
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                found.append((inode, None, None, b""))
                continue
            peer = sock.getpeername()
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_LEN)
            found.append((inode, sock.getsockname()[:2], peer[:2], info))
        except OSError:
            pass  # not connected (a listener, or one still connecting: asked again next time), or gone
        finally:
            sock.close()
    return found


class LinkCounters:
    """This process's bytes and link time per peer on other hosts (see the module docstring)."""

    def __init__(self, servers: frozenset[str] = frozenset(), clock: Any = time.perf_counter, read: Any = None):
        self.servers = servers
        self._clock = clock
        self._read = read or _own_sockets
        self._sockets: dict[int, tuple[str, dict[str, float]]] = {}  # inode -> (peer, latest counters)
        self._baseline: dict[int, dict[str, float]] = {}
        self._folded: dict[str, dict[str, float]] = {}  # counters of sockets forgotten past MAX_SOCKETS
        self._ignored: set[int] = set()  # sockets that are no link to another host (unix, same host, UDP...)
        self._next = 0.0
        self._spent = 0.0
        self.enabled = hasattr(socket, "TCP_INFO") and os.path.isdir(_FD_DIR)

    def sample(self, force: bool = False) -> None:
        """Read the counters now (unless the last sample was too recent, and not ``force``)."""
        if not self.enabled:
            return
        began = self._clock()
        if not force and began < self._next:
            return
        for inode, local, peer, info in self._read(self._ignored):
            if local is None or peer is None or not other_host(local[0], peer[0]):
                self._ignored.add(inode)  # no TCP connection to another host, now or later: not read again
                continue
            counters = parse_tcp_info(info)
            if counters is not None:
                self._sockets[inode] = (peer_name(peer, self.servers), counters)
        if len(self._ignored) > 16 * MAX_SOCKETS:  # many short-lived sockets: look at the open ones afresh
            self._ignored.clear()
        if len(self._sockets) > MAX_SOCKETS:
            for inode in list(self._sockets)[: len(self._sockets) - MAX_SOCKETS]:
                peer, counters = self._sockets.pop(inode)
                base = self._baseline.pop(inode, {})
                folded = self._folded.setdefault(peer, {"sent": 0.0, "received": 0.0, "busy_s": 0.0, "timed": 0.0})
                for key in ("sent", "received", "busy_s"):
                    folded[key] += counters[key] - base.get(key, 0.0)
                folded["timed"] = max(folded["timed"], counters["timed"])
        now = self._clock()
        self._spent += now - began
        self._next = now + max(MIN_GAP_S, (now - began) / MAX_SHARE)

    def mark(self) -> None:
        """The baseline: what the sockets held now is not counted (called at the first timed step)."""
        self.sample(force=True)
        self._baseline = {inode: dict(counters) for inode, (_, counters) in self._sockets.items()}
        self._folded.clear()

    def peers(self) -> dict[str, dict[str, Any]]:
        """Per peer since :meth:`mark`: bytes sent and received, link seconds (None where the kernel does not
        count them), and the connections seen."""
        out: dict[str, dict[str, Any]] = {}
        for peer, counters in self._folded.items():
            out[peer] = {**counters, "connections": 0}
        for inode, (peer, counters) in self._sockets.items():
            base = self._baseline.get(inode, {})
            row = out.setdefault(peer, {"sent": 0.0, "received": 0.0, "busy_s": 0.0, "timed": 0.0, "connections": 0})
            for key in ("sent", "received", "busy_s"):
                row[key] += max(counters[key] - base.get(key, 0.0), 0.0)
            row["timed"] = max(row["timed"], counters["timed"])
            row["connections"] += 1
        return {
            peer: {
                "sent_bytes": int(row["sent"]),
                "received_bytes": int(row["received"]),
                "busy_s": round(row["busy_s"], 6) if row["timed"] else None,
                "connections": row["connections"],
            }
            for peer, row in sorted(out.items())
            if row["sent"] or row["received"]
        }

    @property
    def spent_s(self) -> float:
        """Seconds spent sampling so far (for the cost claim in the module docstring)."""
        return self._spent
