"""The server loop's wait for work: ZeroMQ's poll, or one plain ``poll`` system call while only raw sockets are busy.

Why: a small pull on the direct path (:mod:`fleet.ps.server.direct_conns`) costs the server a
wait, a read and a write. Through ``zmq.Poller.poll`` the wait alone was ~10 us of CPU before
blocking (pyzmq builds its item list, libzmq polls every descriptor once without waiting, asks
each ZeroMQ socket for its events -- each a call into its mailbox, a ``poll`` and a ``getpid`` --
then polls again to block, and asks again on waking): measured on 2 cores, ~3.7 ``poll`` and
2.5 ``getpid`` calls per request, the largest part of the server's time around a 16-byte pull.

A ZeroMQ socket's ``FD`` becomes readable whenever something may have changed for it, but only
after its events were last read (it is edge-triggered: a message already waiting makes no new
edge). So once a ZeroMQ poll has found no ZeroMQ socket ready, and the loop has not touched a
ZeroMQ socket since (no receive, no send: :meth:`Waiter.settle` is told), any new message makes
one of those ``FD`` readable. Until then the loop waits in one ``poll`` over the raw descriptors
and the ZeroMQ ``FD``; when a ZeroMQ ``FD`` wakes it, it polls ZeroMQ again (without waiting),
which reads the events properly. Nothing is missed: a message for ZeroMQ either came before the
last ZeroMQ poll (which reported it) or after (its edge wakes the plain poll).
"""

from __future__ import annotations

import select
from typing import Any

import zmq

# plain ints: ZeroMQ's flags are enum members, and their arithmetic costs a call per wake-up
_ZIN, _ZOUT, _ZERR = int(zmq.POLLIN), int(zmq.POLLOUT), int(zmq.POLLERR)
_IN, _OUT = select.POLLIN, select.POLLOUT


def _os_flags(flags: int) -> int:
    return (_IN if flags & _ZIN else 0) | (_OUT if flags & _ZOUT else 0)


class Waiter:
    """A ``zmq.Poller`` (same ``register``/``modify``/``unregister``) that waits in a plain ``poll`` while it may.

    :meth:`poll` answers as ``dict(zmq.Poller.poll(...))`` does: ZeroMQ sockets and raw descriptors
    (ints) mapped to ZeroMQ's event flags.
    """

    def __init__(self) -> None:
        self._zmq = zmq.Poller()
        self._os = select.poll()
        self._zmq_fds: set[int] = set()  # the ZeroMQ sockets' FD: readable when their events may have changed
        #: True while the plain poll may stand for ZeroMQ's (see the module's docstring)
        self.quiet = False
        self.plain_waits = 0  # wake-ups served by the plain poll (for tests and stats)

    def register(self, what: Any, flags: int) -> None:
        self._zmq.register(what, flags)
        if isinstance(what, int):
            self._os.register(what, _os_flags(int(flags)))
        else:
            fd = what.getsockopt(zmq.FD)
            self._zmq_fds.add(fd)
            self._os.register(fd, _IN)
        self.quiet = False

    modify = register

    def unregister(self, what: Any) -> None:
        self._zmq.unregister(what)
        if isinstance(what, int):
            self._os.unregister(what)
        else:
            fd = what.getsockopt(zmq.FD)
            self._zmq_fds.discard(fd)
            self._os.unregister(fd)
        self.quiet = False

    def poll(self, timeout_ms: int) -> dict[Any, int]:
        """Wait up to ``timeout_ms`` for any registered socket; what is ready, as ``dict(zmq.Poller.poll())``."""
        if not self.quiet:
            return dict(self._zmq.poll(timeout_ms))
        got = self._os.poll(timeout_ms)
        ready: dict[Any, int] = {}
        for fd, events in got:
            if fd in self._zmq_fds:  # ZeroMQ may have something: ask it properly (it sees the raw ones too)
                self.quiet = False
                return dict(self._zmq.poll(0))
            ready[fd] = (
                (_ZIN if events & _IN else 0)
                | (_ZOUT if events & _OUT else 0)
                | (_ZERR if events & ~(_IN | _OUT) else 0)
            )
        self.plain_waits += 1
        return ready

    def settle(self, ready: dict[Any, int], touched_zmq: bool) -> None:
        """After the loop acted on ``ready`` (this wait's answer): may the next wait be the plain poll?

        Only when no ZeroMQ socket was in it and the loop received or sent nothing on one since
        (``touched_zmq``): then ZeroMQ's last poll read every socket's events, and a new message
        makes an edge on its ``FD``.
        """
        if touched_zmq:
            self.quiet = False
            return
        for key in ready:
            if type(key) is not int:
                self.quiet = False
                return
        self.quiet = True
