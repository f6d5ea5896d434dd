"""The slow link named in the timing report: the kernel's per-socket counters (fleet.telemetry.links) and the rule
that names the peer a job waits on (fleet.telemetry.link_report), on made-up records and one real socket. The
same over two emulated hosts with a squeezed link: tests/launch/test_slow_link.py."""

from __future__ import annotations

import io
import json
import os
import socket
import struct
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from dist_harness import run_fleetrun as fleetrun
from fleet.runtime import env
from fleet.telemetry import link_report, links, step_report, timing

JOB = Path(__file__).parents[1] / "scripts" / "timing_job.py"


def _info(sent: int, received: int, busy_us: int | None = None, rwnd_us: int = 0) -> bytes:
    """A ``struct tcp_info`` with the fields fleet reads (``busy_us`` None: a kernel without the link times)."""
    raw = bytearray(192 if busy_us is not None else 160)
    struct.pack_into("=QQ", raw, 120, sent, received)
    if busy_us is not None:
        struct.pack_into("=QQQ", raw, 168, busy_us, rwnd_us, 0)
    return bytes(raw)


class FakeSockets:
    """What ``_own_sockets`` would read: (inode, local, peer, tcp_info) rows, changed by the test."""

    def __init__(self):
        self.rows: list[tuple[int, tuple[str, int], tuple[str, int], bytes]] = []
        self.reads = 0

    def __call__(self, ignore=()):
        self.reads += 1
        self.ignored = set(ignore)
        return [row for row in self.rows if row[0] not in ignore]


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_tcp_info_fields_and_the_receiver_stall_left_out():
    assert links.parse_tcp_info(b"\0" * 100) is None
    old = links.parse_tcp_info(_info(5, 7))
    assert old == {"sent": 5.0, "received": 7.0, "busy_s": 0.0, "timed": 0.0}
    got = links.parse_tcp_info(_info(1000, 2000, busy_us=3_000_000, rwnd_us=1_000_000))
    assert got == {"sent": 1000.0, "received": 2000.0, "busy_s": 2.0, "timed": 1.0}


def test_which_connections_leave_the_host_and_what_peer_they_count_for():
    assert not links.other_host("127.0.0.1", "127.0.0.5")
    assert not links.other_host("::1", "::1")
    assert not links.other_host("10.0.0.1", "10.0.0.1")  # a connection to this host's own address
    assert not links.other_host("::ffff:10.0.0.1", "10.0.0.1")
    assert links.other_host("10.0.0.1", "10.0.0.2")
    assert links.other_host("::ffff:10.0.0.1", "::ffff:10.0.0.2")
    servers = frozenset({"10.0.0.2:6170", "[fd00::2]:6170"})
    assert links.peer_name(("10.0.0.2", 6170), servers) == "10.0.0.2:6170"
    assert links.peer_name(("::ffff:10.0.0.2", 6170), servers) == "10.0.0.2:6170"
    assert links.peer_name(("fd00::2", 6170), servers) == "[fd00::2]:6170"
    assert links.peer_name(("10.0.0.2", 41234), servers) == "10.0.0.2"  # gloo's ephemeral port: the host


def test_counters_per_peer_from_the_baseline_on_and_kept_after_a_socket_closes():
    fake, clock = FakeSockets(), Clock()
    fake.rows = [
        (1, ("10.0.0.1", 5000), ("10.0.0.2", 41000), _info(100, 100, busy_us=10_000)),  # before the first step
        (2, ("127.0.0.1", 5001), ("127.0.0.1", 29500), _info(10**9, 10**9, busy_us=10**9)),  # this host: left out
    ]
    counters = links.LinkCounters(frozenset({"10.0.0.3:6170"}), clock=clock, read=fake)
    counters.mark()
    assert counters.peers() == {}  # nothing since the baseline
    fake.rows = [
        (1, ("10.0.0.1", 5000), ("10.0.0.2", 41000), _info(1_100, 600, busy_us=2_010_000, rwnd_us=500_000)),
        (3, ("10.0.0.1", 5002), ("10.0.0.2", 41001), _info(50, 0, busy_us=0)),
        (4, ("10.0.0.1", 5003), ("10.0.0.3", 6170), _info(400, 4000, busy_us=100_000)),
    ]
    clock.now += 2
    counters.sample()
    fake.rows = fake.rows[1:]  # socket 1 closed: its last counters stay
    clock.now += 0.5
    counters.sample()  # too soon after the last one: not read
    assert fake.reads == 2
    assert counters.peers() == {
        "10.0.0.2": {"sent_bytes": 1_050, "received_bytes": 500, "busy_s": 1.5, "connections": 2},
        "10.0.0.3:6170": {"sent_bytes": 400, "received_bytes": 4000, "busy_s": 0.1, "connections": 1},
    }
    counters.sample(force=True)
    assert fake.reads == 3 and counters.peers()["10.0.0.2"]["connections"] == 2
    assert fake.ignored == {2}  # the same-host socket was looked at once, then left alone


