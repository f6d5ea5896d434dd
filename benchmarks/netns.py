"""Two emulated hosts on one machine: network namespaces joined by a link with latency and a bandwidth limit.

    with TwoHosts("veth", rate_mbit=500) as hosts:          # a veth pair, tbf bandwidth limit
    with TwoHosts("delay", delay_ms=5, rate_mbit=500) as h:  # + 5 ms each way
        hosts.run(node_rank, [cmd...])                        # a command inside host 0 or 1

Each host is an emulated host of ``tests/hosts.py`` (the one harness of the multi-host tests): a
network namespace of its own with an address in 10.231.<n>.0/24 that exists only inside the two,
and its own host name, /dev/shm, boot id and temp directories, so that fleet's same-host
shortcuts cannot join the two and every byte between them crosses the link (``counters()``
reads it). Everything is deleted on exit (also after an error). Needs root (CAP_NET_ADMIN,
CAP_SYS_ADMIN). Start a host's processes with ``hosts.popen(host, argv, env=...)`` or with
``hosts.command(host, argv)`` and ``env=hosts.environment(host, env)``.

Before issue 35 the hosts were network namespaces only: they shared /dev/shm, the host name, the
boot id and TMPDIR, so fleet rightly took them for one host (see docs/scaling.md for which
earlier points that touched).

Why not ``tc netem``: this machine's kernel has no netem qdisc (``tc qdisc add ... netem``
fails with "Specified qdisc kind is unknown"; only tbf, htb and pfifo are built in). So:

- ``veth``: a veth pair, a token-bucket filter (``tbf``) on each end's egress limits the
  bandwidth. No added latency.
- ``delay``: the hosts are joined by two TUN devices and a delay line in user space (this
  file, run as its own process): every IP packet one host sends is held for ``delay_ms`` and
  then handed to the other host, in order; ``tbf`` on each TUN device limits the bandwidth as
  on the veth pair. The TUN MTU is 65,000 so that the delay line moves few, large packets
  (it costs some CPU per packet, which the benchmark counts as background load).

``python benchmarks/netns.py --check`` sets up each kind, pings with a TCP round trip and a
bulk transfer, and prints what the link does.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import heapq
import os
import select
import struct
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hosts import EmulatedHosts, ip  # noqa: E402 - the one emulated-hosts harness (tests/hosts.py)

CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
TUN_MTU = 65000


def _tc(namespace: str, *args: str) -> None:
    done = subprocess.run(["ip", "netns", "exec", namespace, "tc", *args], capture_output=True, text=True, timeout=20)
    if done.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)} in {namespace}: {done.stderr.strip()}")


def _limit(namespace: str, device: str, rate_mbit: float) -> None:
    burst = max(3 * TUN_MTU, int(rate_mbit * 1e6 / 8 / 250))
    args = ["qdisc", "add", "dev", device, "root", "tbf", "rate", f"{rate_mbit}mbit"]
    _tc(namespace, *args, "burst", str(burst), "latency", "200ms")


class TwoHosts(EmulatedHosts):
    """Two emulated hosts and the link between them (see the module docstring)."""

    def __init__(self, kind: str, *, delay_ms: float = 0.0, rate_mbit: float = 500.0, subnet: int | None = None):
        if kind not in ("veth", "delay"):
            raise ValueError(f"kind must be 'veth' or 'delay', got {kind!r}")
        super().__init__(subnet=subnet)
        self.kind, self.delay_ms, self.rate_mbit = kind, delay_ms, rate_mbit
        self.relay: subprocess.Popen | None = None

    @property
    def names(self) -> tuple[str, str]:
        return tuple(h.namespace for h in self.hosts)  # type: ignore[return-value]

    @property
    def addresses(self) -> tuple[str, str]:
        return tuple(h.address for h in self.hosts)  # type: ignore[return-value]

    @property
    def devices(self) -> tuple[str, str]:
        return tuple(h.device for h in self.hosts)  # type: ignore[return-value]

    @property
    def label(self) -> str:
        delay = f"+{self.delay_ms:g} ms each way" if self.kind == "delay" else "veth, no added delay"
        return f"2 hosts ({delay}, {self.rate_mbit:g} Mbit/s)"

    def _make_link(self) -> None:
        if self.kind == "veth":
            super()._make_link()
        else:
            self.relay = subprocess.Popen(
                [sys.executable, __file__, "--relay", *self.names, *self.devices, str(self.delay_ms)],
                stdout=subprocess.PIPE,
                text=True,
            )
            ready = self.relay.stdout.readline()
            if ready.strip() != "ready":
                raise RuntimeError(f"the delay line did not start: {ready!r}")
            for i, (name, dev, addr) in enumerate(zip(self.names, self.devices, self.addresses, strict=True)):
                peer = self.addresses[1 - i]
                ip("-n", name, "addr", "add", addr, "peer", peer, "dev", dev)
                ip("-n", name, "link", "set", dev, "mtu", str(TUN_MTU), "up")
        for name, dev in zip(self.names, self.devices, strict=True):
            _limit(name, dev, self.rate_mbit)

    def close(self) -> None:
        if self.relay is not None:
            self.relay.terminate()
            try:
                self.relay.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.relay.kill()
            self.relay.stdout.close()
            self.relay = None
        super().close()


# --------------------------------------------------------------------------- the delay line


def _enter(namespace: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {namespace}")
    finally:
        os.close(fd)


def _open_tun(namespace: str, device: str) -> int:
    _enter(namespace)  # a TUN device is created in the namespace of the thread that asks for it
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", device.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def relay(names: tuple[str, str], devices: tuple[str, str], delay_ms: float) -> None:
    """Move packets between the two TUN devices, each held ``delay_ms`` (runs until terminated)."""
    fds = [_open_tun(name, dev) for name, dev in zip(names, devices, strict=True)]
    for fd in fds:
        os.set_blocking(fd, False)
    print("ready", flush=True)
    delay = delay_ms / 1e3
    queue: list[tuple[float, int, int, bytes]] = []
    seq = 0
    other = {fds[0]: fds[1], fds[1]: fds[0]}
    while True:
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, _, out, packet = heapq.heappop(queue)
            try:
                os.write(out, packet)
            except OSError:
                pass  # the receiving side's queue is full (a real link drops too), or it is not up yet
        timeout = max(0.0, queue[0][0] - now) if queue else 1.0
        ready, _, _ = select.select(fds, [], [], timeout)
        arrived = time.monotonic()
        for fd in ready:
            while True:
                try:
                    packet = os.read(fd, TUN_MTU + 100)
                except BlockingIOError:
                    break
                seq += 1
                heapq.heappush(queue, (arrived + delay, seq, other[fd], packet))


# --------------------------------------------------------------------------- self-check


_ECHO = """
import socket, sys
def exact(c, n):
    buf = bytearray()
    while len(buf) < n:
        d = c.recv(min(1 << 20, n - len(buf)))
        if not d:
            sys.exit(0)
        buf += d
    return buf
