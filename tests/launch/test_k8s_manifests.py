"""The Kubernetes manifests under examples/k8s/: the roles fleet derives from each pod's environment.

Each pod's environment is computed as Kubernetes and the operator set it: the container's
``env`` (a Secret's value, the job-completion-index annotation of an indexed Job) plus, for a
Kubeflow ``PyTorchJob``, the operator's MASTER_ADDR (``<job>-master-0``), MASTER_PORT (the port
named ``pytorchjob-port``), WORLD_SIZE (pods in all) and RANK (master 0, workers 1..). fleet
then detects the role from that environment alone, as ``fleet.init`` does, and checks the strategy
against the launch.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import replace
from pathlib import Path

import pytest

from fleet import registry
from fleet.roles import Role, detect
from fleet.runtime import job_secret
from fleet.runtime.env import EnvReader
from fleet.strategy import DistributedStrategy

yaml = pytest.importorskip("yaml")  # PyYAML comes with mkdocs, a test dependency

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "examples" / "k8s"
SECRET = secrets.token_hex(32)
OPERATOR_DEFAULT_PORT = 23456  # the training operator's default when no port is named pytorchjob-port


def _container_env(container: dict, index: int) -> dict[str, str]:
    """The container's ``env`` as the kubelet resolves it for pod ``index`` of an indexed Job."""
    environ = {}
    for item in container.get("env", []):
        if "value" in item:
            environ[item["name"]] = str(item["value"])
            continue
        source = item["valueFrom"]
        if "secretKeyRef" in source:
            assert source["secretKeyRef"]["name"] == "fleet-secret", item
            environ[item["name"]] = SECRET
        elif "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            assert path == "metadata.annotations['batch.kubernetes.io/job-completion-index']", path
            environ[item["name"]] = str(index)
        else:
            raise AssertionError(f"an env source this test does not model: {item}")
    return environ


def _pytorchjob_pods(job: dict) -> list[dict[str, str]]:
    name = job["metadata"]["name"]
    specs = job["spec"]["pytorchReplicaSpecs"]
    master, workers = specs["Master"], specs.get("Worker", {"replicas": 0})
    assert master["replicas"] == 1
    ports = [p for c in master["template"]["spec"]["containers"] for p in c.get("ports", [])]
    port = next((p["containerPort"] for p in ports if p.get("name") == "pytorchjob-port"), OPERATOR_DEFAULT_PORT)
    world = 1 + workers["replicas"]
    pods = []
    for rank, spec in [(0, master)] + [(1 + i, workers) for i in range(workers["replicas"])]:
        (container,) = [c for c in spec["template"]["spec"]["containers"] if c["name"] == "pytorch"]
        operator = {"MASTER_ADDR": f"{name}-master-0", "MASTER_PORT": str(port), "WORLD_SIZE": str(world)}
        pods.append({**_container_env(container, rank), **operator, "RANK": str(rank), "_command": container})
    return pods


def _indexed_job_pods(job: dict) -> list[dict[str, str]]:
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["parallelism"] == spec["completions"]
    (container,) = spec["template"]["spec"]["containers"]
    return [
        {**_container_env(container, i), "JOB_COMPLETION_INDEX": str(i), "_command": container}
        for i in range(spec["completions"])
    ]


def _roles(pods: list[dict]) -> tuple[DistributedStrategy, list]:
    """What fleet.init finds in each pod: the strategy, then the role; the strategy checked against the launch."""
    roles, strategies = [], set()
    for pod in pods:
        container = pod.pop("_command")
        script = next(arg for arg in container["command"] if arg.endswith(".py"))
        assert (ROOT / script).is_file(), f"{script} named by a manifest is not in the repository"
        reader = EnvReader(pod)
        assert job_secret.from_environment(reader) == bytes.fromhex(SECRET)
        strategy = DistributedStrategy.from_env(reader) or DistributedStrategy()
        servers = strategy.servers if registry.get(strategy.mode).uses_servers else 0
        role = detect(reader, servers=servers)
        registry.get(strategy.mode).check_launch(strategy, role)
        roles.append(role)
        strategies.add(strategy.to_json())
    assert len(strategies) == 1, "every pod must run the same strategy"
    return DistributedStrategy.model_validate_json(strategies.pop()), roles


def _load(name: str) -> list[dict]:
    return list(yaml.safe_load_all((MANIFESTS / name).read_text()))


@pytest.mark.parametrize(
    "name, mode", [("collective-pytorchjob.yaml", "collective"), ("sharding-pytorchjob.yaml", "sharding")]
)
def test_pytorchjob_pods_become_the_workers_of_one_job(name: str, mode: str):
    (job,) = _load(name)
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    strategy, roles = _roles(_pytorchjob_pods(job))
    assert strategy.mode == mode
    assert [r.role for r in roles] == [Role.WORKER] * 4
    assert [r.worker_index for r in roles] == [0, 1, 2, 3]
    assert {(r.worker_num, r.server_num, r.source) for r in roles} == {(4, 0, "torchrun")}
    assert {r.master for r in roles} == {f"{job['metadata']['name']}-master-0:23456"}


