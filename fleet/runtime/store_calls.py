"""Store calls with a deadline.

torch's TCPStore client does not bound a call by its timeout when the store's host stops
answering without closing the connection (a cut link, a host gone, a SIGSTOPped rank 0):
``get``, ``check``, ``add``, ``compare_set`` and ``wait`` then block until TCP itself gives up,
about 15 minutes later, and the client's own lock blocks every later call on it meanwhile
(measured with torch 2.13; only ``set``, which reads no reply, returns). So a call that must
end runs on a helper thread and is abandoned at its deadline: the helper stays blocked, holds
nothing of fleet's, and is a daemon, so it never keeps the process alive.

A daemon thread must not be inside torch's call when the interpreter finalises, though: the call
returns, takes the GIL back in a C++ destructor (pybind11's ``gil_scoped_release``), Python 3.11
ends the thread there with ``pthread_exit``, and its forced unwinding through that ``noexcept``
frame calls ``std::terminate``: "terminate called without an active exception", SIGABRT, exit
134, for a process that had finished its work. So the calls in flight are tracked, and at exit
(:func:`settle`, also registered with :mod:`atexit` when this module is first imported, so that
it runs after fleet's other exit handlers) the threads that issue calls of their own
(:func:`stop_at_exit`: the heartbeats) are stopped and each call still within its deadline is
waited for, at most :data:`EXIT_WAIT_S`. A call past its deadline was abandoned on a store that
stopped answering: it is not waited for (it would delay every exit after a store was lost).
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import TypeVar

from fleet.errors import PeerError

T = TypeVar("T")
EXIT_WAIT_S = 3.0
"""The most a process on its way out waits for its store calls in flight (a live store answers in milliseconds)."""

_guard = threading.Lock()
_in_flight: dict[threading.Thread, float] = {}  # helper -> the monotonic time its caller gives up on it
_stoppers: list[weakref.WeakMethod] = []  # weakly held: an owner the process dropped needs no stopping


class StoreSilentError(PeerError):
    """The rendezvous store did not answer a call within its deadline."""

    def __init__(self, message: str, pending: threading.Thread | None = None):
        super().__init__(message)
        self.pending = pending  # the helper still blocked in the call (join it to learn when the store answers)

    def __reduce__(self):
        return type(self), (str(self),)


def within(call: Callable[[], T], timeout_s: float, where: str) -> T:
    """``call()``'s result, or its exception; StoreSilentError naming ``where`` once ``timeout_s`` passed."""
    box: list = []

    def run() -> None:
        try:
            box.append((True, call()))
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread as it is
            box.append((False, error))
        finally:
            with _guard:  # out of torch's code: from here the thread may end anywhere
                _in_flight.pop(helper, None)

    helper = threading.Thread(target=run, name="fleet-store-call", daemon=True)
    with _guard:
        _in_flight[helper] = time.monotonic() + timeout_s
    try:
        helper.start()
    except BaseException:
        with _guard:
            _in_flight.pop(helper, None)
        raise
    helper.join(timeout_s)
    if not box:
        raise StoreSilentError(f"the rendezvous store at {where} did not answer within {timeout_s:g} s", helper)
    ok, value = box[0]
    if not ok:
        raise value
    return value


def stop_at_exit(stop: Callable[[], None]) -> None:
    """Call the bound method ``stop`` in :func:`settle`, before waiting: it ends a thread that issues store calls
    of its own (a heartbeat), so that none starts after the wait; it must return within about :data:`EXIT_WAIT_S`."""
    with _guard:
        _stoppers[:] = [ref for ref in _stoppers if ref() is not None]
        _stoppers.append(weakref.WeakMethod(stop))  # type: ignore[arg-type]


def settle(timeout_s: float = EXIT_WAIT_S) -> int:
    """Stop the threads that call the store on their own, then wait up to ``timeout_s`` in all for the calls in
    flight that are still within their deadline; the number of calls still in torch's code after it."""
    with _guard:
        stops = [ref() for ref in _stoppers]
    for stop in stops:
        if stop is not None:
            try:
                stop()
            except Exception:  # noqa: BLE001, S112 - on the way out: the next owner must still be stopped
                continue
    end = time.monotonic() + timeout_s
    with _guard:
        waited = [(helper, given_up) for helper, given_up in _in_flight.items() if given_up > time.monotonic()]
    for helper, given_up in waited:
        helper.join(max(0.0, min(end, given_up) - time.monotonic()))
    with _guard:
        return len(_in_flight)


def _forget_after_fork() -> None:
    """A forked child has none of its parent's helpers, and the guard may have been held by one of them."""
    global _guard
    _guard = threading.Lock()
    _in_flight.clear()


atexit.register(settle)  # registered at fleet's import, so it runs after the handlers fleet.init registers
os.register_at_fork(after_in_child=_forget_after_fork)
