"""The collective transports: a declared protocol, chosen from an ordered list (fleet/collective/transports/)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import ClassVar

import pytest

from fleet.collective import transports
from fleet.collective.transports import base
from fleet.collective.transports.process_group import ProcessGroupTransport
from fleet.collective.transports.shared_memory import SharedMemoryTransport

PROTOCOL = ("enabled", "create", "header_channel", "bind", "launch", "start_empty", "wait", "close")


def test_the_order_is_shared_memory_then_the_process_group():
    assert [base.load(entry) for entry in transports.ORDER] == [SharedMemoryTransport, ProcessGroupTransport]
    for cls in map(base.load, transports.ORDER):
        assert all(callable(getattr(cls, name, None)) for name in PROTOCOL), cls
        assert hasattr(cls, "option")


def test_one_worker_gets_the_process_group_without_probing_shared_memory():
    setup = transports.Setup(None, timeout_s=5)
    transport = transports.choose(setup)
    assert isinstance(transport, ProcessGroupTransport) and transport.group is None
    assert transport.header_channel() is None


def test_an_option_set_false_switches_its_transport_off():
    probed = []

    class Probed(transports.Setup):
        def local_host(self):
            probed.append(True)
            return None

    setup = Probed("group", timeout_s=5, options=SimpleNamespace(shared_memory=False))
    assert not setup.allows("shared_memory") and setup.allows(None)
    assert isinstance(transports.choose(setup), ProcessGroupTransport)
    assert probed == []  # switched off: not even asked whether the workers share a host


class _Fake:
    """A transport that is one class and one entry of the order."""

    option: ClassVar[str | None] = "fake_transport"

    def __init__(self, fallback):
        self.fallback = fallback

    @classmethod
    def enabled(cls, setup):
        return True

    @classmethod
    def create(cls, setup, fallback):
        return cls(fallback)


def test_a_new_transport_is_one_entry_and_falls_back_on_the_enabled_ones_after_it():
    order = (f"{__name__}:_Fake", *transports.ORDER)
    chosen = transports.choose(transports.Setup(None, timeout_s=5), order)
    assert isinstance(chosen, _Fake) and isinstance(chosen.fallback, ProcessGroupTransport)
    off = transports.Setup(None, timeout_s=5, options=SimpleNamespace(fake_transport=False))
    assert isinstance(transports.choose(off, order), ProcessGroupTransport)
    with pytest.raises(ValueError, match="no gradient transport applies"):
        transports.choose(off, (f"{__name__}:_Fake",))
