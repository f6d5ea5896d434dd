"""fleet.progress: a progress display on the first worker, nothing elsewhere.

- On worker 0 with stdout a terminal: a live rich progress bar.
- On worker 0 with stdout not a terminal (under fleetrun, whose output is piped, or
  redirected to a file): a plain line at most every ``every_s`` seconds and one at the
  end, e.g. ``train: 120/1000 (12%), 35.2 it/s, eta 25 s``, because a live bar in a
  log file is a wall of control codes.
- On every other worker: the iterable itself, untouched (no wrapper, no cost).

The worker index comes from ``fleet.init``'s context if it ran, else from the
launcher's variables (fleetrun, Paddle, torchrun, MPI, Slurm), so ``progress`` may be
called before ``fleet.init``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO, TypeVar

from fleet.telemetry.timing import worker_identity

T = TypeVar("T")


def progress(
    iterable: Iterable[T],
    total: int | None = None,
    description: str = "working",
    *,
    every_s: float = 10.0,
    stream: IO[str] | None = None,
) -> Iterable[T]:
    """Iterate ``iterable`` showing progress on the first worker only.

    ``total`` defaults to ``len(iterable)`` when it has one. ``every_s``: seconds between
    plain lines when the output is not a terminal. ``stream``: where to write (stdout).
    """
    if worker_identity()[0] != 0:
        return iterable
    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    stream = stream if stream is not None else sys.stdout
    if _isatty(stream):
        return _bar(iterable, total, description, stream)
    return _lines(iterable, total, description, every_s, stream)


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _bar(iterable: Iterable[T], total: int | None, description: str, stream: IO[str]) -> Iterator[T]:
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(file=stream)) as bar:
        task = bar.add_task(description, total=total)
        for item in iterable:
            yield item
            bar.advance(task)


def _line(description: str, done: int, total: int | None, elapsed: float) -> str:
    rate = done / elapsed if elapsed > 0 else 0.0
    text = f"{description}: {done}"
    if total:
        text += f"/{total} ({100 * done // total}%)"
    text += f", {rate:.1f} it/s"
    if total and rate > 0 and done < total:
        text += f", eta {(total - done) / rate:.0f} s"
    return text


def _lines(iterable: Iterable[T], total: int | None, description: str, every_s: float, stream: IO[str]) -> Iterator[T]:
    started = last = time.monotonic()
    done = 0
    for item in iterable:
        yield item
        done += 1
        now = time.monotonic()
        if now - last >= every_s:
            last = now
            print(_line(description, done, total, now - started), file=stream, flush=True)
    print(_line(description, done, total, time.monotonic() - started) + " done", file=stream, flush=True)
