"""How busy the host was with other work while something of ours ran: the background the model needs.

A calibration taken on a shared host measures a slower computation than the same host gives
when idle, and a measurement at another time sees another load. The 1-minute load average is
too slow and counts our own processes (and the tails of earlier ones), so :class:`CpuMeter`
measures instead, over exactly the interval of interest: the busy CPU time of the whole host
(``/proc/stat``) minus the CPU time of our own children (their rusage, once they were waited
for). Turned into a *demand* for the model's processor sharing: when the host was saturated,
the others got a share in proportion to their demand, so demand = our demand x their CPU / ours;
otherwise it is their CPU. Without ``/proc/stat`` (not Linux) it falls back to the load average
minus our own demand.
"""

from __future__ import annotations

import os
import resource
import time


def _busy_s() -> float | None:
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _children_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class CpuMeter:
    """``with CpuMeter() as m: run children``; then ``m.background(our demand)``: busy processes not ours."""

    def __enter__(self) -> CpuMeter:
        self.t0, self.busy0, self.own0 = time.monotonic(), _busy_s(), _children_s()
        self.load_before = os.getloadavg()[0]
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = max(1e-9, time.monotonic() - self.t0)
        self.load_after = os.getloadavg()[0]
        busy_now = _busy_s()
        self.measured = busy_now is not None and self.busy0 is not None
        self.busy = (busy_now - self.busy0) / self.wall if self.measured else 0.0
        self.own = (_children_s() - self.own0) / self.wall
        self.others = max(0.0, self.busy - self.own)

    def background(self, own_demand: float) -> float:
        """Other busy processes, as a demand comparable to ``own_demand`` (our processes' threads)."""
        if not self.measured:
            return max(0.0, (self.load_before + self.load_after) / 2 - own_demand)
        saturated = self.busy >= 0.9 * (os.cpu_count() or 1) and self.own > 0
        return own_demand * self.others / self.own if saturated else self.others


def memory_bytes() -> float | None:
    """This host's memory (``MemTotal`` of ``/proc/meminfo``); None where that cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
