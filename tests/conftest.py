import os
import sys

import pytest

# Tests import helpers from tests/ (dist_harness) and keep runs on one thread per process:
# the machine has 2 cores and multi-process tests start several interpreters at once.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config) -> None:
    # tests/launch/test_slurm.py: a real one-node Slurm cluster (skipped, with the reason, without slurm-wlm)
    config.addinivalue_line("markers", "slurm: starts a one-node Slurm controller and daemon on this machine")
    # Every torch.optim optimizer imports torch._dynamo on first use (1-2 s idle, over 60 s at load 15-20 on 2
    # cores): import it here, outside any test's timeout, so the first test of a file that builds a reference
    # optimizer does not pay it inside its bound (a test_collective timeout at load 13-20, issue 34's proof runs).
    import torch._dynamo  # noqa: F401


@pytest.fixture
def fresh_fleet():
    """A test that calls fleet.init() in this process starts, and leaves, with no fleet job set up."""
    import fleet.api

    fleet.api._reset_for_tests()
    yield
    fleet.api._reset_for_tests()


@pytest.fixture
def hosts():
    """Two emulated hosts (tests/hosts.py), removed afterwards; skipped, with the reason, where namespaces cannot be
    made. tests/launch/test_host_failures.py has its own, which also checks what the teardown left."""
    from hosts import EmulatedHosts, unavailable

    reason = unavailable()
    if reason:
        pytest.skip(reason)
    with EmulatedHosts() as emulated:
        yield emulated


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's standalone S3 server (tests/s3_server.py), one per test process; skipped, with the reason, without
    the test extra's fsspec, s3fs and moto[server]."""
    for module in ("fsspec", "s3fs", "moto.server"):
        pytest.importorskip(module, reason=f"{module} is in the test extra: pip install -e '.[test]'")
    from s3_server import moto_server

    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture
def bucket(s3_endpoint):
    """An empty bucket on the test S3 server (``s3://fleet-<hex>``), fsspec in this process pointed at it."""
    import fsspec.config

    from s3_server import configure, new_bucket

    before = dict(fsspec.config.conf)
    configure(s3_endpoint)
    try:
        yield new_bucket()
    finally:
        fsspec.config.conf.clear()
        fsspec.config.conf.update(before)
