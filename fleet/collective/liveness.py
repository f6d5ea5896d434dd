"""Which peer died: heartbeats through the rendezvous store.

A collective that fails only says a connection broke or a wait timed out. Every
worker writes a counter into its key of the store once a second from a daemon thread;
when a collective fails, the survivor samples the counters for a few seconds and names
the workers whose counter stood still (dead, or stopped: a SIGSTOPped process's thread
stops too). If the store itself is gone, its host (worker 0) is the one that died.

The store is open to anyone who reaches its port, so a heartbeat is never trusted
blindly: in a job with a secret each value carries a MAC (the store is a
:class:`~fleet.runtime.signed_store.SignedStore`), and a writer notices when its key holds
something it did not write (``compare_set``) and says so, under its MAC, in its next
beats. A value that is malformed, forged, deleted, goes backwards or carries that mark
means the store was tampered with: the diagnosis then says so and names nobody, and the
heartbeat thread itself never reads a value, so nothing written there can stop it.

A worker that ends on an exception of its own says it first (:mod:`fleet.runtime.last_words`): one
line under its key ``words/<rank>``, signed like its beats, which a diagnosis naming it as silent reads
back ("worker 1 exited after an error: RuntimeError: ..."): the cause, not only that it went silent.

Every store call here has a deadline (:mod:`fleet.runtime.store_calls`): a store whose host
went silent (cut link, host gone, SIGSTOP) would otherwise block the call for as long as TCP
retries, and no lock is held across a call, so a heartbeat stuck on the store never delays a
diagnosis. The heartbeat's call gets ``min(timeout_s, 10)`` s; after that the store counts as
gone, the heartbeat stops, and every diagnosis names the store at once. A diagnosis's own
calls get ``min(timeout_s, 5)`` s each, so it ends within about that plus :data:`WATCH_S`.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

from fleet.runtime import env, last_words, store_calls
from fleet.runtime.signed_store import SignedStore, StoreTamperedError  # the error SignedStore raises
from fleet.runtime.store_calls import StoreSilentError, within

HEARTBEAT_S = 1.0
WATCH_S = 2.5 * HEARTBEAT_S  # how long a diagnosis samples the counters
SAMPLE_S = 0.25
BEAT_CALL_S = 10.0  # the most a heartbeat waits for the store (and at most the strategy's timeout_s)
DIAGNOSIS_CALL_S = 5.0  # the most a diagnosis waits for one answer of the store
WORDS_CALL_S = 2.0  # the most a process on its way out waits for the store to take its last words


class Liveness:
    def __init__(
        self,
        master: str,
        namespace: str,
        rank: int,
        world_size: int,
        timeout_s: float,
        key: bytes | None = None,
        store: dist.Store | None = None,
    ):
        """``store``: the store to beat into (tests); by default a connection of its own to ``master``."""
        self._where = master
        self._beat_s = min(timeout_s, BEAT_CALL_S)
        self._diagnosis_s = min(timeout_s, DIAGNOSIS_CALL_S)
        if store is None:
            host, port = env.split_endpoint(master)
            client = within(
                lambda: dist.TCPStore(
                    host, port, world_size, False, timeout=timedelta(seconds=self._beat_s), wait_for_workers=False
                ),
                2 * self._beat_s,
                master,
            )
            store = dist.PrefixStore(namespace, client)
        self._store = SignedStore(store, key) if key else store
        self.rank = rank
        self.world_size = world_size
        self._count = 0
        self._written = b""  # the last value this process wrote to its key
        self._overwritten = False  # someone else wrote this process's key: every later beat says so
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards the fields below; never held across a store call
        self._answered_at = time.monotonic()  # the store's last answer to a heartbeat
        self._store_lost: str | None = None  # why the store counts as gone, once it does
        self._beat()
        self._thread = threading.Thread(target=self._run, name="fleet-heartbeat", daemon=True)
        self._thread.start()
        last_words.listen(self.say)
        store_calls.stop_at_exit(self.close)  # a script that never stops the job: before the interpreter finalises

    @staticmethod
    def _key(rank: int) -> str:
        return f"hb/{rank}"

    @staticmethod
    def _words_key(rank: int) -> str:
        return f"words/{rank}"

    def say(self, words: str) -> None:
        """This process's last words (:mod:`fleet.runtime.last_words`), for a diagnosis that finds it silent."""
        if self.store_lost is None:
            value = last_words.clip(words).encode()
            within(lambda: self._store.set(self._words_key(self.rank), value), WORDS_CALL_S, self._where)

    def _last_words(self, rank: int) -> str | None:
        """Worker ``rank``'s last words, if it said any: text only (never unpickled), bounded, one line."""
        try:
            stored = within(lambda: self._read(self._words_key(rank)), self._diagnosis_s, self._where)
        except Exception:  # noqa: BLE001 - a forged value or a store that stopped answering: nothing said
            return None
        return last_words.clip(stored[: last_words.MAX_BYTES].decode(errors="replace")) if stored else None

    def _beat(self) -> None:
        key = self._key(self.rank)
        self._count += 1
        value = f"{self._count}:{int(self._overwritten)}".encode()
        expected = self._written
        try:
            now: bytes | None = bytes(
                within(lambda: self._store.compare_set(key, expected, value), self._beat_s, self._where)
            )
        except StoreTamperedError:  # the key holds a forged value
            now = None
        if now != value:  # the key held something else: an outsider wrote it
            with self._lock:
                self._overwritten = True
            value = f"{self._count}:1".encode()
            within(lambda: self._store.set(key, value), self._beat_s, self._where)
        self._written = value
        with self._lock:
            self._answered_at = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._beat()
            except StoreSilentError:
                self._lose_store(None)
                return
            except Exception as error:  # noqa: BLE001 - the store host is gone; collectives will report it
                self._lose_store(error)
                return

    def _lose_store(self, error: Exception | None) -> None:
        """The store counts as gone from now on: silent (``error`` None) or failing with ``error``."""
        with self._lock:
            if self._store_lost is not None:
                return
            if error is None:
                silent_s = time.monotonic() - self._answered_at
                self._store_lost = f"the rendezvous store at {self._where} did not answer within {silent_s:.0f} s"
            else:
                cause = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                self._store_lost = f"the rendezvous store at {self._where} failed ({cause})"

    def _read(self, key: str) -> bytes | None:
        if not self._store.check([key]):
            return None
        return bytes(self._store.get(key))

    def _sample(self, rank: int) -> tuple[int, bool] | None:
        """(counter, marked) of ``rank``'s heartbeat; None when it is missing, forged or malformed."""
        key = self._key(rank)
        try:
            stored = within(lambda: self._read(key), self._diagnosis_s, self._where)
            if stored is None:
                return None
            raw = stored.decode("ascii")
        except (StoreTamperedError, UnicodeDecodeError):
            return None
        count, _, mark = raw.partition(":")
        if not count.isdigit() or mark not in ("0", "1"):
            return None
        return int(count), mark == "1"

    @property
    def store_lost(self) -> str | None:
        """Why the store counts as gone ("the rendezvous store at HOST:PORT did not answer within 12 s"), or None."""
        with self._lock:
            return self._store_lost

    def watch(self) -> tuple[list[int], bool] | None:
        """(ranks whose heartbeat stood still, whether the store was tampered with); None: the store is gone."""
        others = [r for r in range(self.world_size) if r != self.rank]
        seen: dict[int, list[tuple[int, bool] | None]] = {r: [] for r in others}
        end = time.monotonic() + WATCH_S
        try:
            while self.store_lost is None:
                for rank in others:
                    seen[rank].append(self._sample(rank))
                if time.monotonic() >= end:
                    break
                time.sleep(SAMPLE_S)
        except StoreSilentError:
            self._lose_store(None)
        except Exception as error:  # noqa: BLE001 - any store failure means its host is gone
            self._lose_store(error)
        if self.store_lost is not None:
            return None
        with self._lock:
            tampered = self._overwritten
        silent = []
        for rank, samples in seen.items():
            if any(s is None or s[1] for s in samples):
                tampered = True
                continue
            counts = [s[0] for s in samples if s is not None]
            if any(b < a for a, b in zip(counts, counts[1:], strict=False)):
                tampered = True  # a counter went back: an old value was written again
            elif counts[-1] == counts[0]:
                silent.append(rank)
        return silent, tampered

    def silent_peers(self) -> list[int] | None:
        """Ranks whose heartbeat stopped; None when the store (hosted by worker 0) is unreachable."""
        watched = self.watch()
        return None if watched is None else watched[0]

    def describe(self) -> str:
        watched = self.watch()
        if watched is None:
            return (
                f"worker 0 (which hosts the rendezvous store) is unreachable: {self.store_lost}; it died, was "
                "stopped, or its host or the link to it went away"
            )
        silent, tampered = watched
        if tampered:
            return str(StoreTamperedError("heartbeats in it were overwritten, so they cannot tell which worker failed"))
        if not silent:
            return (
                "every worker's heartbeat is still alive: a worker is late (rank-0-only evaluation or saving? raise "
                "timeout_s: strategy field, or FLEET_TIMEOUT_S), stuck, or issuing different collectives"
            )
        said = {r: words for r in silent if (words := self._last_words(r))}
        names = ", ".join(f"worker {r}" for r in silent if r not in said)
        told = [f"worker {r} exited after an error: {words.rstrip('.')}" for r, words in said.items()]
        if names:
            told.append(f"{names} stopped answering (heartbeat silent): it died or was stopped")
        return "; ".join(told)

    def close(self) -> None:
        """Stop the heartbeats and wait, at most :data:`~fleet.runtime.store_calls.EXIT_WAIT_S`, for a beat in
        flight: its store call must not be in torch's code when the interpreter finalises (it aborts the process,
        :mod:`fleet.runtime.store_calls`). A store already lost is not waited for: its call is abandoned."""
        self._stop.set()
        if self._thread is not threading.current_thread() and self.store_lost is None:
            self._thread.join(min(self._beat_s, store_calls.EXIT_WAIT_S))
