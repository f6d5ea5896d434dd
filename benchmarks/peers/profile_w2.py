"""Profile one worker of a running W2 job with py-spy: where the time goes (benchmarks/README.md, W2).

    python benchmarks/peers/profile_w2.py fleet      [--seconds 10] [--mode async] [--servers 1]
    python benchmarks/peers/profile_w2.py torchrec   [--config tw-fused]
    python benchmarks/peers/profile_w2.py paddle     [--feed run] [--native]

Starts the job (fleet under fleetrun; a peer through its driver in benchmarks/peers/, from its venv)
with more steps than it will run, waits until worker 0 is past its warm-up, records worker 0 (and
for fleet, server 0) with ``py-spy record --idle --nonblocking`` for ``--seconds``, stops the job, and prints
benchmarks/peers/pyspy_summary.py's breakdown. py-spy comes from fleet's venv (PY_SPY overrides).
``--native`` adds C/C++ frames (it stops the process at each sample, which skews syscall-heavy
parts, so the default is without). Raw profiles stay in ``--out`` (default: a temporary folder).
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import pyspy_summary  # noqa: E402
from peer_procs import kill_group  # noqa: E402


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def _env(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(i.decode(errors="replace").split("=", 1) for i in items if b"=" in i)


def _find(root: int, **want: str) -> int | None:
    for pid in _descendants(root):
        env = _env(pid)
        if all(env.get(k) == v for k, v in want.items()):
            return pid
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("system", choices=["fleet", "torchrec", "paddle"])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    parser.add_argument("--native", action="store_true", help="py-spy --native (blocking)")
    parser.add_argument("--mode", default="async", help="fleet / paddle PS mode")
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--config", default="tw-fused", help="torchrec configuration")
    parser.add_argument("--feed", default="run", help="paddle: run or dataset")
    parser.add_argument("--start-timeout", type=float, default=180.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix=f"w2-profile-{args.system}-")
    os.makedirs(out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="w2-profile-job-")
    ready = os.path.join(work, "ready")
    env = {**os.environ, "W2_READY": ready, "PYTHONUNBUFFERED": "1"}
    steps = "1000000"
    if args.system == "fleet":
        strategy = os.path.join(work, "s.toml")
        with open(strategy, "w") as f:
            f.write(f'mode = "ps"\nupdate = "{args.mode}"\n')
        script = os.path.join(ROOT, "examples", "single_to_multi", "train_ctr.py")
        cmd = [
            sys.executable,
            "-m",
            "fleet.launch",
            "--servers",
            str(args.servers),
            "--workers",
            "2",
            "--strategy",
            strategy,
        ]
        cmd += ["--log-dir", os.path.join(work, "logs"), script, "--steps", steps]
    else:
        venvs = os.environ.get("FLEET_PEERS_VENVS") or os.path.join(HERE, ".venvs")
        python = os.path.join(venvs, args.system, "bin", "python")
        if args.system == "torchrec":
            cmd = [python, os.path.join(HERE, "w2_torchrec.py"), "--config", args.config]
        else:
            cmd = [python, os.path.join(HERE, "w2_paddle.py"), "--mode", args.mode, "--servers", str(args.servers)]
            cmd += ["--feed", args.feed]
        # the dataset feed writes its batches first: fewer steps
        cmd += ["--steps", "3000" if args.feed == "dataset" and args.system == "paddle" else steps]
    log_path = os.path.join(out, "job.out")
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, env=env, cwd=work, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        worker = server = None
        deadline = time.time() + args.start_timeout
        while worker is None and time.time() < deadline:
            time.sleep(0.5)
            if proc.poll() is not None:
                sys.exit(f"the job ended early ({proc.returncode}); see {log_path}")
            if args.system == "fleet":
                with open(log_path, errors="replace") as f:
                    if "worker 0 step 20 " in f.read():
                        worker = _find(proc.pid, FLEET_ROLE="worker", FLEET_WORKER_INDEX="0")
                        server = _find(proc.pid, FLEET_ROLE="server", FLEET_SERVER_INDEX="0")
            elif os.path.exists(f"{ready}.0"):
                time.sleep(1.0)
                with open(f"{ready}.0") as f:
                    worker = int(f.read())
        if worker is None:
            sys.exit(f"worker 0 did not get past its warm-up in {args.start_timeout:.0f} s; see {log_path}")
        py_spy = os.environ.get("PY_SPY") or shutil.which("py-spy") or os.path.join(ROOT, ".venv", "bin", "py-spy")
        flags = ["--idle", "--threads", "--format", "raw", "-r", str(args.rate), "-d", str(int(args.seconds))]
        flags += ["--native"] if args.native else ["--nonblocking"]
        jobs = [("worker0", worker)] + ([("server0", server)] if server else [])
        spies = [
            (
                name,
                subprocess.Popen(
                    [py_spy, "record", *flags, "-o", os.path.join(out, f"{name}.txt"), "--pid", str(pid)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                ),
            )
            for name, pid in jobs
        ]
        load = os.getloadavg()[0]
        for _, spy in spies:
            spy.wait(timeout=args.seconds + 60)
        load = (load + os.getloadavg()[0]) / 2
    finally:
        kill_group(proc)
        log.close()
        shutil.rmtree(work, ignore_errors=True)
        for leftover in glob.glob("/tmp/w2-paddle-data-*"):
            if os.path.getmtime(leftover) > time.time() - 3600 and args.system == "paddle":
                shutil.rmtree(leftover, ignore_errors=True)
    print(f"{args.system}: worker 0 profiled for {args.seconds:.0f} s, load average {load:.1f}; raw profiles in {out}")
    shares, total, others = pyspy_summary.summarize(args.system, pyspy_summary.read(os.path.join(out, "worker0.txt")))
    for name, n in shares.most_common():
        print(f"  {100 * n / max(total, 1):5.1f} %  {name}")
    if others:
        print("  other threads of worker 0, busy samples (as a share of the training thread's):")
        for frame, n in others.most_common(4):
            print(f"  {100 * n / max(total, 1):5.1f} %  {frame}")
    if server:
        # per thread (py-spy --threads puts "thread (0x...)" first): the server's busiest thread
        threads: dict[str, list[int]] = {}
        frames: dict[str, int] = {}
        for stack, n in pyspy_summary.read(os.path.join(out, "server0.txt")).items():
            thread = stack.split(";", 1)[0]
            busy = not pyspy_summary.re.search(pyspy_summary.IDLE, stack)
            counts = threads.setdefault(thread, [0, 0])
            counts[0] += n
            counts[1] += n if busy else 0
            if busy:
                inner = [f for f in stack.split(";") if "fleet/" in f]
                key = inner[-1] if inner else stack.split(";")[-1]
                frames[key] = frames.get(key, 0) + n
        name, (total, busy) = max(threads.items(), key=lambda kv: kv[1][1])
        print(f"  server 0: its busiest thread works {100 * busy / max(total, 1):.0f} % of the time; top frames:")
        for key, n in sorted(frames.items(), key=lambda kv: -kv[1])[:5]:
            print(f"  {100 * n / max(total, 1):5.1f} %  {key}")


if __name__ == "__main__":
    main()
