"""The rendezvous against a process without the secret that reads and writes the store.

Ranks are threads with their own store connection here (the join is the same code a
process runs); one test runs a real job of two worker processes next to a tamperer.
Whatever the tamperer does, a rank either joins or fails saying the store was tampered
with, and no message names a rank as the culprit.
"""

from __future__ import annotations

import re
import secrets
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from dist_harness import run_processes
from fleet.collective.liveness import Liveness
from fleet.errors import StoreTamperedError
from fleet.roles import RoleInfo
from fleet.runtime import rendezvous
from fleet.runtime.signed_store import SignedStore

TAMPERED = "tampered with by a process without the job's secret"
BLAME = re.compile(r"rank \d|worker \d|wrong secret")


class Store:
    """One store host and a few client connections, reused: each join meets under its own prefix.

    (A process that opens many TCPStore connections to one host waits 5 s on every 25th: tests
    keep to a handful.)
    """

    def __init__(self) -> None:
        self.host = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)
        self.port = self.host.port
        self.clients = [self.connect() for _ in range(3)]
        self.outsider = self.connect()
        self.tamperer = self.connect()

    def connect(self) -> dist.Store:
        return dist.TCPStore("127.0.0.1", self.port, None, False, timeout=timedelta(seconds=5), wait_for_workers=False)


@pytest.fixture(scope="module")
def store() -> Store:
    return Store()


def join_all(
    store: Store, secret: bytes, world: int = 3, timeout_s: float = 3.0, same_secret: bool = True, namespace: str = ""
) -> list:
    """Every rank's outcome: ("ok", its store) or (exception type name, message)."""
    namespace = namespace or f"job-{secrets.token_hex(4)}"
    out: list = [None] * world

    def rank_main(rank: int) -> None:
        role = RoleInfo(worker_index=rank, worker_num=world, rank=rank, world_size=world, master="127.0.0.1:1")
        try:
            ours = dist.PrefixStore(namespace, store.clients[rank])
            out[rank] = ("ok", rendezvous.join(ours, role, secret, timeout_s, same_secret))
        except Exception as error:  # noqa: BLE001 - the outcome is the test's subject
            out[rank] = (type(error).__name__, str(error))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return out


def tamperer(store: Store, write, stop: threading.Event) -> threading.Thread:
    """A plain store client that keeps rewriting every join key it lists with ``write(key, value)``."""
    outsider = store.tamperer

    def loop() -> None:
        while not stop.is_set():
            for key in outsider.list_keys():
                if "/join/" in key and not key.endswith("/alarm") and not stop.is_set():
                    try:
                        value = write(key, bytes(outsider.get(key)))
                        if value is not None:
                            outsider.set(key, value)
                    except Exception:  # noqa: BLE001 - keys vanish and appear; keep going
                        pass

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def assert_never_blamed(outcomes: list) -> int:
    """Each rank joined or said the store was tampered with, naming nobody; returns how many failed."""
    failed = 0
    for status, detail in outcomes:
        if status == "ok":
            continue
        failed += 1
        assert TAMPERED in detail, detail
        assert not BLAME.search(detail), detail
    return failed


def test_the_join_succeeds_and_values_carry_a_mac(store) -> None:
    secret = secrets.token_bytes(32)
    outcomes = join_all(store, secret)
    assert [s for s, _ in outcomes] == ["ok"] * 3, outcomes
    stores = [store for _, store in outcomes]
    stores[0].set("ps/endpoint/0", "127.0.0.1:6170")
    assert [bytes(s.get("ps/endpoint/0")) for s in stores] == [b"127.0.0.1:6170"] * 3
    # what the store holds is the value and its MAC; written without the key, it is refused
    raw = stores[1].inner
    assert bytes(raw.get("ps/endpoint/0")).startswith(b"127.0.0.1:6170")
    raw.set("ps/endpoint/0", "10.0.0.66:6170")
    with pytest.raises(StoreTamperedError, match=TAMPERED):
        stores[2].get("ps/endpoint/0")
    raw.set("ps/endpoint/1", raw.get("ps/endpoint/0"))  # a real value moved to another key
    with pytest.raises(StoreTamperedError):
        stores[2].get("ps/endpoint/1")


