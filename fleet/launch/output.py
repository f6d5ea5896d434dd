"""Log multiplexing: many children's output on one console, each also in its own file.

One reader thread per child reads its merged stdout/stderr a line at a time
(a partial line is held until its newline or the end of the stream), appends
the raw bytes to the child's log file and keeps its last lines for the failure
report. Lines then go through one queue to a single writer thread, the only
thing that prints, so lines from eight processes never interleave mid-line and
the launcher's own messages stay in order with them.

A line that cannot be written to its log file (a full disk) is still shown and kept for
the failure report; :class:`LostWrites` counts it, and fleetrun says at the end what its
log directory is missing.
"""

from __future__ import annotations

import errno
import os
import queue
import threading
from collections import deque
from pathlib import Path
from typing import IO

from rich.console import Console, RenderableType
from rich.text import Text

TAIL_LINES = 20
_PALETTE = (
    "cyan",
    "magenta",
    "green",
    "yellow",
    "blue",
    "bright_cyan",
    "bright_magenta",
    "bright_green",
    "bright_yellow",
    "bright_blue",
)
_STOP = object()
_LAUNCHER_STYLE = "bold"


def style_for(index: int) -> str:
    """A distinct colour for the index-th process."""
    return _PALETTE[index % len(_PALETTE)]


class OutputMux:
    """The one writer to the console. Thread-safe; every call enqueues."""

    def __init__(self, console: Console | None = None, *, max_queued: int = 20_000, batch: int = 512):
        self.console = console or Console(highlight=False, soft_wrap=True)
        self._queue: queue.Queue = queue.Queue(maxsize=max_queued)
        self._batch = batch
        self._width = 0
        self._thread = threading.Thread(target=self._run, name="fleetrun-output", daemon=True)
        self._thread.start()

    def set_label_width(self, width: int) -> None:
        """Pad prefixes to this many characters so the text columns line up."""
        self._width = max(width, len("fleetrun"))

    def prefix(self, label: str) -> str:
        return f"[{label}]".ljust(self._width + 2) + " "

    def line(self, label: str, style: str, text: str) -> None:
        """One line of a child's output (without its newline)."""
        self._queue.put(("line", label, style, text))

    def message(self, text: str, style: str = _LAUNCHER_STYLE) -> None:
        """One of the launcher's own lines, prefixed ``[fleetrun]``."""
        self._queue.put(("line", "fleetrun", style, text))

    def render(self, renderable: RenderableType) -> None:
        """A rich renderable (rule, table) printed as a whole."""
        self._queue.put(("render", renderable))

    def flush(self) -> None:
        """Wait until everything queued so far is on the console."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=10)

    def _format(self, label: str, style: str, text: str) -> Text:
        line = Text()
        line.append(self.prefix(label), style=style)
        body = Text.from_ansi(text) if "\x1b" in text else Text(text)
        line.append_text(body)
        return line

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            items = [item]
            # Drain what is already waiting so a burst is printed in one write.
            while item is not _STOP and item[0] == "line" and len(items) < self._batch:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                items.append(item)
            try:
                self._print(items)
            except Exception:  # noqa: BLE001 - a broken console must not hang the launcher
                pass
            for _ in items:
                self._queue.task_done()
            if any(it is _STOP for it in items):
                return

    def _print(self, items: list) -> None:
        lines: list[Text] = []
        for item in items:
            if item is _STOP:
                continue
            if item[0] == "line":
                lines.append(self._format(*item[1:]))
                continue
            if lines:
                self.console.print(Text("\n").join(lines), soft_wrap=True)
                lines = []
            self.console.print(item[1])
        if lines:
            self.console.print(Text("\n").join(lines), soft_wrap=True)


class _FileLoss:
    """What one log file is missing: lines of this run that did not reach it whole, and why."""

    __slots__ = ("cut", "first", "lines", "opened_at", "total")

    def __init__(self) -> None:
        self.lines = 0  # lines that did not reach the file whole (a line cut short counts)
        self.total = 0  # lines the children sent to it, once their streams closed (0: not known)
        self.first = 0  # number of the first lost line in its child's output (0: not known)
        self.cut: int | None = None  # a line written in part, when one was
        self.opened_at = 0  # bytes the file held from earlier runs when this run first opened it

    def add(self, number: int, cut: bool, opened_at: int) -> None:
        """Line ``number`` (0: not known) did not reach the file whole (``cut``: part of it did)."""
        if not self.lines:
            self.opened_at = opened_at
        self.lines += 1
        if number and not self.first:
            self.first = number
        if cut and self.cut is None:
            self.cut = number


class LostWrites:
    """What fleetrun could not write into its log directory, for the end of the job. Thread-safe.

    A log file is appended to (a ``--log-dir`` used again keeps the earlier runs' lines), so a
    file-size limit or a full disk may cost this run every line while the file still holds an
    earlier run's: the report says how many of this run's lines are missing, from which line,
    which line is in the file only in part, and what the file held before this run.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lines: dict[str, _FileLoss] = {}  # log file -> what it is missing
        self._seen: dict[str, tuple[int, int]] = {}  # log file -> (lines sent to it, bytes it held at first open)
        self._files: list[str] = []  # files that were not written at all
        self.errors: dict[str, str] = {}  # path -> why ("No space left on device")

    def line(self, path: Path | str, error: OSError, number: int = 0, cut: bool = False, opened_at: int = 0) -> None:
        """Line ``number`` (1-based in its child's output; 0: a line of fleetrun's own) did not reach ``path``
        whole (``cut``: part of it did); the file held ``opened_at`` bytes when this run opened it."""
        with self._lock:
            self._lines.setdefault(str(path), _FileLoss()).add(number, cut, opened_at)
            self.errors.setdefault(str(path), error.strerror or str(error))

    def seen(self, path: Path | str, lines: int, opened_at: int = 0) -> None:
        """A child's stream closed after sending ``lines`` lines for ``path`` (opened at ``opened_at`` bytes)."""
        with self._lock:
            total, first_size = self._seen.get(str(path), (0, opened_at))
            self._seen[str(path)] = (total + lines, first_size)

    def file(self, path: Path | str, error: OSError | str) -> None:
        with self._lock:
            self._files.append(str(path))
            self.errors.setdefault(str(path), error if isinstance(error, str) else error.strerror or str(error))

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._lines or self._files)

    def describe(self) -> list[str]:
        """One phrase per lost thing: "852 of 3001 lines of worker.0.log, from line 2150 on (File too large)"."""
        with self._lock:
            lost = [self._describe_lines(path, loss) for path, loss in self._lines.items()]
            return lost + [f"{path} ({self.errors[path]})" for path in self._files]

    def _describe_lines(self, path: str, loss: _FileLoss) -> str:
        total, opened_at = self._seen.get(path, (0, loss.opened_at))
        count = f"{loss.lines} of {total} lines" if total >= loss.lines else f"{loss.lines} lines"
        where = []
        if loss.first and total and loss.lines == total - loss.first + 1:
            where.append(f"from line {loss.first} on" if loss.first > 1 else "every line")
        elif loss.first:
            where.append(f"the first from line {loss.first}")
        if loss.cut is not None:
            where.append(f"line {loss.cut} is in the file only in part")
        if opened_at:
            where.append(f"the file already held {opened_at} bytes from an earlier run when this one began")
        details = f", {'; '.join(where)}" if where else ""
        return f"{count} of {path}{details} ({self.errors[path]})"


