"""Under a real Slurm: a one-node controller and daemon on this machine; ``srun -n 2`` and ``sbatch``.

Needs Debian's ``slurm-wlm`` (slurmctld, slurmd, srun, munged) and root (the daemons run as
root here); ``.ci/run`` installs it, elsewhere the test is skipped with the reason. The cluster
lives in a temporary directory with its own munge socket and free ports, and is stopped at the
end. The documented batch scripts (``examples/slurm/*.sbatch``) are submitted with ``sbatch``,
given a script to run as their arguments, and waited for.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dist_harness import clean_env, free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.slurm]

ROOT = Path(__file__).resolve().parents[2]
DAEMONS = ("slurmctld", "slurmd", "srun", "sbatch", "sinfo", "munged")
MUNGE_KEY = Path("/etc/munge/munge.key")


def _missing() -> str | None:
    absent = [name for name in DAEMONS if shutil.which(name) is None and not Path(f"/usr/sbin/{name}").exists()]
    if absent:
        return f"Slurm is not installed ({', '.join(absent)} missing): apt-get install -y slurm-wlm (.ci/run does)"
    if os.geteuid() != 0:
        return "the one-node Slurm cluster runs its daemons as root"
    if not MUNGE_KEY.exists():
        return f"{MUNGE_KEY} is missing (the munge package creates it)"
    return None


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = _missing()
    if reason:
        pytest.skip(reason)
    base = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "munge"):
        (base / sub).mkdir()
    os.chmod(base / "munge", 0o700)
    socket_path = base / "munge" / "munge.socket"
    host = socket.gethostname()
    conf = base / "slurm.conf"
    conf.write_text(
        f"""ClusterName=fleettest
SlurmctldHost={host}
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={socket_path}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={base}/state
SlurmdSpoolDir={base}/spool
SlurmctldPidFile={base}/slurmctld.pid
SlurmdPidFile={base}/slurmd.pid
SlurmctldLogFile={base}/slurmctld.log
SlurmdLogFile={base}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""
    )
    environ = {**clean_env(), "SLURM_CONF": str(conf), "PYTHONPATH": str(ROOT)}
    munge = [_binary("munged"), "--foreground", "--force", f"--socket={socket_path}", f"--key-file={MUNGE_KEY}"]
    munge += [f"--pid-file={base}/munge/munged.pid", f"--seed-file={base}/munge/seed", f"--log-file={base}/munged.log"]
    started = [subprocess.Popen(munge, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)]
    try:
        for name in ("slurmctld", "slurmd"):
            started.append(subprocess.Popen([_binary(name), "-D", "-f", str(conf)], env=environ,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))  # fmt: skip
        deadline = time.monotonic() + 30
        while True:
            state = subprocess.run(["sinfo", "-h", "-o", "%t"], env=environ, capture_output=True, text=True)
            if state.stdout.strip() == "idle":
                break
            if time.monotonic() > deadline or any(p.poll() is not None for p in started):
                logs = "".join(p.read_text()[-1500:] for p in base.glob("*.log"))
                pytest.fail(f"the one-node Slurm cluster did not come up: {state.stdout}{state.stderr}\n{logs}")
            time.sleep(0.3)
        yield environ, base
    finally:
        for process in reversed(started):
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory) -> list[float]:
    """The bptt recipe's losses in one plain process (no launcher)."""
    report = tmp_path_factory.mktemp("one") / "one.json"
    command = [sys.executable, str(ROOT / "examples/recipes/bptt_columns.py"), "--epochs", "1", "--report", str(report)]
    done = subprocess.run(command, env={**clean_env(), "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(report.read_text())
    assert (result["workers"], result["source"]) == (1, "single")
    return result["losses"] + result["validation"]


BPTT = ["examples/recipes/bptt_columns.py", "--epochs", "1", "--report"]


@pytest.mark.timeout(150)
def test_srun_two_tasks_train_the_bptt_recipe_as_one_process_would(cluster, reference_losses, tmp_path):
    environ, _ = cluster
    report = tmp_path / "srun.json"
    environ = {**environ, "FLEET_SECRET": os.urandom(16).hex()}
    command = ["srun", "-n", "2", "--kill-on-bad-exit=1", sys.executable, *BPTT, str(report)]
    done = subprocess.run(command, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(report.read_text())
    assert (result["workers"], result["source"]) == (2, "slurm")
    assert result["losses"] + result["validation"] == pytest.approx(reference_losses, abs=1e-5)


def _sbatch(environ: dict[str, str], script: str, options: list[str], args: list[str], output: Path) -> str:
    """One of the documented scripts submitted from the repository root, waited for; the job's output.

    Polled here rather than with ``sbatch --wait``, whose back-off between polls grows to 32 s.
    """
    command = ["sbatch", "--parsable", f"--chdir={ROOT}", f"--output={output}", *options, str(ROOT / script), *args]
    done = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    job = done.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 160
    while True:
        shown = subprocess.run(["scontrol", "-o", "show", "job", job], env=environ, capture_output=True, text=True)
        state = dict(field.split("=", 1) for field in shown.stdout.split() if "=" in field)
        if state.get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", None):
            break
        assert time.monotonic() < deadline, f"job {job} still {state.get('JobState')}: {shown.stdout}{shown.stderr}"
        time.sleep(0.3)
    text = output.read_text() if output.exists() else ""
    assert (state["JobState"], state.get("ExitCode")) == ("COMPLETED", "0:0"), shown.stdout + text[-3000:]
    return text


@pytest.mark.timeout(200)
def test_the_documented_collective_sbatch_script_runs_the_bptt_recipe(cluster, reference_losses, tmp_path):
    environ, _ = cluster
    report = tmp_path / "sbatch.json"
    options = ["--nodes=1", "--ntasks-per-node=2"]  # the script asks for two nodes; this cluster has one
    _sbatch(environ, "examples/slurm/collective.sbatch", options, [*BPTT, str(report)], tmp_path / "job.out")
    result = json.loads(report.read_text())
    assert (result["workers"], result["source"]) == (2, "slurm")
    assert result["losses"] + result["validation"] == pytest.approx(reference_losses, abs=1e-5)


@pytest.mark.timeout(200)
def test_the_documented_ps_sbatch_script_runs_one_server_and_two_workers(cluster, tmp_path):
    environ, _ = cluster
    options = ["--overcommit"]  # three tasks on a machine that may have two cores
    text = _sbatch(
        environ, "examples/slurm/ps.sbatch", options, ["tests/scripts/tiny_ps_train.py"], tmp_path / "ps.out"
    )
    lines = sorted(line for line in text.splitlines() if " of 2 checksum " in line)
    assert [line.split(" of ")[0] for line in lines] == ["worker 0", "worker 1"], text[-3000:]  # task 0: the server
    assert len({line.rsplit(" ", 1)[-1] for line in lines}) == 1, lines  # sync: the servers' parameters on both