s = socket.socket(); s.bind((sys.argv[1], 29555)); s.listen(1); print("up", flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while True:
    n = int.from_bytes(exact(c, 8), "little"); exact(c, n); c.sendall(b"k")
"""

_PING = """
import socket, statistics, sys, time
c = socket.create_connection((sys.argv[1], 29555)); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
def send(n):
    t = time.perf_counter(); c.sendall(n.to_bytes(8, "little") + b"0" * n); c.recv(1); return time.perf_counter() - t
rtt = statistics.median(send(1) for _ in range(20))
bulk = min(send(32 << 20) for _ in range(3))
print(f"round trip {rtt * 1e3:.2f} ms, bulk {32 * 1.048576 / bulk:.0f} MB/s")
"""


def check(host: TwoHosts) -> str:
    """A TCP round trip and a 32 MB transfer from host 0 to host 1 (and what crossed the link)."""
    server = host.popen(1, [sys.executable, "-c", _ECHO, host.addresses[1]], stderr=None)
    try:
        server.stdout.readline()
        argv = [sys.executable, "-c", _PING, host.addresses[1]]
        before = host.counters()
        done = subprocess.run(
            host.command(0, argv), env=host.environment(0), capture_output=True, text=True, timeout=120
        )
        moved = host.counters() - before
        return f"{(done.stdout or done.stderr).strip()}; the link carried {moved.tx / 1e6:.1f} MB out of host 0"
    finally:
        server.kill()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--relay", nargs=5, metavar=("NS_A", "NS_B", "DEV_A", "DEV_B", "DELAY_MS"))
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--rate", type=float, default=500.0)
    args = parser.parse_args()
    if args.relay:
        a, b, da, db, delay = args.relay
        relay((a, b), (da, db), float(delay))
        return
    if args.check:
        for kind, delay in (("veth", 0.0), ("delay", 0.0), ("delay", 1.0), ("delay", 5.0)):
            with TwoHosts(kind, delay_ms=delay, rate_mbit=args.rate) as host:
                print(f"{host.label}: {check(host)}", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
