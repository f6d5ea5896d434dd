"""Jobs over two emulated hosts that are hosts (tests/hosts.py), each proving its bytes crossed the link.

Each host is a network namespace of its own, joined to the other by a veth pair, with its own host
name, /dev/shm, boot id and temp directories, so fleet's same-host shortcuts (shared-memory
gradients, the parameter servers' Unix sockets) cannot apply between them and every gradient and
PS request goes over the link. Each test reads the link's byte counters before and after and
asserts they moved by at least what the job must exchange; one test shows the check catches a job
that took a shortcut (the old emulation: namespaces sharing one /dev/shm). The namespaces and their
addresses (10.231.x.y) exist only inside each test and are removed afterwards, also when it fails.
Skipped, with the reason, where namespaces cannot be created (not root, no CAP_SYS_ADMIN).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dist_harness import clean_env
from hosts import Counters, EmulatedHosts, reference_checksum, unavailable, wait_for

pytestmark = pytest.mark.multiprocess  # every test here starts processes

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
STEPS = 10
#: the dense model both scripts train: Linear(256, 512) in float32
MODEL_BYTES = (256 * 512 + 512) * 4
#: what each direction of the link must carry at least. Collective: to hold the sum of a step's gradients a
#: worker must receive the other worker's contribution to every element it did not sum itself, and send its own
#: to the others: with 2 workers that is the whole model each way per step. PS sync: the worker on host B pushes
#: its dense gradient to the server on host A and pulls the new parameters every step.
NEED = MODEL_BYTES * STEPS
BLIP_S = 3.0


_IDENTITY = """
import os, socket, sys, tempfile
if sys.argv[1] == "make":
    open("/dev/shm/fleet-host-probe", "w").close()
boot = open("/proc/sys/kernel/random/boot_id").read().strip()
print(socket.gethostname(), boot, tempfile.gettempdir(), os.environ["XDG_RUNTIME_DIR"])
print(os.path.exists("/dev/shm/fleet-host-probe"))
"""

_DIAL = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], 29450), timeout=1).close()
    print("reached")
except OSError as exc:
    print("unreachable", exc)
"""


@pytest.mark.timeout(60)
def test_emulated_hosts_share_no_host_identity_and_the_link_can_be_cut(hosts):
    """What fleet could take for "the same host" differs between the two; cut and restore act on the link."""

    def run(host: int, *args: str) -> list[str]:
        done = subprocess.run(
            hosts.command(host, [sys.executable, "-c", *args]),
            env=hosts.environment(host),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.split("\n")

    a, a_sees = run(0, _IDENTITY, "make")[:2]
    b, b_sees = run(1, _IDENTITY, "look")[:2]
    assert a_sees == "True" and b_sees == "False", "host B must not see host A's /dev/shm"
    assert not os.path.exists("/dev/shm/fleet-host-probe"), "nor this machine"
    assert all(x != y for x, y in zip(a.split(), b.split(), strict=True)), (a, b)  # name, boot id, tmp, runtime
    listener = hosts.popen(1, [sys.executable, "-c", _LISTEN, hosts.hosts[1].address])
    assert listener.stdout.readline().strip() == "up"
    target = hosts.hosts[1].address
    assert run(0, _DIAL, target)[0] == "reached"
    hosts.cut()
    assert run(0, _DIAL, target)[0].startswith("unreachable")
    hosts.restore()
    assert run(0, _DIAL, target)[0] == "reached"


_LISTEN = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 29450)); s.listen(8); print("up", flush=True)
while True:
    s.accept()[0].close()
