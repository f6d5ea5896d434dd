"""How a parameter server answers, handed to the objects that serve its requests.

The server owns its socket, counters and reply format; :class:`Replies` gives its request
handlers (:class:`~fleet.ps.server.table_ops.TableRequests`,
:class:`~fleet.ps.server.reduce.Reductions`) the five things they do with them, through their
constructors, so none of them reaches into the server.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fleet.ps.protocol.wire import Message
from fleet.ps.server.waitlist import Parked


@dataclass(frozen=True)
class Replies:
    """Build a reply, send it, send an error, park a request, explain a failure."""

    ok: Callable[..., Message]
    send: Callable[[bytes, Message], None]
    reply_error: Callable[..., None]
    park: Callable[[bytes, Message], Parked]
    failure: Callable[[BaseException, str, int | None], str]
