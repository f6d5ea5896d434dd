"""Servers on one node, workers on another: fleetrun with different --servers/--workers per node.

Two fleetrun nodes on loopback: node 0 runs the servers only (``--servers 2 --workers 0``), node 1
the workers only (``--servers 0 --workers 2``), as a cluster puts servers on CPU machines and
workers on GPU machines. The nodes agree on the job at the rendezvous (fleet.launch.agree); a sync
job trains exactly as one process on the union of the workers' batches. Requests that make no
job fail on every node with one message. The pure part (indices, endpoints, the store's node)
is checked without starting anything.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.launch.agree import NodeRequest, agree
from fleet.launch.config import LaunchConfig, LaunchError
from fleet.launch.plan import JobLayout, child_env, local_specs
from fleet.launch.ports import PortAllocator
from fleet.runtime import env

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
ROOT = Path(__file__).resolve().parents[2]


def _request(node: int, workers: int, servers: int, **extra) -> NodeRequest:
    ports = tuple(7000 + 10 * node + j for j in range(servers))
    return NodeRequest(node, workers, servers, f"10.0.0.{node + 1}", ports, 6000 + node if workers else None,
                       extra.pop("mode", "ps"), extra.pop("digest", "d1"), "ps.toml", **extra)  # fmt: skip


def test_the_nodes_agree_on_indices_endpoints_and_the_store_at_worker_0s_node():
    requests = [_request(2, 2, 1), _request(0, 0, 2), _request(1, 3, 0)]  # any order
    agreed = agree(requests, "master.example")
    assert agreed.node_counts == ((0, 2), (3, 0), (2, 1))
    assert agreed.server_endpoints == ("10.0.0.1:7000", "10.0.0.1:7001", "10.0.0.3:7020")
    assert agreed.master == "10.0.0.2:6001"  # node 1 runs worker 0, so it hosts the store
    assert agreed.describe() == "5 workers (node 1: 3, node 2: 2), 3 servers (node 0: 2, node 2: 1)"
    layout = JobLayout(master=agreed.master, server_endpoints=agreed.server_endpoints, secret="ab")
    seen = {}
    for node in range(3):
        counts = agreed.node_counts[node]
        config = LaunchConfig(script=Path(__file__), workers=counts[0], servers=counts[1], nnodes=3, node_rank=node,
                              master=("master.example", 6170), node_counts=agreed.node_counts)  # fmt: skip
        for spec in local_specs(config):
            values = child_env(spec, config, layout, restart_count=0, log_dir="/l", base={})
            assert (values[env.FLEET_WORKER_NUM], values[env.FLEET_SERVER_NUM]) == ("5", "3")
            assert values[env.FLEET_MASTER] == "10.0.0.2:6001"
            assert values[env.FLEET_SERVER_ENDPOINTS] == ",".join(agreed.server_endpoints)
            index = values[env.FLEET_WORKER_INDEX if spec.role == "worker" else env.FLEET_SERVER_INDEX]
            seen[(spec.role, int(index))] = (node, values.get(env.RANK), values.get(env.WORLD_SIZE))
    assert seen == {
        ("server", 0): (0, None, None), ("server", 1): (0, None, None), ("server", 2): (2, None, None),
        ("worker", 0): (1, "0", "5"), ("worker", 1): (1, "1", "5"), ("worker", 2): (1, "2", "5"),
        ("worker", 3): (2, "3", "5"), ("worker", 4): (2, "4", "5"),
    }  # fmt: skip
    # node 0 runs worker 0: the store is at the --master host
    assert agree([_request(0, 1, 1), _request(1, 0, 1)], "master.example").master == "master.example:6000"


@pytest.mark.parametrize(
    "requests, expected",
    [
        ([_request(0, 0, 2), _request(1, 0, 1)], "No node runs a worker (node 0 --workers 0 --servers 2, node 1"),
        ([_request(0, 2, 0), _request(1, 2, 0)], "describes a parameter-server job, but no node runs servers"),
        ([_request(0, 0, 1, mode="collective"), _request(1, 2, 0, mode="collective")], 'says mode = "collective"'),
        ([_request(0, 0, 1), _request(1, 2, 0, mode=None, digest=None)], "node 1: no --strategy"),
        ([_request(0, 0, 1), _request(1, 2, 0, digest="other")], "different strategies"),
        ([_request(0, 2, 0, mode=None, digest=None, max_restarts=1), _request(1, 2, 0, mode=None, digest=None)],
         "--max-restarts on node 0 is supported for parameter-server jobs only"),
    ],
)  # fmt: skip
def test_requests_that_make_no_job_are_refused_naming_the_nodes(requests, expected):
    with pytest.raises(LaunchError, match=re.escape(expected)):
        agree(requests, "h")


def _start(tmp_path: Path, per_node: list[list[str]], script: Path, args: list[str]) -> list[subprocess.Popen]:
    port = PortAllocator().take()
    environ = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200", env.FLEET_SECRET: "ef" * 32, "OMP_NUM_THREADS": "1"}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), environ.get("PYTHONPATH")]))
    common = ["--nnodes", str(len(per_node)), "--master", f"127.0.0.1:{port}", "--join-timeout", "30"]
    return [
        subprocess.Popen(
            [sys.executable, "-m", "fleet.launch", *common, "--node-rank", str(node), "--log-dir",
             str(tmp_path / f"node{node}"), *options, str(script), *args],
            cwd=tmp_path, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for node, options in enumerate(per_node)
    ]  # fmt: skip


def _outputs(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    try:
        return [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


@pytest.mark.hosts  # the slow multi-node set (docs/development.md)
@pytest.mark.multiprocess
@pytest.mark.timeout(150)  # about 25 s on an idle 2-core machine; four interpreters import torch at once
@pytest.mark.parametrize("update", ["sync", "async"])
def test_servers_on_one_node_and_workers_on_another(tmp_path, update):
    import torch

    from ps_jobs import reference

    strategy = tmp_path / "ps.toml"
    strategy.write_text(f'mode = "ps"\nupdate = "{update}"\ntimeout_s = 30\n')
    out = tmp_path / "out"
    out.mkdir()
    steps = 3
    per_node = [
        ["--servers", "2", "--workers", "0", "--strategy", str(strategy)],
        ["--servers", "0", "--workers", "2", "--strategy", str(strategy)],
    ]
    procs = _start(tmp_path, per_node, SCRIPTS / "split_ps_train.py", [str(out), "sgd", str(steps)])
    outputs = _outputs(procs, timeout=130)
    for p, text in zip(procs, outputs, strict=True):
        assert p.returncode == 0, "\n".join(outputs)
        assert "the job: 2 workers (node 1: 2), 2 servers (node 0: 2)" in text, text
    assert "[server 0]" not in outputs[1] and "[worker 0]" not in outputs[0]  # each role on its own node only
    lines = sorted(re.findall(r"worker (\d) of 2 servers 2 endpoints (\S+)", outputs[1]))
    assert [w for w, _ in lines] == ["0", "1"], outputs[1]
    assert lines[0][1] == lines[1][1] and len(lines[0][1].split(",")) == 2  # one list of both servers
    results = [torch.load(out / f"worker{i}.pt", weights_only=False)["snapshot"] for i in range(2)]
    if update == "sync":  # exactly one process on the union of the batches
        want = reference("sgd", steps, 2)
        for result in results:
            for name, value in result.items():
                torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-6, msg=name)
    else:
        assert all(torch.isfinite(v.float()).all() for r in results for v in r.values())


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_job_without_workers_fails_on_every_node_with_one_message(tmp_path):
    per_node = [["--servers", "1", "--workers", "0"], ["--servers", "2", "--workers", "0"]]
    procs = _start(tmp_path, per_node, SCRIPTS / "tiny_ps_train.py", [])
    outputs = _outputs(procs, timeout=50)
    for p, text in zip(procs, outputs, strict=True):
        assert p.returncode == env.EXIT_USER_ERROR, text
        assert "No node runs a worker (node 0 --workers 0 --servers 1, node 1 --workers 0 --servers 2)" in text, text
        assert "Traceback" not in text, text
