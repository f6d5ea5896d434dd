"""Sparse tables sharded across two emulated hosts (each its own network namespace, UTS name, /dev/shm and temp
dir: tests/hosts.py): the ids, rows or pooled vectors and their gradients cross the link through the process group
(no shared memory between hosts), and the job ends with one process's rows and head."""

from __future__ import annotations

import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from test_multinode import SCRIPTS, _checksums, _env, _finish

from hosts import EmulatedHosts, unavailable

pytestmark = pytest.mark.multiprocess

STEPS = 10
#: what each direction must carry at least: a worker's pooled vectors of the table its peer holds (64 x 128
#: float32 a step; row-wise, the rows of its ids the peer owns, more) and their gradients back
NEED = STEPS * 64 * 128 * 4


def _job(hosts: EmulatedHosts, tmp: Path, placement: str) -> list[subprocess.Popen]:
    """fleetrun on each host, one worker each, the store on host A, the tables placed as ``placement``."""
    strategy = tmp / "strategy.toml"
    strategy.write_text(f'mode = "collective"\ntable_placement = "{placement}"\n')
    secret, master = secrets.token_hex(16), f"{hosts.hosts[0].address}:29437"
    procs = []
    for node, host in enumerate(hosts.hosts):
        argv = [sys.executable, "-m", "fleet.launch", "--nnodes", "2", "--node-rank", str(node), "--master", master]
        argv += ["--host", host.address, "--workers", "1", "--log-dir", str(tmp / f"node{node}")]
        argv += ["--strategy", str(strategy), str(SCRIPTS / "hosts_tables_train.py"), str(STEPS)]
        procs.append(hosts.popen(node, argv, env=_env(FLEET_SECRET=secret), cwd=tmp))
    return procs


def _reference(tmp: Path) -> float:
    """The same script in one process on both workers' batches."""
    argv = [sys.executable, str(SCRIPTS / "hosts_tables_train.py"), str(STEPS), "reference"]
    out = subprocess.run(argv, env=_env(), cwd=tmp, capture_output=True, text=True, timeout=120, check=True).stdout
    found = re.search(r"worker 0 of 2 checksum (-?[\d.e+-]+)", out)
    assert found, out[-3000:]
    return float(found.group(1))


@pytest.mark.hosts  # the slow multi-node set (docs/development.md)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("placement", ["sharded", "table_wise"])
def test_sharded_tables_cross_the_link_and_equal_one_process(tmp_path, placement: str) -> None:
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    with EmulatedHosts() as hosts:
        before = hosts.counters()
        sums = _checksums(_finish(_job(hosts, tmp_path, placement), 180))
        moved = hosts.counters() - before
    print(f"{placement}: the link carried {moved}")
    assert moved.rx >= NEED and moved.tx >= NEED, f"the link carried {moved}, less than {NEED} bytes each way"
    assert sums[0] == sums[1], "both hosts must gather the same rows and end with the same head"
    assert sums[0] == pytest.approx(_reference(tmp_path), rel=1e-6, abs=1e-6)
