"""One job over two "hosts": two network namespaces joined by a veth pair, each running fleetrun.

The namespaces and their addresses exist only inside this test (created and deleted here);
no traffic leaves them. Skipped, with the reason, where namespaces cannot be created
(not root, or no CAP_SYS_ADMIN in a container).
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess  # every test here starts processes

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)


@pytest.fixture
def two_hosts():
    tag = f"{os.getpid() % 10000}"
    a, b = f"fleet-a{tag}", f"fleet-b{tag}"
    if os.geteuid() != 0 or _ip("netns", "add", a).returncode != 0:
        pytest.skip("network namespaces cannot be created here (needs root and CAP_SYS_ADMIN)")
    try:
        steps = [
            ("netns", "add", b),
            ("link", "add", f"fva{tag}", "type", "veth", "peer", "name", f"fvb{tag}"),
            ("link", "set", f"fva{tag}", "netns", a),
            ("link", "set", f"fvb{tag}", "netns", b),
            ("-n", a, "addr", "add", "10.231.7.1/24", "dev", f"fva{tag}"),
            ("-n", b, "addr", "add", "10.231.7.2/24", "dev", f"fvb{tag}"),
            ("-n", a, "link", "set", f"fva{tag}", "up"),
            ("-n", b, "link", "set", f"fvb{tag}", "up"),
            ("-n", a, "link", "set", "lo", "up"),
            ("-n", b, "link", "set", "lo", "up"),
        ]
        for step in steps:
            done = _ip(*step)
            assert done.returncode == 0, f"ip {' '.join(step)}: {done.stderr}"
        yield (a, "10.231.7.1"), (b, "10.231.7.2")
    finally:
        _ip("netns", "del", a)
        _ip("netns", "del", b)


def _fleetrun(namespace: str, host: str, node_rank: int, master: str, extra: list[str], script: Path, tmp: Path):
    command = [
        "ip",
        "netns",
        "exec",
        namespace,
        sys.executable,
        "-m",
        "fleet.launch",
        "--nnodes",
        "2",
        "--node-rank",
        str(node_rank),
        "--master",
        master,
        "--host",
        host,
        "--log-dir",
        str(tmp / f"node{node_rank}"),
        *extra,
        str(script),
    ]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp)


def _checksums(nodes: list[subprocess.Popen]) -> list[tuple[str, str]]:
    """Wait for both nodes; every one must succeed; the workers' (index, checksum) lines."""
    outputs = []
    for node in nodes:
        out, _ = node.communicate(timeout=120)
        outputs.append(out)
        assert node.returncode == 0, out
    sums = re.findall(r"worker (\d) of 2 checksum (-?\d+\.\d+)", "".join(outputs))
    assert sorted(w for w, _ in sums) == ["0", "1"], outputs
    return sums


@pytest.mark.timeout(150)
def test_collective_job_over_two_hosts(two_hosts, tmp_path, monkeypatch):
    (ns_a, host_a), (ns_b, host_b) = two_hosts
    monkeypatch.setenv("FLEET_SECRET", secrets.token_hex(16))
    master = f"{host_a}:29433"
    nodes = [
        _fleetrun(ns_a, host_a, 0, master, ["--workers", "1"], SCRIPTS / "tiny_train.py", tmp_path),
        _fleetrun(ns_b, host_b, 1, master, ["--workers", "1"], SCRIPTS / "tiny_train.py", tmp_path),
    ]
    sums = _checksums(nodes)
    assert sums[0][1] == sums[1][1], "both hosts must end with identical parameters"


@pytest.mark.timeout(150)
def test_parameter_server_job_over_two_hosts(two_hosts, tmp_path, monkeypatch):
    (ns_a, host_a), (ns_b, host_b) = two_hosts
    monkeypatch.setenv("FLEET_SECRET", secrets.token_hex(16))
    strategy = tmp_path / "ps_sync.toml"
    strategy.write_text('mode = "ps"\nupdate = "sync"\ntimeout_s = 60\n')
    master = f"{host_a}:29434"
    extra = ["--servers", "1", "--workers", "1", "--strategy", str(strategy)]
    nodes = [
        _fleetrun(ns_a, host_a, 0, master, extra, SCRIPTS / "tiny_ps_train.py", tmp_path),
        _fleetrun(ns_b, host_b, 1, master, extra, SCRIPTS / "tiny_ps_train.py", tmp_path),
    ]
    sums = _checksums(nodes)
    assert sums[0][1] == sums[1][1], "sync workers end with the servers' identical parameters"
