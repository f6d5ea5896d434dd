"""A rendezvous store that stops answering during fleet.init: the process fails within its timeout, naming the store.

The store's host is a separate process (a plain torch TCPStore, as rank 0 hosts it) that the test
SIGSTOPs: the kernel still accepts and acknowledges, nothing answers, which is what a host gone or
a cut link looks like to the client (torch's client then ignores its own timeout). Checked: the
connection in ``fleet.init()`` (SIGSTOP before it starts), the join's check/get loop (SIGSTOP once
connected), and the parameter servers' endpoint exchange (a get on a store that went silent).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dist_harness import clean_env
from fleet.runtime.rendezvous import MARGIN_S

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # waits out timeouts: the slow set (.ci/run)

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 2.0
BOUND_S = TIMEOUT_S + MARGIN_S + 20  # the deadline, its margin, and an interpreter importing torch on a busy machine
CALL_BOUND_S = TIMEOUT_S + MARGIN_S + 3  # the call itself, timed inside the process (a busy machine adds a little)

TIMED = """
import sys, time
from fleet.runtime.store_calls import StoreSilentError
def timed(call):
    start = time.monotonic()
    try:
        call()
    except StoreSilentError as error:
        print(f"failed after {time.monotonic() - start:.2f} s: {error}", flush=True)
        sys.exit(1)
    print("no failure", flush=True)
"""

STORE_HOST = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=60), wait_for_workers=False)
print(store.port, flush=True)
time.sleep(300)
"""


@pytest.fixture
def store_host():
    host = subprocess.Popen([sys.executable, "-c", STORE_HOST], stdout=subprocess.PIPE, text=True, env=_env())
    try:
        port = int(host.stdout.readline())
        yield host, port
    finally:
        host.kill()
        os.kill(host.pid, signal.SIGCONT)  # a stopped process dies only once it runs
        host.communicate(timeout=30)


def _env(**extra: str) -> dict[str, str]:
    return clean_env(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)


def _worker_env(port: int, **extra: str) -> dict[str, str]:
    return _env(
        FLEET_ROLE="worker", FLEET_WORKER_INDEX="1", FLEET_WORKER_NUM="2", FLEET_MASTER=f"127.0.0.1:{port}",
        FLEET_SECRET="ab" * 16, FLEET_STRATEGY=json.dumps({"timeout_s": TIMEOUT_S}), **extra,
    )  # fmt: skip


def _run(code: str, environ: dict[str, str], started: str | None = None, host=None) -> tuple[int, str, float]:
    """Run ``code``; SIGSTOP ``host`` once the child printed ``started`` (at once when None); the child's
    exit status, output, and how long its timed call took (it calls ``timed(call)``)."""
    child = subprocess.Popen([sys.executable, "-c", TIMED + textwrap.dedent(code)], env=environ, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    lines = []
    try:
        if started is not None:
            for line in child.stdout:
                lines.append(line)
                if started in line:
                    break
        if host is not None:
            os.kill(host.pid, signal.SIGSTOP)
        out, _ = child.communicate(timeout=3 * BOUND_S)
        out = "".join(lines) + out
        took = re.search(r"failed after ([0-9.]+) s", out)
        return child.returncode, out, float(took.group(1)) if took else float("inf")
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()


@pytest.mark.timeout(120)
def test_fleet_init_against_a_stopped_store_host_fails_naming_the_store(store_host):
    host, port = store_host
    os.kill(host.pid, signal.SIGSTOP)
    rc, out, took = _run("import fleet\ntimed(fleet.init)\n", _worker_env(port))
    assert rc != 0, out
    assert f"the rendezvous store at 127.0.0.1:{port} did not answer within {TIMEOUT_S + MARGIN_S:g} s" in out, out
    assert "worker 1 connecting to the job" in out, out
    assert took < CALL_BOUND_S, out


@pytest.mark.timeout(120)
def test_a_store_silent_during_the_join_fails_it_within_the_timeout(store_host):
    """Connected, then the store's host stops while this process waits in the join for rank 0's nonce."""
    host, port = store_host
    code = f"""
        from fleet.runtime import rendezvous
        from fleet.roles import RoleInfo
        role = RoleInfo(worker_index=1, worker_num=2, rank=1, world_size=2, master="127.0.0.1:{port}", source="fleetrun")
        store = rendezvous.connect(role, {TIMEOUT_S})
        print("connected", flush=True)
        timed(lambda: rendezvous.join(store, role, b"secret", {TIMEOUT_S}, same_secret=True))
    """
    rc, out, took = _run(code, _env(), started="connected", host=host)
    assert rc != 0, out
    assert f"worker 1 joining the job: the rendezvous store at 127.0.0.1:{port} did not answer" in out, out
    assert took < CALL_BOUND_S, out


@pytest.mark.timeout(120)
def test_the_server_endpoint_exchange_on_a_silent_store_fails_naming_it(store_host):
    """A worker of a rank-only launch reads the servers' endpoints from the store; the store goes silent first."""
    host, port = store_host
    code = f"""
        from datetime import timedelta
        import torch.distributed as dist
        from fleet.ps.server.launch import worker_endpoints
        from fleet.roles import RoleInfo
        from fleet.strategy import DistributedStrategy

        class Runtime:
            role = RoleInfo(worker_index=0, worker_num=1, server_num=1, rank=1, world_size=2,
                            master="127.0.0.1:{port}", source="torchrun")
            strategy = DistributedStrategy(mode="ps", timeout_s={TIMEOUT_S})
            store = dist.TCPStore("127.0.0.1", {port}, None, False, timeout=timedelta(seconds=60))
            def rendezvous_store(self):
                return self.store

        runtime = Runtime()
        print("connected", flush=True)
        timed(lambda: worker_endpoints(runtime))
    """
    rc, out, took = _run(code, _env(), started="connected", host=host)
    assert rc != 0, out
    assert f"worker 0: the rendezvous store at 127.0.0.1:{port} did not answer" in out, out
    assert took < CALL_BOUND_S, out
