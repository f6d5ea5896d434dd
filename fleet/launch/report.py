"""What fleetrun tells the user about exits: status wording, failure block, summary table."""

from __future__ import annotations

import signal
from dataclasses import dataclass

from rich.console import Group, RenderableType
from rich.rule import Rule
from rich.table import Table
from rich.text import Text


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_code(returncode: int) -> int:
    """A Popen return code as a shell exit status: 128+N for a death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def describe(returncode: int) -> str:
    """Say "exit status 1" or "killed by SIGKILL (exit status 137)"."""
    if returncode < 0:
        return f"killed by {signal_name(-returncode)} (exit status {exit_code(returncode)})"
    if returncode > 128 and returncode - 128 < signal.NSIG:
        return f"exit status {returncode} ({signal_name(returncode - 128)}?)"
    return f"exit status {returncode}"


@dataclass
class Row:
    """One line of the summary table."""

    role: str
    rank: int
    returncode: int | None  # None: never ended (should not happen after stop)
    stopped: bool  # ended because fleetrun stopped it
    run_time: float
    restarts: int


def failure_block(label: str, returncode: int, tail: list[str], style: str, log_path: str) -> RenderableType:
    """Header naming the failed process, then its last lines."""
    header = Rule(Text(f" {label} failed: {describe(returncode)} ", style="bold red"), style="red")
    lines = [header]
    if tail:
        lines.append(Text(f"last {len(tail)} lines of {label} (full log: {log_path}):", style="red"))
        for text in tail:
            line = Text(f"[{label}] ", style=style)
            line.append(text)
            lines.append(line)
    else:
        lines.append(Text(f"{label} printed nothing (log: {log_path}).", style="red"))
    lines.append(Rule(style="red"))
    return Group(*lines)


def _status_cell(row: Row) -> Text:
    if row.returncode is None:
        return Text("running?", style="yellow")
    if row.stopped:
        if row.returncode < 0:
            return Text(f"stopped ({signal_name(-row.returncode)})", style="yellow")
        return Text(f"stopped (exit {row.returncode})", style="yellow")
    if row.returncode == 0:
        return Text("0", style="green")
    if row.returncode < 0:
        return Text(f"{signal_name(-row.returncode)} ({exit_code(row.returncode)})", style="bold red")
    return Text(str(row.returncode), style="bold red")


def summary_table(rows: list[Row], title: str) -> Table:
    table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    table.add_column("role")
    table.add_column("rank", justify="right")
    table.add_column("exit status")
    table.add_column("run time", justify="right")
    table.add_column("restarts", justify="right")
    for row in rows:
        table.add_row(row.role, str(row.rank), _status_cell(row), f"{row.run_time:.1f} s", str(row.restarts))
    return table
