"""fleetrun: the launcher run as a subprocess on tiny scripts (no torch), plus its pure parts in-process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dist_harness import run_fleetrun as fleetrun
from fleet.launch import cli
from fleet.launch.config import LaunchConfig
from fleet.launch.plan import JobLayout, child_env, local_specs
from fleet.launch.ports import PortAllocator
from fleet.runtime import env

SCRIPTS = Path(__file__).parents[1] / "scripts"
ENV_SCRIPT = SCRIPTS / "launch_env.py"
JOB_SCRIPT = SCRIPTS / "launch_job.py"
PREFIX = re.compile(r"^\[(worker|server) (\d+)\] ")


def child_lines(stdout: str) -> list[tuple[str, str]]:
    """(label, text) for every prefixed line."""
    out = []
    for line in stdout.splitlines():
        m = PREFIX.match(line)
        if m:
            out.append((f"{m.group(1)} {m.group(2)}", line[m.end() :]))
    return out


def env_of(stdout: str, label: str) -> dict[str, str]:
    values = {}
    for who, text in child_lines(stdout):
        if who == label and text.startswith("ENV "):
            name, _, value = text[4:].partition("=")
            values[name] = value
    return values


def pids(log_dir: Path, pattern: str) -> list[int]:
    return [int(line) for path in sorted(log_dir.glob(pattern)) for line in path.read_text().split()]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


# --- single-node jobs -------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [2, 3])
def test_workers_get_their_variables_prefixes_and_log_files(tmp_path, workers):
    logs = tmp_path / "logs"
    strategy = tmp_path / "s.toml"
    strategy.write_text('mode = "collective"\n')
    r = fleetrun("--workers", workers, "--strategy", strategy, "--log-dir", logs, ENV_SCRIPT, "a", "--b", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert f"{workers} workers, 0 servers" in lines[0] and str(logs) in lines[0]
    summary_at = next(i for i, line in enumerate(lines) if "job succeeded" in line)
    for line in lines[:summary_at]:  # every line before the summary table carries a prefix
        assert PREFIX.match(line) or line.startswith("[fleetrun] "), line
    secrets, masters = set(), set()
    for rank in range(workers):
        values = env_of(r.stdout, f"worker {rank}")
        assert values["FLEET_ROLE"] == "worker"
        assert values["FLEET_WORKER_INDEX"] == str(rank)
        assert values["FLEET_WORKER_NUM"] == str(workers)
        assert values["FLEET_LOCAL_RANK"] == str(rank)
        assert values["FLEET_SERVER_NUM"] == "0" and values["FLEET_SERVER_ENDPOINTS"] == ""
        assert values["FLEET_RESTART_COUNT"] == "0"
        assert values["FLEET_LOG_DIR"] == str(logs)
        assert values["FLEET_STRATEGY_FILE"] == str(strategy.resolve())
        assert values["PYTHONUNBUFFERED"] == "1"
        assert re.fullmatch(r"[0-9a-f]{64}", values["FLEET_SECRET"])
        assert re.fullmatch(r"127\.0\.0\.1:\d+", values["FLEET_MASTER"])
        # torchrun's variables, with torchrun's meaning, for code written for torchrun
        assert (values["RANK"], values["LOCAL_RANK"], values["GROUP_RANK"]) == (str(rank), str(rank), "0")
        assert values["WORLD_SIZE"] == values["LOCAL_WORLD_SIZE"] == str(workers)
        assert f"{values['MASTER_ADDR']}:{values['MASTER_PORT']}" == values["FLEET_MASTER"]
        secrets.add(values["FLEET_SECRET"])
        masters.add(values["FLEET_MASTER"])
        texts = [text for who, text in child_lines(r.stdout) if who == f"worker {rank}"]
        assert "ARGS a --b" in texts and "to stderr" in texts and "partial line without newline" in texts
        log = (logs / f"worker.{rank}.log").read_text()
        assert f"FLEET_WORKER_INDEX={rank}" in log and "to stderr" in log and log.endswith("without newline")
    assert len(secrets) == 1 and len(masters) == 1
    # The script never calls fleet.init: the workers trained on their own, and the summary says so.
    names = ", ".join(f"worker {rank}" for rank in range(workers))
    assert f"[fleetrun] {names} finished without calling fleet.init()" in r.stdout, r.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_workers_that_called_fleet_init_get_no_such_note(tmp_path):
    r = fleetrun("--workers", 2, "--log-dir", tmp_path / "logs", SCRIPTS / "tiny_train.py", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "checksum" in r.stdout and "without calling fleet.init()" not in r.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_failing_worker_is_named_with_its_last_lines_and_the_others_stopped(tmp_path):
    logs = tmp_path / "logs"
    start = time.monotonic()
    r = fleetrun("--workers", 2, "--log-dir", logs, JOB_SCRIPT, "--fail", 1, cwd=tmp_path)
    took = time.monotonic() - start
    assert r.returncode == 1, r.stdout + r.stderr
    assert took < 20  # the other worker sleeps 60 s unless stopped
    assert "worker 1 failed: exit status 1" in r.stdout
    tail = r.stdout.split("worker 1 failed: exit status 1", 1)[1]
    assert "last 20 lines of worker 1" in tail
    assert "[worker 1] RuntimeError: worker 1 exploded" in tail and "[worker 1] line 24" in tail
    assert "line 5\n" not in tail  # only the last 20 lines
    assert "stopped (SIGTERM)" in tail  # worker 0 in the summary
    assert not any(alive(p) for p in pids(logs, "pids.*"))


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_worker_killed_by_a_signal_propagates_128_plus_signal(tmp_path):
    r = fleetrun("--workers", 2, "--log-dir", tmp_path / "logs", JOB_SCRIPT, "--kill", 0, "KILL", cwd=tmp_path)
    assert r.returncode == 128 + signal.SIGKILL, r.stdout + r.stderr
    assert "worker 0 failed: killed by SIGKILL (exit status 137)" in r.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_parameter_server_job_servers_exit_after_workers(tmp_path):
    logs = tmp_path / "logs"
    r = fleetrun("--servers", 1, "--workers", 2, "--log-dir", logs, JOB_SCRIPT, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    server = env_of(r.stdout, "server 0")
    assert server["FLEET_ROLE"] == "server"
    assert re.fullmatch(r"127\.0\.0\.1:\d+", server["FLEET_SERVER_ENDPOINTS"])
    for rank in (0, 1):
        assert env_of(r.stdout, f"worker {rank}")["FLEET_SERVER_ENDPOINTS"] == server["FLEET_SERVER_ENDPOINTS"]
    assert server["FLEET_MASTER"] != server["FLEET_SERVER_ENDPOINTS"]
    assert ("server 0", "server done") in child_lines(r.stdout)
    assert "did not exit" not in r.stdout
    assert (logs / "server.0.log").exists()


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_server_that_does_not_exit_is_stopped_after_the_grace_period(tmp_path):
    args = ("--servers", 1, "--workers", 1, "--server-grace", 1, "--log-dir", tmp_path / "logs")
    r = fleetrun(*args, JOB_SCRIPT, "--server-hang", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "server 0 did not exit within 1 s after the workers finished; stopping them" in r.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_fleetrun_stops_every_child_and_grandchild(tmp_path, sig):
    logs = tmp_path / "logs"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleet.launch", "--servers", "1", "--workers", "2", "--log-dir", str(logs),
         str(JOB_SCRIPT), "--server-hang", "--sleep", "60", "--grandchild"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        # every pid written, not only the grandchildren's files made (a worker's pid file may come last)
        while len(pids(logs, "pids.*") + pids(logs, "grandchild.*")) < 6 and time.monotonic() < deadline:
            time.sleep(0.1)
        started = pids(logs, "pids.*") + pids(logs, "grandchild.*")
        assert len(started) == 6
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=15)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, out
    assert f"received {sig.name}" in out
    deadline = time.monotonic() + 5
    while any(alive(p) for p in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in started if alive(p)]


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_port_in_use_relaunches_with_fresh_ports_without_counting_a_restart(tmp_path):
    r = fleetrun("--workers", 2, "--log-dir", tmp_path / "logs", JOB_SCRIPT, "--port-once", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "worker 0 could not bind its port" in r.stdout and "fresh ports" in r.stdout
    masters = [text for who, text in child_lines(r.stdout) if who == "worker 0" and "FLEET_MASTER" in text]
    assert len(masters) == 2 and masters[0] != masters[1]
    counts = {text for _, text in child_lines(r.stdout) if "FLEET_RESTART_COUNT" in text}
    assert counts == {"ENV FLEET_RESTART_COUNT=0"}


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_collective_job_restarts_as_a_whole(tmp_path):
    logs = tmp_path / "logs"
    r = fleetrun("--workers", 2, "--max-restarts", 1, "--log-dir", logs, JOB_SCRIPT, "--fail-first", "worker.1",
                 cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "restarting all workers (restart 1 of 1)" in r.stdout
    assert len(pids(logs, "pids.worker.0")) == 2 and len(pids(logs, "pids.worker.1")) == 2
    assert "FLEET_RESTART_COUNT=1" in (logs / "worker.0.log").read_text()


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_parameter_server_job_restarts_only_the_failed_process(tmp_path):
    logs = tmp_path / "logs"
    r = fleetrun("--servers", 1, "--workers", 2, "--max-restarts", 1, "--log-dir", logs, JOB_SCRIPT,
                 "--fail-first", "worker.1", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "worker 1 failed (exit status 3" in r.stdout and "restarting it (restart 1 of 1)" in r.stdout
    assert len(pids(logs, "pids.worker.1")) == 2
    assert len(pids(logs, "pids.worker.0")) == 1 and len(pids(logs, "pids.server.0")) == 1
    log = (logs / "worker.1.log").read_text()
    assert "FLEET_RESTART_COUNT=0" in log and "FLEET_RESTART_COUNT=1" in log


# --- several nodes (two fleetruns on this machine) -------------------------------------------


def _two_nodes(tmp_path: Path, *args) -> list[tuple[int, str]]:
    """Run node 0 and node 1 of one job; their (exit status, stdout)."""
    port = PortAllocator().take()
    environ = {**os.environ, "NO_COLOR": "1", env.FLEET_SECRET: "ab" * 32}
    common = ["--nnodes", "2", "--master", f"127.0.0.1:{port}", "--log-dir", str(tmp_path / "logs")]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "fleet.launch", *common, "--node-rank", str(node), *map(str, args)],
            cwd=tmp_path, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for node in (0, 1)
    ]  # fmt: skip
    try:
        outputs = [p.communicate(timeout=40)[0] for p in procs]
        return [(p.returncode, out) for p, out in zip(procs, outputs, strict=True)]
    finally:
        for p in procs:
            p.kill()


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_two_nodes_share_one_layout_with_global_ranks(tmp_path):
    (rc0, out0), (rc1, out1) = _two_nodes(tmp_path, "--workers", 1, "--servers", 1, JOB_SCRIPT)
    assert (rc0, rc1) == (0, 0), out0 + out1
    assert "node 1 joined" in out0
    w0, s0, w1, s1 = (
        env_of(out0, "worker 0"),
        env_of(out0, "server 0"),
        env_of(out1, "worker 1"),
        env_of(out1, "server 1"),
    )
    endpoints = s0["FLEET_SERVER_ENDPOINTS"].split(",")
    assert len(endpoints) == 2 and len(set(endpoints)) == 2
    assert len({v["FLEET_SERVER_ENDPOINTS"] for v in (w0, s0, w1, s1)}) == 1
    assert len({v["FLEET_MASTER"] for v in (w0, s0, w1, s1)}) == 1
    assert ("server 1", "server done") in child_lines(out1)  # it waited for worker 0 on the other node too


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_failure_on_one_node_stops_the_other(tmp_path):
    start = time.monotonic()
    (rc0, out0), (rc1, out1) = _two_nodes(tmp_path, "--workers", 1, JOB_SCRIPT, "--fail", 1)
    assert time.monotonic() - start < 30  # worker 0 would sleep 60 s
    assert rc1 == 1 and "worker 1 failed: exit status 1" in out1
    assert rc0 == 1 and "node 1: worker 1 failed (exit status 1)" in out0, out0


# --- bad input ----------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_bad_input_in_a_subprocess_exits_2_without_traceback(tmp_path):
    state = tmp_path / "state"
    r = fleetrun("--bogus", ENV_SCRIPT, cwd=tmp_path, timeout=30, extra_env={"XDG_STATE_HOME": str(state)})
    assert r.returncode == 2
    assert "--bogus" in r.stderr and "Traceback" not in r.stderr + r.stdout
    assert not state.exists() and not (tmp_path / "fleet_logs").exists()


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_default_log_directory_is_the_users_state_directory_not_the_working_tree(tmp_path):
    work, state = tmp_path / "work", tmp_path / "state"
    work.mkdir()
    r = fleetrun("--workers", 1, ENV_SCRIPT, cwd=work, timeout=50, extra_env={"XDG_STATE_HOME": str(state)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert list(work.iterdir()) == []  # nothing written into the user's working tree
    (run,) = (state / "fleet" / "logs").iterdir()
    assert (run / "worker.0.log").is_file() and f"logs in {run}" in r.stdout


def _bad(tmp_path, capsys, *argv) -> str:
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        code = cli.main([str(a) for a in argv])
    finally:
        os.chdir(old)
    out, err = capsys.readouterr()
    assert code == env.EXIT_USER_ERROR, out + err
    assert "Traceback" not in out + err and err.startswith("fleetrun: error: ")
    return err


@pytest.mark.timeout(30)
def test_bad_input_names_the_fault(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(env.FLEET_SECRET, raising=False)
    collective = tmp_path / "c.toml"
    collective.write_text('[strategy]\nmode = "collective"\n')
    ps = tmp_path / "p.json"
    ps.write_text('{"a_sync": true}')
    broken = tmp_path / "b.toml"
    broken.write_text("mode = = 1")
    cases = [
        (["missing.py"], "'missing.py' does not exist"),
        ([], "No training script"),
        (["--bogus", ENV_SCRIPT], "no option --bogus"),
        (["--workers", 0, ENV_SCRIPT], "--workers 0"),
        (["--workers", "two", ENV_SCRIPT], "--workers 'two' is not a number"),
        (["--workers"], "--workers needs a value"),
        (["--servers", -1, ENV_SCRIPT], "--servers -1"),
        (["--max-restarts", -1, ENV_SCRIPT], "--max-restarts -1"),
        (["--servers", 1, "--strategy", collective, ENV_SCRIPT], 'mode = "collective"'),
        (["--strategy", ps, ENV_SCRIPT], "--servers N"),
        (["--strategy", tmp_path / "nope.toml", ENV_SCRIPT], "nope.toml' given to --strategy does not exist"),
        (["--strategy", broken, ENV_SCRIPT], "does not parse"),
        (["--nnodes", 2, "--node-rank", 2, "--master", "h:1", ENV_SCRIPT], "--node-rank 2 is out of range"),
        (["--nnodes", 2, ENV_SCRIPT], "needs --master"),
        (["--nnodes", 2, "--master", "h:1", ENV_SCRIPT], "needs the same FLEET_SECRET on every node"),
        (["--master", "nohostport", ENV_SCRIPT], "--master 'nohostport' is not a HOST:PORT"),
        (["--master", "h:99999", ENV_SCRIPT], "is not a HOST:PORT"),
        (["--nnodes", 2, "--master", "h:1", "--max-restarts", 1, ENV_SCRIPT], "parameter-server jobs only"),
    ]
    for argv, expected in cases:
        err = _bad(tmp_path, capsys, *argv)
        assert expected in err, (argv, err)
    assert not (tmp_path / "fleet_logs").exists()


# --- pure parts ---------------------------------------------------------------------------


def test_script_arguments_pass_through_untouched():
    assert cli.split_argv(["--workers", "2", "t.py", "--workers", "3"]) == (
        ["--workers", "2"],
        ["t.py", "--workers", "3"],
    )
    assert cli.split_argv(["--strategy=s.toml", "t.py", "--", "x"]) == (["--strategy=s.toml"], ["t.py", "--", "x"])
    assert cli.split_argv(["--workers", "2", "--", "t.py", "-v"]) == (["--workers", "2"], ["t.py", "-v"])


def test_ports_are_never_handed_out_twice():
    ports = PortAllocator()
    ports.reserve(12345)
    taken = ports.take_many(20)
    assert len(set(taken)) == 20 and 12345 not in taken


def test_multi_node_ranks_and_environment():
    config = LaunchConfig(script=ENV_SCRIPT, workers=2, servers=1, nnodes=3, node_rank=1, master=("10.0.0.1", 6170))
    specs = local_specs(config)
    assert [(s.role, s.rank, s.local_rank) for s in specs] == [("server", 1, 2), ("worker", 2, 0), ("worker", 3, 1)]
    layout = JobLayout(master="10.0.0.1:7000", server_endpoints=("a:1", "b:2", "c:3"), secret="ab")
    values = child_env(specs[1], config, layout, restart_count=2, log_dir="/l", base={"KEEP": "1"})
    assert values["KEEP"] == "1" and values[env.FLEET_ROLE] == "worker" and values[env.FLEET_LOCAL_RANK] == "0"
    assert values[env.FLEET_WORKER_INDEX] == "2" and values[env.FLEET_WORKER_NUM] == "6"
    assert values[env.FLEET_SERVER_NUM] == "3" and values[env.FLEET_SERVER_ENDPOINTS] == "a:1,b:2,c:3"
    assert values[env.FLEET_RESTART_COUNT] == "2" and values[env.FLEET_MASTER] == "10.0.0.1:7000"
    # torchrun's variables count workers only: global rank 2 of 6, first on its node (node 1)
    torchrun = {name: values[name] for name in env.TORCHRUN_VARIABLES}
    assert torchrun == {
        "RANK": "2",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "6",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "7000",
    }
    outer = {"RANK": "9", "WORLD_SIZE": "12", "LOCAL_RANK": "3", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    server = child_env(specs[0], config, layout, restart_count=0, log_dir="/l", base={"KEEP": "1", **outer})
    assert server["KEEP"] == "1" and not set(env.TORCHRUN_VARIABLES) & set(server)  # a server is no torchrun rank
    assert "TORCHELASTIC_USE_AGENT_STORE" not in server


def test_every_child_learns_how_many_processes_of_the_job_share_its_host():
    """Workers spin before sleeping only with a core for each of them (fleet.collective.shm.spinning_pays):
    the count includes this node's servers, which the workers' own variables do not show."""
    config = LaunchConfig(script=ENV_SCRIPT, workers=2, servers=1, nnodes=3, node_rank=1, master=("10.0.0.1", 6170))
    layout = JobLayout(master="10.0.0.1:7000", server_endpoints=("a:1", "b:2", "c:3"), secret="ab")
    for spec in local_specs(config):
        values = child_env(spec, config, layout, restart_count=0, log_dir="/l", base={})
        assert values[env.FLEET_LOCAL_PROCESSES] == "3", spec


@pytest.mark.multiprocess
def test_the_launcher_modules_do_not_import_torch():
    # Load fleet.launch without running fleet/__init__.py (the training side's face, which imports torch).
    root = str(Path(cli.__file__).parent.parent)
    code = (
        "import sys, types\n"
        f"pkg = types.ModuleType('fleet'); pkg.__path__ = [{root!r}]; sys.modules['fleet'] = pkg\n"
        "import fleet.launch.cli, fleet.launch.supervisor, fleet.launch.multinode\n"
        "print('torch' in sys.modules, 'pydantic' in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False"]


def test_strategy_flag_wins_over_an_inherited_strategy(tmp_path):
    path = tmp_path / "s.json"
    path.write_text('{"mode": "ps", "update": "async"}')
    from fleet.launch.config import StrategyFile, load_strategy_file

    strategy = load_strategy_file(str(path))
    assert strategy == StrategyFile(path=path.resolve(), mode="ps")
    config = LaunchConfig(script=ENV_SCRIPT, servers=1, strategy=strategy)
    layout = JobLayout(master="127.0.0.1:1", server_endpoints=("127.0.0.1:2",), secret="ab")
    base = {env.FLEET_STRATEGY: '{"mode": "collective"}'}
    values = child_env(local_specs(config)[0], config, layout, restart_count=0, log_dir="/l", base=base)
    assert env.FLEET_STRATEGY not in values and values[env.FLEET_STRATEGY_FILE] == str(path.resolve())
    assert values[env.FLEET_ROLE] == "server" and values[env.FLEET_SERVER_INDEX] == "0"


def test_control_messages_are_signed_and_forgeries_dropped():
    import socket

    from fleet.launch.control import Peer

    a, b = socket.socketpair()
    sender, receiver, stranger = Peer(a, "secret"), Peer(b, "secret"), Peer(a, "wrong")
    stranger.send(type="stop", code=9)  # signed with the wrong secret
    a.sendall(b"not json\n")
    sender.send(type="stop", code=1, reason="node 1: worker 3 failed")
    assert receiver.recv() == {"type": "stop", "code": 1, "reason": "node 1: worker 3 failed"}
    sender.close()
    assert receiver.recv() is None
    receiver.close()


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_an_unreachable_master_fails_with_a_clear_message(tmp_path):
    master = f"127.0.0.1:{PortAllocator().take()}"
    options = ("--nnodes", "2", "--node-rank", "1", "--master", master, "--join-timeout", "2")
    done = fleetrun(
        *options,
        "--log-dir",
        tmp_path / "logs",
        ENV_SCRIPT,
        cwd=tmp_path,
        timeout=50,
        extra_env={"FLEET_SECRET": "ab" * 16},
    )
    assert done.returncode != 0
    assert "Could not reach node 0 at --master 127.0.0.1:" in done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
