"""A process that ends while a store call is in flight ends cleanly, not on SIGABRT.

A daemon thread inside torch's store call when the interpreter finalises is ended by Python 3.11 with
``pthread_exit`` as the call takes the GIL back in a C++ destructor, and the forced unwinding through that
``noexcept`` frame aborts the process: "terminate called without an active exception", exit 134, for a job
that had finished (it failed the slow-link test's worker 0 once). fleet stops its heartbeats and waits for
the calls in flight before that (:mod:`fleet.runtime.store_calls`).

The process test (tests/scripts/exit_during_store_call.py) makes it happen every time without the fix: the
store's host is stopped while a heartbeat waits on it and continued as the process ends, and a slow
finaliser keeps the interpreter's finalisation open while the answer arrives.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dist_harness import clean_env
from fleet.runtime import store_calls
from fleet.runtime.store_calls import StoreSilentError, within

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "exit_during_store_call.py"


@pytest.mark.multiprocess
@pytest.mark.slow  # two interpreters importing torch: about 10 s on a busy 2-core machine
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["close", "exit"])
def test_a_process_ending_during_a_heartbeats_store_call_exits_0(mode):
    """``close``: fleet.stop_worker's path (the heartbeats are closed); ``exit``: a script that never stops them."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), mode],
        env=clean_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert "terminate called" not in done.stderr, done.stderr[-3000:]
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert done.stdout.strip().endswith("done"), done.stdout


@pytest.mark.timeout(60)
def test_settle_waits_for_a_call_in_flight_and_not_for_an_abandoned_one():
    answer, abandoned_answer = threading.Event(), threading.Event()
    with pytest.raises(StoreSilentError) as silent:
        within(lambda: abandoned_answer.wait(60), 0.05, "127.0.0.1:1")  # past its deadline: given up on
    in_flight = threading.Thread(target=lambda: within(lambda: answer.wait(60), 30, "127.0.0.1:1"), daemon=True)
    in_flight.start()
    time.sleep(0.1)
    threading.Timer(0.3, answer.set).start()
    started = time.monotonic()
    left = store_calls.settle(timeout_s=20)
    took = time.monotonic() - started
    assert left == 1, left  # the abandoned call is still in torch's code (here: still waiting)
    assert 0.1 < took < 10, took  # waited for the call in flight to return, not for the abandoned one
    abandoned_answer.set()
    silent.value.pending.join(10)
    in_flight.join(10)
    assert store_calls.settle(timeout_s=0) == 0


@pytest.mark.timeout(60)
def test_settle_never_waits_past_its_bound():
    answer = threading.Event()
    caller = threading.Thread(target=lambda: within(lambda: answer.wait(60), 30, "127.0.0.1:1"), daemon=True)
    caller.start()
    time.sleep(0.1)
    started = time.monotonic()
    try:
        assert store_calls.settle(timeout_s=0.5) == 1
        assert time.monotonic() - started < 5
    finally:
        answer.set()
        caller.join(10)


@pytest.mark.timeout(60)
def test_settle_stops_the_heartbeats_first():
    stopped = []

    class Beats:
        def close(self):
            stopped.append(True)

    beats = Beats()
    store_calls.stop_at_exit(beats.close)
    store_calls.settle(timeout_s=0)
    assert stopped == [True]
    del beats  # held weakly: a dropped owner is not called
    store_calls.settle(timeout_s=0)
    assert stopped == [True]