"""


def _env(**extra: str) -> dict[str, str]:
    return clean_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)


def _finish(procs: list[subprocess.Popen], timeout: float) -> str:
    """Wait for every process (bounded); each must succeed; their output together."""
    outputs = []
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            raise AssertionError(
                f"a process ran past {timeout:g} s:\n{''.join(outputs)[-3000:]}\n{out[-3000:]}"
            ) from None
        outputs.append(out)
        assert proc.returncode == 0, f"exit {proc.returncode}:\n{out[-4000:]}"
    return "".join(outputs)


def _checksums(output: str) -> dict[int, float]:
    sums = {int(w): float(c) for w, c in re.findall(r"worker (\d) of 2 checksum (-?[\d.e+-]+)", output)}
    assert sorted(sums) == [0, 1], output[-3000:]
    return sums


def _collective(hosts: EmulatedHosts, tmp: Path, sleep_s: float = 0.0) -> list[subprocess.Popen]:
    """fleetrun on each host, one worker each, the store on host A."""
    secret = secrets.token_hex(16)
    master = f"{hosts.hosts[0].address}:29433"
    procs = []
    for node, host in enumerate(hosts.hosts):
        argv = [sys.executable, "-m", "fleet.launch", "--nnodes", "2", "--node-rank", str(node), "--master", master]
        argv += ["--host", host.address, "--workers", "1", "--log-dir", str(tmp / f"node{node}")]
        argv += [str(SCRIPTS / "hosts_train.py"), str(STEPS), str(sleep_s), str(tmp)]
        procs.append(hosts.popen(node, argv, env=_env(FLEET_SECRET=secret), cwd=tmp))
    return procs


def _parameter_server(hosts: EmulatedHosts, tmp: Path, sleep_s: float = 0.0) -> list[subprocess.Popen]:
    """A sync PS job, Paddle-style variables: the server and worker 0 on host A, worker 1 on host B."""
    a = hosts.hosts[0].address
    common = {
        "PADDLE_PSERVERS_IP_PORT_LIST": f"{a}:29440",
        "PADDLE_TRAINERS_NUM": "2",
        "FLEET_SECRET": secrets.token_hex(16),
        "FLEET_STRATEGY": json.dumps({"mode": "ps", "update": "sync", "timeout_s": 60}),
    }
    argv = [sys.executable, str(SCRIPTS / "hosts_ps_train.py"), str(STEPS), str(sleep_s), str(tmp)]
    server = _env(**common, TRAINING_ROLE="PSERVER", POD_IP=a, PADDLE_PORT="29440")
    return [
        hosts.popen(0, argv, env=server, cwd=tmp),
        hosts.popen(0, argv, env=_env(**common, TRAINING_ROLE="TRAINER", PADDLE_TRAINER_ID="0"), cwd=tmp),
        hosts.popen(1, argv, env=_env(**common, TRAINING_ROLE="TRAINER", PADDLE_TRAINER_ID="1"), cwd=tmp),
    ]


def _run(hosts: EmulatedHosts, tmp: Path, job, timeout: float = 120.0) -> tuple[dict[int, float], Counters]:
    before = hosts.counters()
    sums = _checksums(_finish(job(hosts, tmp), timeout))
    moved = hosts.counters() - before
    print(f"{job.__name__.strip('_')} ({'private' if hosts.private else 'shared'} hosts): the link carried {moved}")
    return sums, moved


def _crossed(moved: Counters) -> bool:
    return moved.rx >= NEED and moved.tx >= NEED


@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory):
    """Each job once without a blip, over its own pair of hosts: checksums and the link's counters (cached)."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    runs: dict[str, tuple[dict[int, float], Counters]] = {}

    def run(name: str):
        if name not in runs:
            with EmulatedHosts() as emulated:
                job = _collective if name == "collective" else _parameter_server
                runs[name] = _run(emulated, tmp_path_factory.mktemp(name), job)
        return runs[name]

    return run


@pytest.mark.hosts  # the slow multi-node set (docs/development.md)
@pytest.mark.timeout(180)
def test_collective_job_crosses_the_link(plain_runs):
    sums, moved = plain_runs("collective")
    assert _crossed(moved), f"the link carried {moved}, less than the {NEED} bytes each way the gradients need"
    assert sums[0] == sums[1], "both hosts must end with identical parameters"
    assert sums[0] == pytest.approx(reference_checksum(512, STEPS), rel=1e-6, abs=1e-6)


@pytest.mark.hosts  # the slow multi-node set (docs/development.md)
@pytest.mark.timeout(180)
def test_parameter_server_job_crosses_the_link(plain_runs):
    sums, moved = plain_runs("ps")
    assert _crossed(moved), f"the link carried {moved}, less than the {NEED} bytes each way the PS requests need"
    assert sums[0] == sums[1], "sync workers end with the server's identical parameters"


@pytest.mark.hosts  # the slow multi-node set (docs/development.md)
@pytest.mark.timeout(180)
def test_a_job_over_a_shortcut_is_caught(tmp_path, plain_runs):
    """The old emulation (network namespaces only: one /dev/shm, host name and boot id for both) lets the
    gradients go through shared memory; the counters show it and the check above would fail such a run."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    with EmulatedHosts(private=False) as shared:
        sums, moved = _run(shared, tmp_path, _collective)
    assert sums == plain_runs("collective")[0], "the shortcut computes the same result"
    assert not _crossed(moved), f"a same-host shortcut was expected between namespaces sharing /dev/shm: {moved}"


def _blip_during(hosts: EmulatedHosts, tmp: Path, job) -> dict[int, float]:
    """Start ``job``, take the link down for BLIP_S once both workers stepped, and wait for the results."""
    procs = job(hosts, tmp, sleep_s=0.4)
    for worker in (0, 1):
        wait_for(tmp / f"worker-{worker}-step-1", 60, procs)
    hosts.blip(BLIP_S).join()
    assert not (tmp / f"worker-1-step-{STEPS - 1}").exists(), "the job finished before the link came back"
    return _checksums(_finish(procs, 120))


@pytest.mark.hosts  # the slow multi-node set (docs/development.md)
@pytest.mark.timeout(240)
def test_collective_job_survives_a_3s_link_blip(hosts, tmp_path, plain_runs):
    assert _blip_during(hosts, tmp_path, _collective) == plain_runs("collective")[0]


@pytest.mark.hosts  # the slow multi-node set (docs/development.md)
@pytest.mark.timeout(240)
def test_parameter_server_job_survives_a_3s_link_blip(hosts, tmp_path, plain_runs):
    assert _blip_during(hosts, tmp_path, _parameter_server) == plain_runs("ps")[0]
