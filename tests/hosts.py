"""Emulated hosts that are hosts: the one harness for every multi-host test and benchmark (issue 35).

    with EmulatedHosts() as hosts:                       # two hosts, A (index 0) and B (index 1)
        proc = hosts.popen(0, [sys.executable, "train.py"], env={...})
        before = hosts.counters()                        # bytes through the link (host A's end)
        hosts.blip(3.0)                                  # link down for 3 s, then up (in a thread)
        hosts.cut(); hosts.restore(); hosts.squeeze(1)   # down / up / 1 Mbit/s token bucket
        hosts.kill_host(1)                               # SIGKILL every process of host B

An emulated host is what fleet would see on a machine of its own, as far as one kernel allows:

- its own **network namespace** (``fh<tag>-a``), joined to the other host's by a **veth pair**,
  with an address in ``10.231.<n>.0/24`` that exists only inside the two namespaces, and ``lo`` up;
- its own **UTS name** (``fh<tag>-a``: ``socket.gethostname()``), through ``unshare --uts``;
- its own **/dev/shm**: a fresh tmpfs, mounted in a private mount namespace (``unshare --mount
  --propagation private``), so a segment one host makes is invisible to the other;
- its own **boot id** (``/proc/sys/kernel/random/boot_id``) and **machine id** (``/etc/machine-id``),
  random files bind-mounted over the real ones in that mount namespace;
- its own ``TMPDIR`` (where fleet's parameter-server Unix sockets go), ``XDG_RUNTIME_DIR`` (on-host
  secret files) and ``XDG_STATE_HOME`` (default log directories), under ``/tmp/fh<tag>-a/``.

What the hosts still share: the kernel (and so the pid namespace: a host's processes see the
other's), the file system outside those directories (as a cluster shares its code over NFS), the
user, and the cores. ``private=False`` gives the old emulation (network namespaces only, one
/dev/shm, host name and boot id for both): only for a test that shows a shortcut is caught.

Every process a host runs is started through :meth:`command` (``ip netns exec NS unshare ... sh -c
'hostname ...; mount ...; exec CMD'``); :meth:`popen` also tracks it. Teardown (``__exit__``, also
after an error) kills every process left in either namespace, deletes the namespaces (and with
them the veth pair) and removes the hosts' directories; the private tmpfs goes with its last process.
Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN); :func:`unavailable` says why not, for a skip.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

#: run inside the host's namespaces: name it, give it its own /dev/shm and boot id, then exec the command
_ENTER = r"""
set -e
hostname "$1"
mount -t tmpfs -o mode=1777,size=1g fleet-host-shm /dev/shm
mount --bind "$2/boot_id" /proc/sys/kernel/random/boot_id
if [ -e /etc/machine-id ]; then mount --bind "$2/machine-id" /etc/machine-id; fi
shift 2
exec "$@"
"""

_counter = itertools.count(1)


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


_PROBED: str | None | bool = False


def unavailable() -> str | None:
    """Why emulated hosts cannot be made here (for ``pytest.skip``), or None when they can (probed once)."""
    global _PROBED
    if _PROBED is not False:
        return _PROBED  # type: ignore[return-value]
    reason = None
    if os.geteuid() != 0:
        reason = "emulated hosts need root (network and mount namespaces)"
    elif not all(shutil.which(tool) for tool in ("ip", "unshare", "mount", "hostname")):
        reason = "emulated hosts need ip, unshare, mount and hostname"
    else:
        try:
            with EmulatedHosts(probe=True) as hosts:
                done = subprocess.run(
                    hosts.command(0, ["cat", "/proc/sys/kernel/random/boot_id"]),
                    capture_output=True,
                    text=True,
                    timeout=20,
                )
                if done.returncode != 0 or done.stdout.strip() != hosts.hosts[0].boot_id:
                    reason = f"a private mount and UTS namespace cannot be made here: {done.stderr.strip()[-300:]}"
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            reason = f"network namespaces cannot be created here (needs root and CAP_SYS_ADMIN): {exc}"
    _PROBED = reason
    return reason


@dataclass(frozen=True)
class Host:
    """One emulated host: its network namespace, its end of the link, its address, name and directories."""

    index: int
    namespace: str
    device: str
    address: str
    hostname: str
    root: Path  # its private directories: tmp/, run/, state/, boot_id, machine-id
    boot_id: str

    @property
    def tmpdir(self) -> Path:
        return self.root / "tmp"

    def environment(self) -> dict[str, str]:
        """The variables that make this host's temp, runtime and state directories its own."""
        return {
            "TMPDIR": str(self.tmpdir),
            "XDG_RUNTIME_DIR": str(self.root / "run"),
            "XDG_STATE_HOME": str(self.root / "state"),
        }


