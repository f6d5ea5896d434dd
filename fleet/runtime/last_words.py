"""A worker's last words: the error it ends with, left where its peers look when they find it gone.

Why: a peer that finds a worker's process gone could only say "worker 1 died". When that worker
ended on an exception of its own (a bug in its backward, a wait it gave up on), that exception is
the cause, and it was in that worker's output only; the peer's error, often the one a user (or a
test harness reporting the first failure) reads, sent them looking for a crash that never was.
So a process that ends on an error says it here first, in one line (``RuntimeError: ...``), and
each place peers look for a gone worker keeps it: the workers' shared memory on one host
(:class:`fleet.collective.shm.LocalHost` listens).

Who says it: fleet's ``sys.excepthook`` (a script that ends on an uncaught exception,
:mod:`fleet.runtime.excepthook`); a launcher that runs a worker as a function and catches its
exception itself (tests/dist_harness.py) calls :func:`say`. A death by a signal says nothing; a
peer names the signal where the kernel still shows it (:func:`fleet.runtime.job_files.exit_status`).

Only text crosses: a peer reads at most :data:`MAX_BYTES` of UTF-8, never an object.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

MAX_BYTES = 400


def summary(error: BaseException) -> str:
    """``Type: the first line of its message``, at most :data:`MAX_BYTES` of UTF-8."""
    text = str(error).strip()
    line = f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__
    return clip(line)


def clip(text: str) -> str:
    """One printable line of at most :data:`MAX_BYTES` UTF-8 bytes (what a peer may show)."""
    line = "".join(c if c.isprintable() else " " for c in text)
    return line.encode()[:MAX_BYTES].decode(errors="ignore")


# Weakly held: a listener (a job's shared memory) that the job dropped stops listening.
_listeners: list[weakref.WeakMethod] = []


def listen(method: Callable[[str], None]) -> None:
    """Call the bound ``method`` with this process's last words when it says them (:func:`say`)."""
    _listeners[:] = [ref for ref in _listeners if ref() is not None]
    _listeners.append(weakref.WeakMethod(method))  # type: ignore[arg-type]


def say(error: BaseException) -> None:
    """This process ends on ``error``: tell every listener. Never raises (it runs on the way out)."""
    words = summary(error)
    for ref in list(_listeners):
        method = ref()
        if method is None:
            continue
        try:
            method(words)
        except Exception:  # noqa: BLE001, S112 - the process is ending on another error: that one is reported
            continue