def test_indexed_job_pods_become_one_server_and_three_workers():
    service, job = _load("ps-indexed-job.yaml")
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    assert job["kind"] == "Job" and job["spec"]["template"]["spec"]["subdomain"] == service["metadata"]["name"]
    pods = _indexed_job_pods(job)
    # rank 0's DNS name under the headless Service is the rendezvous host every pod is told
    master_host = pods[0]["MASTER_ADDR"]
    assert master_host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    strategy, roles = _roles(pods)
    assert (strategy.mode, strategy.update, strategy.servers) == ("ps", "sync", 1)
    assert [r.role for r in roles] == [Role.SERVER, Role.WORKER, Role.WORKER, Role.WORKER]
    assert roles[0].server_index == 0 and [r.worker_index for r in roles[1:]] == [0, 1, 2]
    assert {(r.worker_num, r.server_num, r.master) for r in roles} == {(3, 1, f"{master_host}:29500")}


def test_split_jobs_put_the_servers_and_the_workers_on_pods_of_their_own(monkeypatch):
    """Each pod runs fleetrun as one node; its command line (Kubernetes' $(VAR) expansion) goes through fleetrun's
    own checks, node 0's agreement, and the environment each process gets, from which fleet detects its role."""
    from fleet.launch import cli
    from fleet.launch.agree import agree, request_of
    from fleet.launch.plan import JobLayout, child_env, local_specs

    service, *jobs = _load("ps-split-jobs.yaml")
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    monkeypatch.chdir(ROOT)  # the script path in the manifests is relative to the image's working directory
    monkeypatch.setenv("FLEET_SECRET", SECRET)
    pods = []
    for job in jobs:
        assert job["kind"] == "Job" and job["spec"]["completionMode"] == "Indexed"
        template = job["spec"]["template"]
        assert template["spec"]["subdomain"] == service["metadata"]["name"]
        assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
        (container,) = template["spec"]["containers"]
        assert container["command"] == ["python", "-m", "fleet.launch"]
        for index in range(job["spec"]["completions"]):
            environ = _container_env(container, index)
            argv = [
                re.sub(r"\$\((\w+)\)", lambda m, environ=environ: environ[m.group(1)], arg) for arg in container["args"]
            ]
            config = cli.parse_config(argv)
            # the pod's DNS name under the headless Service is the address it tells the other nodes
            assert config.host == f"{job['metadata']['name']}-{index}.{service['metadata']['name']}"
            pods.append((config, environ))
    requests = [
        request_of(config, config.host, [7000 + j for j in range(config.servers)], 6000 + config.node_rank)
        for config, _ in pods
    ]
    master_host = pods[0][0].master[0]
    agreed = agree(requests, master_host)
    assert agreed.node_counts == ((2, 0), (2, 0), (0, 2))
    assert agreed.master == "fleet-ps-workers-0.fleet-ps:6000"  # node 0 runs worker 0 and hosts the store
    layout = JobLayout(master=agreed.master, server_endpoints=agreed.server_endpoints, secret=SECRET)
    roles = []
    for config, environ in pods:
        config = replace(config, node_counts=agreed.node_counts)
        for spec in local_specs(config):
            reader = EnvReader(child_env(spec, config, layout, restart_count=0, log_dir="/l", base=environ))
            strategy = DistributedStrategy.from_env(reader)
            assert (strategy.mode, strategy.update) == ("ps", "sync")
            role = detect(reader)
            registry.get(strategy.mode).check_launch(strategy, role)
            roles.append(role)
    assert sorted((r.role.value, r.worker_index if r.is_worker else r.server_index) for r in roles) == [
        ("server", 0), ("server", 1), ("worker", 0), ("worker", 1), ("worker", 2), ("worker", 3)
    ]  # fmt: skip
    assert {(r.worker_num, r.server_num, r.master, r.server_endpoints) for r in roles} == {
        (
            4,
            2,
            "fleet-ps-workers-0.fleet-ps:6000",
            ("fleet-ps-servers-0.fleet-ps:7000", "fleet-ps-servers-0.fleet-ps:7001"),
        )
    }


def test_every_manifest_is_checked():
    checked = {"collective-pytorchjob.yaml", "sharding-pytorchjob.yaml", "ps-indexed-job.yaml", "ps-split-jobs.yaml"}
    assert {p.name for p in MANIFESTS.glob("*.yaml")} == checked
    for path in MANIFESTS.glob("*.yaml"):
        assert re.search(r"tests/launch/test_k8s_manifests\.py", path.read_text()), path