@dataclass(frozen=True)
class Counters:
    """Bytes through one end of the link (its ``/sys/class/net/DEV/statistics``)."""

    rx: int
    tx: int

    def __sub__(self, other: Counters) -> Counters:
        return Counters(self.rx - other.rx, self.tx - other.tx)


class EmulatedHosts:
    """Two emulated hosts joined by a veth pair (see the module docstring); a context manager."""

    def __init__(self, *, subnet: int | None = None, private: bool = True, probe: bool = False):
        tag = f"{os.getpid() % 100000}{'p' if probe else ''}{next(_counter)}"
        n = subnet if subnet is not None else 1 + (os.getpid() + next(_counter)) % 250
        self.private = private
        self.hosts: list[Host] = []
        for i, letter in enumerate("ab"):
            name = f"fh{tag}-{letter}"
            root = Path("/tmp", name)  # short: TMPDIR must leave room in a Unix socket's path
            self.hosts.append(
                Host(i, name, f"fv{tag}{letter}"[:15], f"10.231.{n}.{i + 1}", name, root, str(uuid.uuid4()))
            )
        self._procs: list[subprocess.Popen] = []
        self._made: list[str] = []
        self._shaped = False

    # ------------------------------------------------------------------ life cycle
    def __enter__(self) -> EmulatedHosts:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self) -> None:
        for host in self.hosts:
            shutil.rmtree(host.root, ignore_errors=True)
            for sub in ("tmp", "state"):
                (host.root / sub).mkdir(parents=True)
            (host.root / "run").mkdir(mode=0o700)
            (host.root / "boot_id").write_text(host.boot_id + "\n")
            (host.root / "machine-id").write_text(uuid.uuid4().hex + "\n")
            ip("netns", "add", host.namespace)
            self._made.append(host.namespace)
            ip("-n", host.namespace, "link", "set", "lo", "up")
        self._make_link()

    def _make_link(self) -> None:
        """The veth pair, one end in each host, addressed and up (a subclass may join the hosts otherwise)."""
        a, b = self.hosts
        ip("link", "add", a.device, "type", "veth", "peer", "name", b.device)
        for host in self.hosts:
            ip("link", "set", host.device, "netns", host.namespace)
            ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.device)
            ip("-n", host.namespace, "link", "set", host.device, "up")

    def close(self) -> None:
        """Kill what runs on the hosts, delete the namespaces and the hosts' directories (never raises)."""
        for host in self.hosts:
            if host.namespace in self._made:
                self.kill_host(host.index)
        for proc in self._procs:
            try:
                proc.kill()
                proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
            for stream in (proc.stdout, proc.stderr, proc.stdin):
                if stream is not None:
                    stream.close()
        self._procs.clear()
        for name in self._made:
            ip("netns", "del", name, check=False)
        self._made.clear()
        for host in self.hosts:
            shutil.rmtree(host.root, ignore_errors=True)

    # ------------------------------------------------------------------ processes
    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` as host ``host`` runs it: inside its network namespace, with its name, /dev/shm and boot id."""
        h = self.hosts[host]
        if not self.private:
            return ["ip", "netns", "exec", h.namespace, *argv]
        unshare = ["unshare", "--uts", "--mount", "--propagation", "private"]
        return ["ip", "netns", "exec", h.namespace, *unshare, "sh", "-c", _ENTER, "sh", h.hostname, str(h.root), *argv]

    def environment(self, host: int, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """``env`` (default: this process's environment) with the host's own directories (when private)."""
        merged = dict(os.environ if env is None else env)
        if self.private:
            merged.update(self.hosts[host].environment())
        return merged

    def popen(
        self, host: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None, **kwargs
    ) -> subprocess.Popen:
        """Start ``argv`` on host ``host`` (stdout and stderr together, as text, unless ``kwargs`` say otherwise)."""
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.STDOUT)
        kwargs.setdefault("text", True)
        proc = subprocess.Popen(self.command(host, argv), env=self.environment(host, env), **kwargs)
        self._procs.append(proc)
        return proc

    def pids(self, host: int) -> list[int]:
        """Every process in host ``host``'s network namespace."""
        done = ip("netns", "pids", self.hosts[host].namespace, check=False)
        return [int(p) for p in done.stdout.split()]

    def kill_host(self, host: int, sig: int = signal.SIGKILL) -> list[int]:
        """Send ``sig`` to every process of host ``host`` (the host is lost); the pids signalled."""
        pids = self.pids(host)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    # ------------------------------------------------------------------ the link
    def counters(self, host: int = 0) -> Counters:
        """Bytes host ``host``'s end of the link received and sent so far."""
        h = self.hosts[host]
        done = ip("-s", "-j", "-n", h.namespace, "link", "show", "dev", h.device)
        stats = json.loads(done.stdout)[0]["stats64"]
        return Counters(int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"]))

    def cut(self) -> None:
        """Take the link down (host A's end: the veth pair loses its carrier on both sides)."""
        a = self.hosts[0]
        ip("-n", a.namespace, "link", "set", a.device, "down")

    def restore(self) -> None:
        a = self.hosts[0]
        ip("-n", a.namespace, "link", "set", a.device, "up")

    def blip(self, seconds: float) -> threading.Thread:
        """Cut the link now and restore it after ``seconds``, in a thread (join it to know the link is back)."""
        self.cut()

        def back() -> None:
            time.sleep(seconds)
            self.restore()

        thread = threading.Thread(target=back, name="link-blip", daemon=True)
        thread.start()
        return thread

    def squeeze(self, rate_mbit: float = 1.0, *, burst: str = "32kbit", latency: str = "400ms") -> None:
        """Limit both ends' sending to ``rate_mbit`` with a token bucket (``tc ... tbf``); :meth:`unsqueeze` undoes it."""
        if shutil.which("tc") is None:
            raise RuntimeError("tc is not installed (apt-get install -y iproute2)")
        for h in self.hosts:
            argv = ["tc", "qdisc", "replace", "dev", h.device, "root", "tbf", "rate", f"{rate_mbit}mbit"]
            done = subprocess.run(
                ["ip", "netns", "exec", h.namespace, *argv, "burst", burst, "latency", latency],
                capture_output=True,
                text=True,
                timeout=20,
            )
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(argv)} in {h.namespace}: {done.stderr.strip()}")
        self._shaped = True

    def unsqueeze(self) -> None:
        for h in self.hosts:
            subprocess.run(
                ["ip", "netns", "exec", h.namespace, "tc", "qdisc", "del", "dev", h.device, "root"],
                capture_output=True,
                timeout=20,
            )
        self._shaped = False


def wait_for(path: Path, timeout_s: float, procs: Sequence[subprocess.Popen] = ()) -> None:
    """Wait (bounded) until ``path`` exists; fail early when one of ``procs`` has exited."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        ended = [p for p in procs if p.poll() is not None]
        if ended:
            raise AssertionError(f"a process exited (rc {ended[0].returncode}) before {path} appeared")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear within {timeout_s:g} s")
        time.sleep(0.05)


def reference_checksum(out_features: int, steps: int) -> float:
    """tests/scripts/hosts_train.py's final checksum (a Linear(256, out_features)) as single-process training
    on both workers' batches computes it."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(256, out_features)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        grads = []
        for worker in range(2):
            x = torch.randn(16, 256, generator=torch.Generator().manual_seed(100 * step + worker))
            model.zero_grad()
            model(x).pow(2).mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, g0, g1 in zip(model.parameters(), *grads, strict=True):
            p.grad = (g0 + g1) / 2
        opt.step()
    return sum(float(p.detach().double().sum()) for p in model.parameters())
