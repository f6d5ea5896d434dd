import os
import sys

# Tests import helpers from tests/ (dist_harness) and keep runs on one thread per process:
# the machine has 2 cores and multi-process tests start several interpreters at once.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config) -> None:
    # tests/launch/test_slurm.py: a real one-node Slurm cluster (skipped, with the reason, without slurm-wlm)
    config.addinivalue_line("markers", "slurm: starts a one-node Slurm controller and daemon on this machine")
