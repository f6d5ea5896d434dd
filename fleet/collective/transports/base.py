"""The transport protocol, and the ordered list a job's transport is chosen from.

A transport sums a gradient bucket over the workers. Each one says, from the job's
:class:`Setup`, whether it applies (:meth:`Transport.enabled`); the first enabled entry of
:data:`ORDER` carries the buckets, and the enabled entries after it are its fallbacks, for
the buckets it cannot carry (shared memory takes CPU buckets of uncompressed gradients, the
process group everything else). The last entry applies to every job. A strategy option can
switch a transport off: the transport names that boolean field in :attr:`Transport.option`.

Adding a transport: one module in this package with a class satisfying :class:`Transport`,
and one entry in :data:`ORDER` (which imports it lazily, since the transports import this
module for the protocol).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from fleet.collective.buckets import Bucket
    from fleet.collective.shm import Channel, LocalHost

# First match carries the buckets; the enabled ones after it are its fallbacks. "module:Class", lazily imported.
ORDER: tuple[str, ...] = (
    "fleet.collective.transports.shared_memory:SharedMemoryTransport",
    "fleet.collective.transports.process_group:ProcessGroupTransport",
)


@dataclass
class Setup:
    """What a transport may look at to decide whether it applies, and to start.

    ``options``: the strategy's configuration (any object with attributes); a transport whose
    :attr:`~Transport.option` names a field that is false there is not used.
    """

    group: Any  # the workers' process group; None: one worker, nothing to send
    timeout_s: float
    compression: str = "none"  # fleet.collective.transports.compression's name of the wire dtype
    options: Any = None
    _host: Any = field(default=None, init=False, repr=False)
    _host_probed: bool = field(default=False, init=False, repr=False)

    def allows(self, option: str | None) -> bool:
        return option is None or self.options is None or bool(getattr(self.options, option, True))

    def local_host(self) -> LocalHost | None:
        """The workers' shared memory when they all run on this host; probed once (collective over ``group``)."""
        if not self._host_probed:
            from fleet.collective.shm import LocalHost

            self._host_probed = True
            self._host = LocalHost.connect(self.group, self.timeout_s) if self.group is not None else None
        return self._host


class Transport(Protocol):
    """Sums gradient buckets over the workers (see :mod:`fleet.collective.grad_sync` for the round)."""

    option: ClassVar[str | None]  # the strategy's boolean field that switches this transport off, if any

    @classmethod
    def enabled(cls, setup: Setup) -> bool:
        """Whether this transport applies to the job (every worker must answer alike)."""
        ...

    @classmethod
    def create(cls, setup: Setup, fallback: Transport | None) -> Transport:
        """Start it; ``fallback`` (the next enabled transport) carries the buckets it cannot."""
        ...

    def header_channel(self) -> Channel | None:
        """A faster path than the process group for the lockstep's header exchange, if it has one."""
        ...

    def bind(self, buckets: list[Bucket]) -> None:
        """Give new buckets their buffers; collective over the workers (called where they agree)."""
        ...

    def launch_early(self) -> bool:
        """Whether a bucket should launch as soon as backward has produced its gradients (its summing then
        overlaps the rest of backward), or may wait for the end of backward at no loss."""
        ...

    def launch(self, bucket: Bucket, scale: float, changed: set[int]) -> Any:
        """Gather this worker's gradients into the bucket and start summing it; returns the work to wait for."""
        ...

    def start_empty(self, bucket: Bucket) -> Any:
        """Take part without contributing (a worker shadowing inside fleet.join())."""
        ...

    def wait(self, bucket: Bucket, work: Any, timeout: timedelta) -> None:
        """Wait for :meth:`launch`'s or :meth:`start_empty`'s work; the bucket then holds the sum."""
        ...

    def close(self) -> None: ...


def load(entry: str) -> type[Transport]:
    module, _, name = entry.partition(":")
    return getattr(importlib.import_module(module), name)


def choose(setup: Setup, order: tuple[str, ...] = ORDER) -> Transport:
    """The first enabled transport of ``order``, falling back on the enabled ones after it."""
    enabled = [cls for cls in map(load, order) if setup.allows(cls.option) and cls.enabled(setup)]
    if not enabled:
        raise ValueError(f"no gradient transport applies to this job (tried {', '.join(order)})")
    transport: Transport | None = None
    for cls in reversed(enabled):
        transport = cls.create(setup, transport)
    assert transport is not None
    return transport
