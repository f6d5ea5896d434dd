"""A configurable stand-in for a training script, for tests/launch/test_launch.py (no torch).

Every process prints its fleet variables, appends its pid to
$FLEET_LOG_DIR/pids.<role>.<rank> and then behaves as the flags say:

  --fail R            worker R prints 25 numbered lines and raises
  --kill R SIG        worker R kills itself with signal SIG (e.g. KILL)
  --fail-first K      process K ("worker.1", "server.0") exits 3 while FLEET_RESTART_COUNT is 0
  --port-once         worker 0 exits with EXIT_PORT_IN_USE on its first launch only
  --sleep S           workers sleep S seconds before finishing
  --server-hang       servers never exit by themselves
  --grandchild        each process starts a sleeping grandchild and records its pid

Workers write $FLEET_LOG_DIR/done.<rank> when they finish; servers exit 0 once
every worker's done file exists (unless --server-hang).
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

EXIT_PORT_IN_USE = 75

args = sys.argv[1:]
opts = {}
i = 0
while i < len(args):
    name = args[i]
    if name in ("--fail", "--fail-first", "--sleep"):
        opts[name], i = args[i + 1], i + 2
    elif name == "--kill":
        opts[name], i = (args[i + 1], args[i + 2]), i + 3
    else:
        opts[name], i = True, i + 1

role = os.environ["FLEET_ROLE"]
rank = int(os.environ["FLEET_WORKER_INDEX" if role == "worker" else "FLEET_SERVER_INDEX"])
restart = int(os.environ["FLEET_RESTART_COUNT"])
logs = Path(os.environ["FLEET_LOG_DIR"])
key = f"{role}.{rank}"

for name in ("FLEET_ROLE", "FLEET_SERVER_ENDPOINTS", "FLEET_MASTER", "FLEET_RESTART_COUNT"):
    print(f"ENV {name}={os.environ.get(name, '<unset>')}")
with open(logs / f"pids.{key}", "a") as f:
    f.write(f"{os.getpid()}\n")
if "--grandchild" in opts:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    with open(logs / f"grandchild.{key}", "w") as f:
        f.write(f"{child.pid}\n")


def _recorded(path: Path) -> bool:
    return path.exists() and path.stat().st_size > 0


if opts.get("--fail-first") == key and restart == 0:
    # Fail only once every process of this launch has recorded its pid: a peer still starting
    # would be stopped before recording it, and the tests count the launches from these files.
    everyone = [f"worker.{w}" for w in range(int(os.environ["FLEET_WORKER_NUM"]))]
    everyone += [f"server.{s}" for s in range(int(os.environ.get("FLEET_SERVER_NUM", "0") or 0))]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not all(_recorded(logs / f"pids.{k}") for k in everyone):
        time.sleep(0.01)
    print(f"{key} fails on its first run")
    sys.exit(3)

if role == "server":
    workers = int(os.environ["FLEET_WORKER_NUM"])
    while "--server-hang" in opts or not all((logs / f"done.{w}").exists() for w in range(workers)):
        time.sleep(0.05)
    print("server done")
    sys.exit(0)

if "--port-once" in opts and rank == 0:
    marker = logs / "port-once"
    if not marker.exists():
        marker.touch()
        print("pretending the port is taken")
        sys.exit(EXIT_PORT_IN_USE)

if opts.get("--fail") == str(rank):
    for n in range(25):
        print(f"line {n}")
    raise RuntimeError(f"worker {rank} exploded")

if "--kill" in opts and opts["--kill"][0] == str(rank):
    print("killing myself")
    sys.stdout.flush()
    os.kill(os.getpid(), getattr(signal, "SIG" + opts["--kill"][1]))

if "--fail" in opts or "--kill" in opts:
    time.sleep(60)  # the healthy peers wait to be stopped
time.sleep(float(opts.get("--sleep", 0)))
(logs / f"done.{rank}").touch()
print("worker done")