def test_sampling_is_spaced_to_a_thousandth_of_the_run():
    fake, clock = FakeSockets(), Clock()

    def slow(ignore=()):
        clock.now += 0.01  # a sample that takes 10 ms: the next one no sooner than 10 s later
        return fake(ignore)

    counters = links.LinkCounters(clock=clock, read=slow)
    counters.sample()
    clock.now += 5
    counters.sample()
    assert fake.reads == 1
    clock.now += 5.5
    counters.sample()
    assert fake.reads == 2 and abs(counters.spent_s - 0.02) < 1e-9


def test_a_real_socket_is_read_with_its_addresses_and_bytes():
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()

    def drain() -> None:
        while peer.recv(1 << 20):
            pass

    drained = threading.Thread(target=drain, daemon=True)
    drained.start()
    try:
        client.sendall(b"x" * 200_000)
        deadline = time.monotonic() + 10
        while True:  # until the peer acknowledged it all (bytes_acked counts the SYN too)
            rows = {inode: (local, remote, info) for inode, local, remote, info in links._own_sockets()}
            local, remote, info = rows[os.fstat(client.fileno()).st_ino]
            counted = links.parse_tcp_info(info)
            if counted["sent"] >= 200_000 or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert local == client.getsockname() and remote == server.getsockname()
        assert 200_000 <= counted["sent"] <= 200_001 and counted["received"] == 0
        client.sendall(b"y")  # the reading closed duplicates only: our socket still works
        assert links.LinkCounters(read=links._own_sockets).peers() == {}  # loopback: this host
    finally:
        client.close()
        drained.join(timeout=10)
        peer.close()
        server.close()


def test_a_one_host_worker_summary_has_no_links_entry(tmp_path):
    metrics = timing.StepMetrics(tmp_path, rank=0)
    for _ in range(3):
        metrics.add_comm(0.001)
        metrics.end_step()
    assert "links" not in metrics.summary(final=True)


def test_a_worker_summary_counts_its_links_from_the_first_step(monkeypatch):
    fake = FakeSockets()
    fake.rows = [(7, ("10.0.0.1", 5000), ("10.0.0.2", 41000), _info(1_000, 1_000, busy_us=0))]
    monkeypatch.setattr(links, "_own_sockets", fake)
    metrics = timing.StepMetrics(rank=0)
    metrics.end_step()  # the first boundary: the baseline
    fake.rows = [(7, ("10.0.0.1", 5000), ("10.0.0.2", 41000), _info(301_000, 1_000, busy_us=2_000_000))]
    metrics.end_step()
    metrics.end_step()
    assert metrics.summary(final=True)["links"] == {
        "10.0.0.2": {"sent_bytes": 300_000, "received_bytes": 0, "busy_s": 2.0, "connections": 1}
    }


def _record(rank: int, step_s: float, comm_s: float, steps: int = 10, peers: dict | None = None) -> dict:
    record = {
        "rank": rank,
        "steps": steps,
        "samples": None,
        "window": {"steps": steps, "step_p50": step_s, "compute_p50": step_s - comm_s, "comm_p50": comm_s},
        "run": {
            "step_s_total": step_s * steps,
            "compute_s_total": (step_s - comm_s) * steps,
            "comm_s_total": comm_s * steps,
            **{f"{n}_p{q}": step_s for n in ("step", "compute", "comm") for q in (50, 95)},
        },
    }
    if peers is not None:
        record["links"] = peers
    return record


def _peer(sent: int, received: int, busy_s: float | None) -> dict:
    return {"sent_bytes": sent, "received_bytes": received, "busy_s": busy_s, "connections": 1}


