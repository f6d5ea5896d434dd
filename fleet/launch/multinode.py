"""Several machines: not implemented yet."""

from __future__ import annotations

from pathlib import Path

from fleet.launch.config import LaunchConfig, LaunchError
from fleet.launch.output import OutputMux


def run_multinode(config: LaunchConfig, log_dir: Path, mux: OutputMux) -> int:
    raise LaunchError(
        f"--nnodes {config.nnodes}: multi-node launches are not implemented yet. "
        "Run with --nnodes 1, or start each node's processes with torchrun / mpirun, which fleet also understands."
    )
