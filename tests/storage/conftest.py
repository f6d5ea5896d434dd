import pytest

from one_process_job import started


@pytest.fixture
def trained(monkeypatch):
    """A one-process job: a model and its wrapped optimizer, stepped once (tests/one_process_job.py)."""
    yield from started(monkeypatch)
