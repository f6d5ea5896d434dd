"""fleetrun: start, watch and stop a fleet job's processes.

Run ``fleetrun --help`` (or ``python -m fleet.launch --help``). The launcher
never imports the training side (no torch): it talks to the processes it
starts only through the environment variables named in :mod:`fleet.runtime.env`.

Modules: ``cli`` (command line), ``config`` (checks), ``plan`` (processes and
their environment), ``ports`` (free ports), ``supervisor`` (start, watch,
restart, stop), ``output`` (log multiplexing), ``report`` (failure block and
summary table), ``multinode`` (the launchers' rendezvous across machines),
``control`` (their signed messages).
"""

from fleet.launch.cli import main

__all__ = ["main"]
