"""Rendezvous: the torch.distributed store every process of a job meets at.

The process of rank 0 hosts the store on a socket it binds itself, so the store
listens only on the configured address (loopback for local runs), never on all
interfaces. Under torchrun the launcher's agent already hosts it.

The store itself has no access control: any process that reaches its port reads and
writes every key. :func:`join` makes that harmless for a job with a secret: processes
prove they hold it by challenge-response, every value written afterwards carries a MAC
(:class:`~fleet.runtime.signed_store.SignedStore`), and what an outsider writes is refused as
tampering, never blamed on a rank. See "Threat model" in docs/security.md for what remains.

Every call to the store here has a deadline (:func:`bounded`, over
:func:`fleet.runtime.store_calls.within`): torch's client ignores its timeout against a store
whose host stops answering without closing the connection (a SIGSTOPped rank 0, a host gone, a
cut link), so without one ``fleet.init`` would hang for TCP's quarter of an hour. A silent store
fails the call within the strategy's ``timeout_s`` + :data:`MARGIN_S`, naming the store's address.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import secrets
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from fleet.errors import FleetError, PeerError, StoreTamperedError
from fleet.roles import RoleInfo
from fleet.runtime import env
from fleet.runtime.signed_store import SignedStore, session_key
from fleet.runtime.store_calls import StoreSilentError, within

_listeners: list[socket.socket] = []
T = TypeVar("T")
MARGIN_S = 5.0
"""Beyond the strategy's timeout, how long a store call may take before the store counts as silent."""


def bounded(call: Callable[[], T], timeout_s: float, master: str | None, who: str = "") -> T:
    """``call()`` on the rendezvous store at ``master``; StoreSilentError naming the store after ``timeout_s`` +
    :data:`MARGIN_S` without an answer. ``timeout_s``: how long the call may legitimately wait (a ``get`` or
    ``wait`` for a key another process writes); ``who``: the process, for the message ("worker 1")."""
    try:
        return within(call, timeout_s + MARGIN_S, master or "(no address)")
    except StoreSilentError as error:
        raise StoreSilentError(
            f"{who + ': ' if who else ''}{error} (its host, the process of rank 0, is stopped or gone, or the link "
            "to it is cut)",
            error.pending,
        ) from None


class PortInUseError(FleetError):
    """The rendezvous port is taken by another program."""


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            raise PortInUseError(
                f"The rendezvous address {host}:{port} is already in use by another program."
            ) from None
        raise FleetError(
            f"Cannot listen on the rendezvous address {host}:{port} ({error.strerror}). The process of rank 0 must "
            "run on the master host; check MASTER_ADDR / FLEET_MASTER."
        ) from None
    sock.listen(256)
    return sock


def connect(role: RoleInfo, timeout_s: float, namespace: str = "fleet") -> dist.Store:
    """The job's store, hosted here if this is rank 0."""
    assert role.master is not None
    host, port = env.split_endpoint(role.master)
    timeout = timedelta(seconds=timeout_s)
    if role.external_store or role.rank != 0:
        try:
            store = bounded(
                lambda: dist.TCPStore(host, port, role.world_size, False, timeout=timeout, wait_for_workers=False),
                timeout_s,
                role.master,
                f"{role.name} connecting to the job",
            )
        except StoreSilentError:
            raise
        except (RuntimeError, dist.DistStoreError) as error:
            raise PeerError(
                f"{role.name} could not reach the rendezvous store at {host}:{port} within {timeout_s:g} s: "
                f"{str(error).strip().splitlines()[0]}. Is the process of rank 0 running?"
            ) from None
    else:
        listener = _bind(host, port)
        store = dist.TCPStore(
            host,
            port,
            role.world_size,
            True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=listener.fileno(),
        )
        _listeners.append(listener)  # the store serves on this socket: keep it open for the process's life
    return dist.PrefixStore(namespace, store)


def join(
    store: dist.Store, role: RoleInfo, secret: bytes | None, timeout_s: float, same_secret: bool = False
) -> dist.Store:
    """Every process proves it holds the job's secret; the store every later value goes through.

    Challenge-response: each process publishes a fresh random nonce, then a MAC under the
    secret over all the nonces it read, then a verdict on the others' proofs. A proof is
    useless outside this join (it covers every process's new nonce, and the secret is never
    written), and every failure a process without the secret can cause ends as
    :class:`~fleet.errors.StoreTamperedError`, which names no rank. Returns a
    :class:`~fleet.runtime.signed_store.SignedStore` under this join's session key (``store`` itself
    when the job has no secret: nothing is authenticated then).

    ``same_secret``: the launcher gave every process the same secret (fleetrun, or a secret
    shared through a file), so a proof that does not verify can only be a forgery.
    """
    if not secret:
        return store
    return SignedStore(store, _Join(store, role, secret, timeout_s).run(same_secret))


class _Bounded:
    """The store calls of one join, each bounded by the join's deadline + MARGIN_S (:func:`bounded`)."""

    def __init__(self, store: dist.Store, role: RoleInfo, deadline: float):
        self._store, self._master, self._deadline = store, role.master, deadline
        self._who = f"{role.name} joining the job"

    def _call(self, call: Callable[[], T]) -> T:
        return bounded(call, max(0.0, self._deadline - time.monotonic()), self._master, self._who)

    def set(self, key: str, value: str) -> None:
        self._call(lambda: self._store.set(key, value))

    def get(self, key: str) -> bytes:
        return self._call(lambda: self._store.get(key))

    def check(self, keys: list[str]) -> bool:
        return self._call(lambda: self._store.check(keys))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call(lambda: self._store.multi_get(keys))


