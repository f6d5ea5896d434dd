"""Heartbeats through the store: a store that stops answering never blocks a diagnosis (no torch processes)."""

from __future__ import annotations

import threading
import time

import pytest

from fleet.collective import liveness
from fleet.collective.liveness import Liveness


class SilentStore:
    """A store that answers until ``go_silent`` is set, then blocks every call that waits for a reply (as a
    TCPStore client does when its server's host stops answering)."""

    def __init__(self):
        self.values: dict[str, bytes] = {}
        self.go_silent = threading.Event()
        self.release = threading.Event()
        self.blocked = threading.Event()  # a call is stuck in the store now

    def _wait(self) -> None:
        if self.go_silent.is_set():
            self.blocked.set()
            self.release.wait()
            raise RuntimeError("connection reset")

    def compare_set(self, key, expected, desired):
        self._wait()
        current = self.values.get(key, b"")
        if current == bytes(expected):
            self.values[key] = bytes(desired)
        return self.values[key]

    def set(self, key, value):
        self.values[key] = bytes(value)

    def check(self, keys):
        self._wait()
        return all(k in self.values for k in keys)

    def get(self, key):
        self._wait()
        return self.values[key]


@pytest.mark.timeout(60)
def test_a_heartbeat_stuck_on_a_silent_store_never_blocks_the_diagnosis(monkeypatch):
    store = SilentStore()
    store.values["hb/1"] = b"1:0"
    beats = Liveness("127.0.0.1:1", "ns", rank=0, world_size=2, timeout_s=4, store=store)
    try:
        store.go_silent.set()
        assert store.blocked.wait(10), "the heartbeat thread never called the store"
        started = time.monotonic()
        text = beats.describe()  # the heartbeat thread is inside compare_set on the silent store now
        took = time.monotonic() - started
        assert "the rendezvous store at 127.0.0.1:1 did not answer within" in text, text
        assert "worker 0 (which hosts the rendezvous store) is unreachable" in text, text
        assert took < 3 * (min(4, liveness.DIAGNOSIS_CALL_S) + liveness.WATCH_S), took
        started = time.monotonic()
        assert beats.silent_peers() is None  # once gone, the store is named at once
        assert time.monotonic() - started < 1
    finally:
        beats.close()
        store.release.set()


@pytest.mark.timeout(60)
def test_a_live_store_still_names_the_silent_worker():
    store = SilentStore()
    store.values["hb/1"] = b"7:0"  # worker 1 wrote once and stopped
    beats = Liveness("127.0.0.1:1", "ns", rank=0, world_size=2, timeout_s=4, store=store)
    try:
        assert beats.describe() == "worker 1 stopped answering (heartbeat silent): it died or was stopped"
        assert beats.store_lost is None
    finally:
        beats.close()
