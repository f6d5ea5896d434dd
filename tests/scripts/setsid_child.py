"""A worker that leaves a process behind outside its process group (setsid), records its pid, and exits."""

import subprocess
import sys

import fleet

fleet.init()
sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
with open(sys.argv[1] + f".{fleet.worker_index()}", "w") as f:
    f.write(str(sleeper.pid))
fleet.barrier_worker()
