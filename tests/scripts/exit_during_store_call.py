"""A process that ends while a heartbeat's store call is in flight (tests/runtime/test_exit_during_store_call.py).

    exit_during_store_call.py MODE      # MODE: close (fleet.stop_worker's path) or exit (a script that never
                                             # stops: the interpreter's exit handlers)

The store's host (a child process) is stopped with SIGSTOP until a heartbeat is blocked in compare_set, then
continued 0.3 s later, as this process ends: the call returns while Python finalises. An object whose
finaliser sleeps keeps the finalisation open long enough for that to happen every time. Exits 0 when the
process ended cleanly; a daemon thread torn down inside torch's call aborts it instead (SIGABRT,
"terminate called without an active exception").
"""

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from fleet.collective.liveness import Liveness

mode = sys.argv[1]
HOST = """
import time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=60), wait_for_workers=False)
print(store.port, flush=True)
time.sleep(120)
"""
host = subprocess.Popen([sys.executable, "-c", HOST], stdout=subprocess.PIPE, text=True)
assert host.stdout is not None
port = int(host.stdout.readline())  # the host picked a free port
client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=30), wait_for_workers=False)
in_flight = threading.Event()


class Watched:
    """The job's store, saying when a heartbeat called it (torch's store methods cannot be replaced)."""

    def __init__(self, store):
        self.store = store

    def compare_set(self, *args):
        in_flight.set()
        return self.store.compare_set(*args)  # torch's client, which lets go of the GIL while it waits

    def __getattr__(self, name):
        return getattr(self.store, name)


beats = Liveness(f"127.0.0.1:{port}", "exit-test", rank=1, world_size=2, timeout_s=30, store=Watched(client))
in_flight.clear()  # the first beat ran in the constructor: wait for one of the heartbeat thread's
os.kill(host.pid, signal.SIGSTOP)
assert in_flight.wait(10), "no heartbeat called the store"
time.sleep(0.2)  # the call is now blocked in torch's client, waiting for the stopped host
# continued from outside this process, 0.3 s from now: the answer arrives while this process is ending
subprocess.Popen(["sh", "-c", f"sleep 0.3; kill -CONT {host.pid}; sleep 3; kill -KILL {host.pid}"])


class SlowFinaliser:
    def __del__(self):
        time.sleep(1.5)  # runs while the interpreter finalises (module globals are cleared)


keep_finalising = SlowFinaliser()
if mode == "close":
    beats.close()
print("done", flush=True)
