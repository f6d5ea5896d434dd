"""fleet.plan: a measured cost model of fleet's modes, from 1 to 1,024 workers (``fleetrun --plan``).

- :mod:`fleet.plan.lognormal`: log-normal step times and the order statistics a sync step waits for
- :mod:`fleet.plan.calibration`: the measured parameters (:class:`Calibration`) and their fits
- :mod:`fleet.plan.probe`: times the user's script as one worker (a fleetrun script)
- :mod:`fleet.plan.measure`: all-reduce, parameter-server transport and server apply rates (a fleetrun script)
- :mod:`fleet.plan.model`: closed-form step time, samples/s and speed-up per mode
- :mod:`fleet.plan.placement`: where the tables and the dense layers should live (replicated, sharded, servers)
- :mod:`fleet.plan.simulation`: a discrete-event simulation of sync, backup workers and async
- :mod:`fleet.plan.planner`: ``fleetrun --plan``: calibrate, predict, recommend

Nothing here imports torch except the two fleetrun scripts, which run in their own processes.
See docs/scaling.md.
"""

from pathlib import Path

__all__ = ["measure_path", "probe_path"]


def probe_path() -> Path:
    """The probe script fleetrun runs for the calibration (a file: fleetrun starts scripts)."""
    return Path(__file__).resolve().parent / "probe.py"


def measure_path() -> Path:
    """The transport micro-benchmark script (run it on two hosts to measure a network)."""
    return Path(__file__).resolve().parent / "measure.py"