@pytest.mark.parametrize(
    "attack",
    [
        pytest.param(lambda key, value: b"garbage", id="garbage"),
        pytest.param(lambda key, value: value[:-1] + b"0" if value[-1:] != b"0" else None, id="one-character"),
        pytest.param(lambda key, value: secrets.token_hex(len(value) // 2).encode(), id="well-formed"),
    ],
)
def test_an_outsider_rewriting_join_keys_never_gets_a_rank_blamed(store, attack) -> None:
    stop = threading.Event()
    thread = tamperer(store, attack, stop)
    # The tamperer races the joins; on a loaded machine it can lose a few in a row, so join again
    # (bounded) until it got into one: every join, failed or not, must blame nobody.
    failed, joins = 0, 0
    try:
        while failed == 0 and joins < 20:
            failed += assert_never_blamed(join_all(store, secrets.token_bytes(32)))
            joins += 1
    finally:
        stop.set()
        thread.join(timeout=10)
    assert not thread.is_alive()
    assert failed > 0, f"the tamperer never got into any of {joins} joins: the test proves nothing"


def test_a_mismatch_without_a_common_launcher_names_no_rank(store) -> None:
    """Started by hand, a wrong FLEET_SECRET and a forger look alike: both are said, with fingerprints."""
    secret, stranger = secrets.token_bytes(32), secrets.token_bytes(32)
    roles = [RoleInfo(worker_index=r, worker_num=2, rank=r, world_size=2, master="127.0.0.1:1") for r in range(2)]
    out: list = []

    def rank_one() -> None:
        try:
            rendezvous.join(dist.PrefixStore("mismatch", store.clients[1]), roles[1], stranger, 3.0)
        except Exception as error:  # noqa: BLE001 - the message is the test's subject
            out.append(str(error))

    thread = threading.Thread(target=rank_one)
    thread.start()
    with pytest.raises(Exception) as caught:
        rendezvous.join(dist.PrefixStore("mismatch", store.clients[0]), roles[0], secret, 3.0)
    thread.join()
    for message in [str(caught.value), *out]:
        assert "tampered with by a process without the secret" in message and "different FLEET_SECRET" in message
        assert not BLAME.search(message), message
    assert rendezvous.fingerprint(secret) in str(caught.value) and rendezvous.fingerprint(stranger) in out[0]


def test_a_replayed_proof_from_an_earlier_join_is_refused(store) -> None:
    """An outsider that saw a join plays rank 1 in the next one with its fresh nonce and the old proof."""
    secret = secrets.token_bytes(32)
    first = join_all(store, secret, world=2, namespace="seen")
    assert [s for s, _ in first] == ["ok"] * 2
    seen = dist.PrefixStore("seen", store.outsider)
    recorded = {key: bytes(seen.get(f"join/{key}")) for key in ("proof/1", "verdict/1")}
    namespace = f"replay-{secrets.token_hex(4)}"
    impostor = dist.PrefixStore(namespace, store.outsider)
    impostor.set("join/nonce/1", secrets.token_hex(16))
    impostor.set("join/proof/1", recorded["proof/1"])
    impostor.set("join/verdict/1", recorded["verdict/1"])
    role = RoleInfo(worker_index=0, worker_num=2, rank=0, world_size=2, master="127.0.0.1:1")
    with pytest.raises(StoreTamperedError) as caught:
        rendezvous.join(dist.PrefixStore(namespace, store.clients[0]), role, secret, 3.0, same_secret=False)
    assert "replayed" in str(caught.value) and not BLAME.search(str(caught.value))


def test_garbage_in_a_heartbeat_neither_stops_the_thread_nor_blames_its_worker(store, monkeypatch) -> None:
    from fleet.collective import liveness

    monkeypatch.setattr(liveness, "HEARTBEAT_S", 0.1)  # the same logic, at a tenth of the pace
    monkeypatch.setattr(liveness, "WATCH_S", 0.3)
    monkeypatch.setattr(liveness, "SAMPLE_S", 0.03)
    secret = secrets.token_bytes(32)
    outcomes = join_all(store, secret, world=2)
    key = outcomes[0][1].key
    namespace = f"hb-{secrets.token_hex(4)}"
    master = f"127.0.0.1:{store.port}"
    beats = [Liveness(master, namespace, rank, 2, 10.0, key=key) for rank in range(2)]
    outsider = dist.PrefixStore(namespace, store.outsider)
    try:
        assert beats[0].watch() == ([], False)  # both alive, nothing tampered with
        outsider.set("hb/1", "not a number")
        time.sleep(0.3)
        assert beats[1]._thread.is_alive()
        # worker 1 noticed its key was overwritten: its beats go on, marked, and the diagnosis blames nobody
        value = SignedStore(outsider, key).get("hb/1").decode()
        assert value.endswith(":1") and int(value.split(":")[0]) > 1, value
        message = beats[0].describe()
        assert TAMPERED in message and not BLAME.search(message), message
        outsider.set("hb/1", "x")
        assert beats[1]._thread.is_alive()
    finally:
        for beat in beats:
            beat.close()


def _tiny_join(rank: int) -> str:
    import torch

    import fleet

    fleet.init()
    fleet.barrier_worker()
    values = torch.ones(2)
    torch.distributed.all_reduce(values)
    fleet.stop_worker()
    return "trained"


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize("target", ["/join/", "/pg/"])
def test_a_job_next_to_a_tamperer_completes_or_says_the_store_was_tampered_with(target: str) -> None:
    """Two worker processes meet at a store hosted here (as torchrun's agent hosts it); another client of
    it overwrites every key of the job it sees under ``target`` (the join; the process group's
    rendezvous, after the join) as fast as it can."""
    host = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    outsider = dist.TCPStore("127.0.0.1", host.port, None, False, timeout=timedelta(seconds=5))
    stop, hits = threading.Event(), []

    def tamper() -> None:
        while not stop.is_set():
            for key in outsider.list_keys():
                if key.startswith("fleet/") and target in key:
                    try:
                        outsider.set(key, b"\x00" + bytes(outsider.get(key))[1:])
                        hits.append(key)
                    except Exception:  # noqa: BLE001 - keep going whatever the store says
                        pass

    thread = threading.Thread(target=tamper, daemon=True)
    thread.start()
    common = {
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(host.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "FLEET_SECRET": secrets.token_hex(16),
        "FLEET_STRATEGY": '{"timeout_s": 5}',
    }
    try:
        envs = [{**common, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(2)]
        outcome = run_processes(_tiny_join, envs, timeout=40)
    finally:
        stop.set()
        thread.join(timeout=5)
    assert hits, "the tamperer never got in: the test proves nothing"
    errors = [str(value).splitlines()[0] for status, value in outcome if status == "error"]
    if any(status != "ok" for status, _ in outcome):
        assert any("tampered with by a process without the" in e for e in errors), outcome
    for error in errors:
        assert not BLAME.search(error), error
