"""The update modes drive the client and the worker through declared protocols (fleet.ps.modes.contracts), and the
row backends declare their batching and prefetch (fleet.sparse.backends): the classes that stand behind them offer
every call with the same parameters, so a protocol cannot drift from the class it describes."""

from __future__ import annotations

import inspect
from concurrent.futures import Future

import pytest
import torch

from fleet.ps.client.client import PSClient
from fleet.ps.modes import contracts
from fleet.ps.modes.rows import GeoRows, RemoteRows
from fleet.ps.worker.dense_tables import DenseTables, GroupTable
from fleet.sparse.backends import BatchedRows, PrefetchedRows


def _calls(protocol: type) -> list[str]:
    return sorted(name for name, value in vars(protocol).items() if inspect.isfunction(value) and name[0] != "_")


def _parameters(fn) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize(
    ("protocol", "cls"),
    [(contracts.ServerCalls, PSClient), (contracts.DenseTables, DenseTables), (contracts.DenseEntry, GroupTable)],
    ids=["ServerCalls-PSClient", "DenseTables", "DenseEntry-GroupTable"],
)
def test_each_declared_call_is_offered_with_the_same_parameters(protocol, cls):
    calls = _calls(protocol)
    assert calls, protocol
    for name in calls:
        assert hasattr(cls, name), f"{cls.__name__} lacks {name}, which {protocol.__name__} declares"
        assert _parameters(getattr(cls, name)) == _parameters(getattr(protocol, name)), (cls.__name__, name)
    for name in ("lr", "entries"):  # read-only properties of the protocols
        if name in vars(protocol):
            assert name in vars(cls) or name in inspect.getsource(cls.__init__), (cls.__name__, name)


def test_the_declared_attributes_are_set_by_the_classes():
    sources = {
        contracts.ServerCalls: inspect.getsource(PSClient.__init__),
        contracts.DenseEntry: inspect.getsource(GroupTable.__init__),
    }
    for protocol, source in sources.items():
        for name in protocol.__annotations__:
            assert f"self.{name} =" in source, f"{protocol.__name__}.{name} is never set"


class _Client:
    """A stand-in with the calls remote rows make when prefetching (a resolved future of the rows)."""

    num_servers = 1

    def pull_sparse(self, table_id: int, ids: torch.Tensor, min_version: int = 0) -> Future:
        future: Future = Future()
        future.set_result(torch.zeros(ids.numel(), 2))
        return future


def test_remote_rows_declare_batching_and_prefetch_and_geo_rows_pull_alone():
    rows = RemoteRows(_Client(), 3, sync=False)
    assert isinstance(rows, BatchedRows) and isinstance(rows, PrefetchedRows)
    future = rows.prefetch(torch.tensor([1, 2]))
    assert future is not None and rows.collect(future).shape == (2, 2)
    assert RemoteRows(_Client(), 3, sync=True).prefetch(torch.tensor([1])) is None  # a sync step's rows are fresh
    assert not issubclass(GeoRows, BatchedRows)
    assert not hasattr(GeoRows, "batch_key")
