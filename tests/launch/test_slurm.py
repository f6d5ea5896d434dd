"""Under a real Slurm: a one-node controller and daemon on this machine, the recipe under ``srun -n 2``.

Needs Debian's ``slurm-wlm`` (slurmctld, slurmd, srun, munged) and root (the daemons run as
root here); ``.ci/run`` installs it, elsewhere the test is skipped with the reason. The cluster
lives in a temporary directory with its own munge socket and free ports, and is stopped at the
end. ``FLEET_TEST_SLURM=1`` also submits ``examples/slurm/collective.sbatch`` with ``sbatch
--wait`` (about 40 s on 2 cores: opt-in).
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


def _reference_losses(tmp: Path) -> list[float]:
    report = tmp / "one.json"
    command = [sys.executable, str(ROOT / "examples/recipes/bptt_columns.py"), "--epochs", "1", "--report", str(report)]
    done = subprocess.run(command, env={**clean_env(), "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(report.read_text())["losses"]


@pytest.mark.timeout(150)
def test_srun_two_tasks_train_the_bptt_recipe_as_one_process_would(cluster, tmp_path):
    environ, _ = cluster
    report = tmp_path / "srun.json"
    environ = {**environ, "FLEET_SECRET": os.urandom(16).hex()}
    command = ["srun", "-n", "2", "--kill-on-bad-exit=1", sys.executable, "examples/recipes/bptt_columns.py"]
    command += ["--epochs", "1", "--report", str(report)]
    done = subprocess.run(command, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(report.read_text())
    assert (result["workers"], result["source"]) == (2, "slurm")
    assert result["losses"] == pytest.approx(_reference_losses(tmp_path), abs=1e-5)


@pytest.mark.timeout(200)
@pytest.mark.skipif(os.environ.get("FLEET_TEST_SLURM") != "1", reason="opt-in (about 40 s): FLEET_TEST_SLURM=1")
def test_the_documented_sbatch_script_runs_the_collective_example(cluster, tmp_path):
    environ, _ = cluster
    output = tmp_path / "job.out"
    command = ["sbatch", "--wait", f"--chdir={ROOT}", "--nodes=1", "--ntasks-per-node=2", f"--output={output}"]
    done = subprocess.run([*command, str(ROOT / "examples/slurm/collective.sbatch")], env=environ,
                          capture_output=True, text=True, timeout=180)  # fmt: skip
    text = output.read_text() if output.exists() else ""
    assert done.returncode == 0, done.stdout + done.stderr + text[-2000:]
    assert text.count("epoch 2 loss") == 2, text[-2000:]