class ProcessOutput:
    """Reads one child's output stream until it closes."""

    def __init__(
        self,
        mux: OutputMux,
        label: str,
        style: str,
        log_path: Path,
        stream: IO[bytes],
        lost: LostWrites | None = None,
    ):
        self.mux = mux
        self.label = label
        self.style = style
        self.log_path = log_path
        self.lost = lost if lost is not None else LostWrites()
        self._stream = stream
        self._tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"fleetrun-read-{label}", daemon=True)

    def start(self) -> ProcessOutput:
        self._thread.start()
        return self

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the end of the stream; False if it is still open (a grandchild holds it)."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def tail(self) -> list[str]:
        with self._lock:
            return list(self._tail)

    def _run(self) -> None:
        opened_at = number = 0
        try:
            log: IO[bytes] | None = open(self.log_path, "ab", buffering=0)  # noqa: SIM115 - closed below
            opened_at = os.fstat(log.fileno()).st_size  # an earlier run's lines (the same --log-dir)
        except OSError as error:  # the child's output must still be read, or it blocks on a full pipe
            log, opened = None, error
        else:
            opened = None
        try:
            for raw in iter(self._stream.readline, b""):
                number += 1
                if log is None:
                    self.lost.line(self.log_path, opened, number, opened_at=opened_at)
                else:
                    written, error = _write_all(log, raw)
                    if error is not None:
                        self.lost.line(self.log_path, error, number, cut=written > 0, opened_at=opened_at)
                text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                with self._lock:
                    self._tail.append(text)
                self.mux.line(self.label, self.style, text)
        finally:
            self.lost.seen(self.log_path, number, opened_at)
            for closable in (log, self._stream):
                try:
                    if closable is not None:
                        closable.close()
                except OSError:
                    pass


def _write_all(log: IO[bytes], data: bytes) -> tuple[int, OSError | None]:
    """Write ``data``: (bytes written, None), or (bytes written before it failed, why).

    An unbuffered write may take only part of a line on a nearly full disk or at a file-size limit:
    the rest raises, or is written.
    """
    view, done = memoryview(data), 0
    while view:
        try:
            written = log.write(view)
        except OSError as error:
            return done, error
        if not written:
            return done, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view, done = view[written:], done + written
    return done, None
