"""A slow link is named (issue 35): over two emulated hosts (tests/hosts.py) whose link is squeezed to 1 Mbit/s,
each node's fleetrun ends its timing report saying that communication dominated the step and that it waited on
the link to the other host, naming that host's address (a parameter-server worker: the other host's server, by
its endpoint); its report.json says the same. The rule and its figures: tests/telemetry/test_link_report.py.

Marked ``hosts`` (run by .ci/run with the slow set, docs/development.md); skipped, with the reason, where
network namespaces cannot be made.
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dist_harness import clean_env
from hosts import EmulatedHosts

pytestmark = [pytest.mark.multiprocess, pytest.mark.hosts]

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
#: Linear(256, 128): 128 KB of gradients a step, about a second each way at 1 Mbit/s; the compute is milliseconds
OUT, STEPS = 128, 5
WAIT_S = 240.0  # fleetrun and the workers start (torch imports on a loaded 2-core machine) and finish
MODES = {"collective": {"mode": "collective"}, "ps-sync": {"mode": "ps", "update": "sync"}}


def _run(hosts: EmulatedHosts, tmp: Path, mode: str) -> list[str]:
    """fleetrun on both hosts, one worker each (and one server each for PS), to the end; their outputs."""
    strategy = tmp / "strategy.json"
    strategy.write_text(json.dumps({**MODES[mode], "timeout_s": 60}))
    ps = MODES[mode]["mode"] == "ps"
    script = SCRIPTS / ("hosts_ps_train.py" if ps else "hosts_train.py")
    environ = clean_env(
        OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", NO_COLOR="1", COLUMNS="250", FLEET_SECRET=secrets.token_hex(16)
    )
    procs, outputs = [], []
    for node, host in enumerate(hosts.hosts):
        argv = [sys.executable, "-m", "fleet.launch", "--nnodes", "2", "--node-rank", str(node)]
        argv += ["--master", f"{hosts.hosts[0].address}:29437", "--host", host.address]
        argv += ["--workers", "1", "--servers", "1" if ps else "0", "--log-dir", str(tmp / f"logs{node}")]
        argv += ["--strategy", str(strategy), str(script), str(STEPS), "0", str(tmp), str(OUT)]
        outputs.append(tmp / f"fleetrun{node}.out")
        with outputs[-1].open("w") as out:
            procs.append(hosts.popen(node, argv, env=environ, cwd=tmp, stdout=out, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + WAIT_S
    for node, proc in enumerate(procs):
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"node {node} ran past {WAIT_S:g} s:\n{outputs[node].read_text()[-3000:]}") from None
    texts = [path.read_text(errors="replace") for path in outputs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(t[-3000:] for t in texts)
    return texts


@pytest.mark.timeout(420)
@pytest.mark.parametrize("mode", list(MODES))
def test_a_squeezed_link_is_named_in_each_nodes_report(hosts, tmp_path, mode):
    hosts.squeeze(1.0)
    started = time.monotonic()
    texts = _run(hosts, tmp_path, mode)
    print(f"{mode}: 1 Mbit/s squeeze: finished after {time.monotonic() - started:.1f} s")
    for node in (0, 1):
        other = hosts.hosts[1 - node].address
        line = re.search(r"communication took (\d+)% of the step time.*", texts[node])
        assert line, f"node {node} named no slow link:\n{texts[node][-3000:]}"
        print(f"node {node}: {line.group(0)}")
        peer = rf"server {re.escape(other)}:\d+" if mode == "ps-sync" else rf"host {re.escape(other)}"
        assert re.search(rf"waiting on the link to {peer}:", line.group(0)), line.group(0)
        report = json.loads((tmp_path / f"logs{node}" / "report.json").read_text())
        links = report["links"]
        assert links["dominates"] and links["link_bound"], links
        assert links["waiting_on"].split(":")[0] == other and int(line.group(1)) > 50, links
        named = links["peers"][links["waiting_on"]]
        assert named["sent_bytes_per_s"] < 1e6 / 8 * 1.5, named  # what a 1 Mbit/s link gives, give or take
        assert named["bytes_per_step"] > 100_000, named  # the step's gradients (pushes and pulls) crossed it