def test_a_dominating_wait_on_a_slow_link_names_its_host():
    # 10 steps of 1 s, 0.8 s of it comm; the link to .3 was busy 0.75 s per step sending 128 kB per step
    records = {
        0: _record(0, 1.0, 0.8, peers={"10.0.0.2": _peer(1_000, 1_000, 0.01), "10.0.0.3": _peer(1_280_000, 0, 7.5)}),
        1: _record(1, 1.0, 0.8),  # a worker talking to no other host still counts in the comm share
    }
    report = step_report.build_report(records)
    found = report["links"]
    assert found["dominates"] and found["waiting_on"] == "10.0.0.3" and found["link_bound"]
    assert abs(found["comm_share"] - 0.8) < 1e-9
    row = found["peers"]["10.0.0.3"]
    assert row["bytes_per_step"] == 128_000 and row["link_s_per_step"] == 0.75
    assert abs(row["sent_bytes_per_s"] - 1_280_000 / 7.5) < 1e-6
    assert found["message"] == (
        "communication took 80% of the step time (0.80 s of 1.00 s per step): most of it waiting on the link to "
        "host 10.0.0.3: 0.13 MB per step exchanged with it, sent at 0.17 MB/s (its connections busy sending 0.75 s per step)"
    )
    out = io.StringIO()
    Console(file=out, width=200).print(step_report.report_table(report))
    assert "waiting on the link to host 10.0.0.3" in out.getvalue()


def test_a_parameter_server_is_named_by_its_endpoint():
    records = {0: _record(0, 1.0, 0.9, peers={"10.0.0.2:6170": _peer(500_000, 500_000, 8.0)})}
    message = step_report.build_report(records)["links"]["message"]
    assert "waiting on the link to server 10.0.0.2:6170" in message


def test_a_wait_with_idle_links_blames_the_peers_not_a_link():
    records = {0: _record(0, 1.0, 0.8, peers={"10.0.0.2": _peer(10_000, 10_000, 0.5)})}  # 50 ms of 0.8 s a step
    found = step_report.build_report(records)["links"]
    assert found["waiting_on"] == "10.0.0.2" and found["link_bound"] is False
    assert "the links to other hosts were idle for most of it" in found["message"]
    assert "(0.80 s of 1.00 s per step)" in found["message"] and "busy sending 50.0 ms per step" in found["message"]
    assert "not on a link" in found["message"]


def test_without_link_times_the_peer_with_the_most_bytes_is_named():
    peers = {"10.0.0.2": _peer(10, 10, None), "10.0.0.3": _peer(900_000, 0, None)}
    found = step_report.build_report({0: _record(0, 1.0, 0.7, peers=peers)})["links"]
    assert found["waiting_on"] == "10.0.0.3" and found["link_bound"] is None
    assert "the most traffic went to host 10.0.0.3" in found["message"]


def test_no_message_when_communication_does_not_dominate():
    records = {0: _record(0, 1.0, 0.5, peers={"10.0.0.2": _peer(1_000_000, 0, 5.0)})}  # 50%: not more than half
    report = step_report.build_report(records)
    assert report["links"]["dominates"] is False and report["links"]["message"] is None
    out = io.StringIO()
    Console(file=out, width=200).print(step_report.report_table(report))
    assert "communication took" not in out.getvalue()


def test_a_one_host_report_is_as_it_was():
    report = step_report.build_report({0: _record(0, 1.0, 0.9), 1: _record(1, 1.0, 0.9)})
    assert "links" not in report
    assert link_report.link_summary({0: _record(0, 1.0, 0.9, peers={})}) is None


def test_a_pull_and_push_exchange_timed_on_its_sending_half_is_still_the_link():
    # a parameter-server worker times what it pushes, not what the server sends back: 0.45 s of a 0.9 s wait
    records = {0: _record(0, 1.0, 0.9, peers={"10.0.0.2:6170": _peer(600_000, 600_000, 4.5)})}
    found = step_report.build_report(records)["links"]
    assert found["link_bound"] and "waiting on the link to server 10.0.0.2:6170" in found["message"]
    assert link_report.LINK_BOUND * 0.9 <= 0.45


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_one_host_job_whose_wait_dominates_prints_nothing_new(tmp_path):
    """Worker 1 about 50 ms slower a step: worker 0's wait dominates its step, but every byte stayed on this host."""
    delay = {"ranks": [1], "delay": {"mu": -3.0, "sigma": 0.1}}
    r = fleetrun(
        "--workers", 2, "--log-dir", tmp_path / "logs", JOB, 30,
        cwd=tmp_path, extra_env={env.FLEET_INJECT: json.dumps(delay)},
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((tmp_path / "logs" / "report.json").read_text())
    assert report["workers"][0]["comm_s_per_step"] > report["workers"][0]["compute_s_per_step"]
    assert "links" not in report and "communication took" not in r.stdout
    metrics = json.loads((tmp_path / "logs" / "metrics" / "worker-0.json").read_text())
    assert "links" not in metrics
