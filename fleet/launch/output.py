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


class LostWrites:
    """What fleetrun could not write into its log directory, for the end of the job. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lines: dict[str, int] = {}  # log file -> lines missing from it
        self._files: list[str] = []  # files that were not written at all
        self.errors: dict[str, str] = {}  # path -> why ("No space left on device")

    def line(self, path: Path | str, error: OSError) -> None:
        with self._lock:
            self._lines[str(path)] = self._lines.get(str(path), 0) + 1
            self.errors.setdefault(str(path), error.strerror or str(error))

    def file(self, path: Path | str, error: OSError | str) -> None:
        with self._lock:
            self._files.append(str(path))
            self.errors.setdefault(str(path), error if isinstance(error, str) else error.strerror or str(error))

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._lines or self._files)

    def describe(self) -> list[str]:
        """One phrase per lost thing: "1234 lines of worker.0.log (No space left on device)"."""
        with self._lock:
            lost = [f"{n} lines of {path} ({self.errors[path]})" for path, n in self._lines.items()]
            return lost + [f"{path} ({self.errors[path]})" for path in self._files]


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
        try:
            log: IO[bytes] | None = open(self.log_path, "ab", buffering=0)  # noqa: SIM115 - closed below
        except OSError as error:  # the child's output must still be read, or it blocks on a full pipe
            log, opened = None, error
        else:
            opened = None
        try:
            for raw in iter(self._stream.readline, b""):
                if log is None:
                    self.lost.line(self.log_path, opened)
                else:
                    try:
                        _write_all(log, raw)
                    except OSError as error:
                        self.lost.line(self.log_path, error)
                text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                with self._lock:
                    self._tail.append(text)
                self.mux.line(self.label, self.style, text)
        finally:
            for closable in (log, self._stream):
                try:
                    if closable is not None:
                        closable.close()
                except OSError:
                    pass


def _write_all(log: IO[bytes], data: bytes) -> None:
    """An unbuffered write may take only part of a line on a nearly full disk: the rest raises, or is written."""
    view = memoryview(data)
    while view:
        written = log.write(view)
        if not written:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[written:]