def fingerprint(secret: bytes) -> str:
    """A short public name of a secret, for telling two apart in error messages (it opens nothing)."""
    return hmac.new(secret, b"fleet-fingerprint", hashlib.sha256).hexdigest()[:8]


_ALARM = "join/alarm"
_NONCE_CHARS = 32


class _Join:
    def __init__(self, store: dist.Store, role: RoleInfo, secret: bytes, timeout_s: float):
        self.secret, self.timeout_s = secret, timeout_s
        self.rank, self.world = role.rank, role.world_size
        self.deadline = time.monotonic() + timeout_s
        self.store = _Bounded(store, role, self.deadline)
        self.written: dict[str, bytes] = {}  # what this process wrote: it must read back unchanged

    def run(self, same_secret: bool) -> bytes:
        self.put(f"join/nonce/{self.rank}", secrets.token_hex(_NONCE_CHARS // 2))
        nonces = [v.decode("latin-1") for v in self.collect("nonce")]
        if not all(len(n) == _NONCE_CHARS and all(c in _HEX for c in n) for n in nonces):
            raise self.tampered("a join nonce in the store is malformed")
        transcript = hashlib.sha256("\0".join(["fleet-join", str(self.world), *nonces]).encode()).digest()
        self.put(f"join/proof/{self.rank}", f"{transcript.hex()}:{self.mac('proof', self.rank, transcript.hex())}")
        foreign = 0
        for rank, raw in enumerate(self.collect("proof")):
            view, _, tag = raw.decode("latin-1").partition(":")
            if len(view) != 64 or len(tag) != 64:
                raise self.tampered("a join proof in the store is malformed")
            if not hmac.compare_digest(tag, self.mac("proof", rank, view)):
                foreign += 1
            elif view != transcript.hex():  # a real proof, but over other nonces: replayed, or nonces were changed
                raise self.tampered("a join proof was replayed or made over nonces changed in the store")
        word = "mismatch" if foreign else "ok"
        self.put(f"join/verdict/{self.rank}", f"{word}:{self.mac('verdict', self.rank, transcript.hex() + word)}")
        if foreign:
            if same_secret:
                raise self.tampered("join proofs in the store do not verify with the job's secret")
            raise self.mismatch(foreign)
        for rank, raw in enumerate(self.collect("verdict")):
            # Every proof verified, so every process holds the secret: only a forger writes another verdict.
            word, _, tag = raw.decode("latin-1").partition(":")
            if word != "ok" or not hmac.compare_digest(tag, self.mac("verdict", rank, transcript.hex() + word)):
                raise self.tampered("a process of this job read different join proofs than this one did")
        self.guard()
        return session_key(self.secret, transcript)

    def mac(self, what: str, rank: int, data: str) -> str:
        return hmac.new(self.secret, f"fleet-join-{what}\0{rank}\0{data}".encode(), hashlib.sha256).hexdigest()

    def put(self, key: str, value: str) -> None:
        self.store.set(key, value)
        self.written[key] = value.encode()

    def guard(self) -> None:
        """What this process wrote is still there, and no process raised the alarm."""
        if self.store.check([_ALARM]):
            raise StoreTamperedError("another process of this job found the join entries changed")
        for key, value in self.written.items():
            if not self.store.check([key]):
                raise self.tampered("a join entry of this process was deleted")
            if self.store.get(key) != value:
                raise self.tampered("a join entry of this process was overwritten")

    def tampered(self, what: str) -> StoreTamperedError:
        try:
            self.store.set(_ALARM, "1")  # the others stop waiting at once
        except (RuntimeError, dist.DistStoreError, StoreSilentError):
            pass
        return StoreTamperedError(what)

    def mismatch(self, foreign: int) -> PeerError:
        return PeerError(
            f"the rendezvous failed: {foreign} of the {self.world - 1} other processes' join proofs do not verify "
            f"with this process's secret (fingerprint {fingerprint(self.secret)}). Either a process of this job was "
            f"started with a different {env.FLEET_SECRET} (every process's error shows its fingerprint: the one "
            "that differs has another secret), or the rendezvous store was tampered with by a process without "
            "the secret."
        )

    def collect(self, what: str) -> list[bytes]:
        """Every process's ``join/<what>/<rank>``, once all are there; this process's own stay guarded."""
        keys = [f"join/{what}/{rank}" for rank in range(self.world)]
        pause, guard_at = 0.002, 0.0
        while True:
            now = time.monotonic()
            if now >= guard_at:
                self.guard()
                guard_at = now + 0.1
            if self.store.check(keys):
                break
            if now > self.deadline:
                missing = [rank for rank, key in enumerate(keys) if not self.store.check([key])]
                if not missing:
                    break
                raise PeerError(
                    f"process of rank {missing[0]} did not join the rendezvous within {self.timeout_s:g} s; it may "
                    "have failed to start (see its log)."
                )
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
        self.guard()
        return list(self.store.multi_get(keys))


_HEX = frozenset("0123456789abcdef")


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")
