"""How a parameter server answers: replies, error replies, parked requests and the text of a failure.

The server owns its sockets and counters; :class:`Replies` builds what goes back to a worker and
hands it to the server's ``send``. The request handlers (:class:`~fleet.ps.server.table_ops.TableRequests`,
:class:`~fleet.ps.server.reduce.Reductions`, the loop) get the one instance through their
constructors, so none of them reaches into the server. A request that fails inside a table -- out
of memory included -- gets an error naming the server, the table and the cause, and the server
keeps serving.
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from collections.abc import Callable, MutableMapping
from typing import Any

from fleet.errors import DiskFullError
from fleet.ps.protocol.errors import is_out_of_memory
from fleet.ps.protocol.wire import Message, Status
from fleet.ps.server.waitlist import Parked

log = logging.getLogger(__name__)


class Replies:
    """Build a reply, send it, send an error, park a request, explain a failure (for server ``server_index``).

    ``send(ident, reply)``: the server's way out; ``counts``: the server's counters (``errors``,
    ``disk_full``, ``out_of_memory`` are added to here); ``timeout_s``: how long a parked request
    waits when its sender gave no deadline.
    """

    def __init__(
        self,
        server_index: int,
        timeout_s: float,
        counts: MutableMapping[str, int],
        send: Callable[[Any, Message], None],
    ):
        self.server_index = server_index
        self.timeout_s = timeout_s
        self.send = send
        self._counts = counts

    def ok(self, msg: Message, *, tensors=None, blob: bytes = b"", version: int = 0, status=Status.OK) -> Message:
        return Message(
            op=msg.op,
            table=msg.table,
            peer=self.server_index,
            request_id=msg.request_id,
            step=msg.step,
            arg=version,
            status=status,
            tensors=list(tensors or ()),
            blob=blob,
        )

    def error(self, msg: Message, text: str, details: dict[str, Any] | None = None) -> Message:
        """An error reply: the text, or with ``details`` a JSON object (see :func:`fleet.ps.protocol.errors.parse_error_reply`)."""
        self._counts["errors"] += 1
        blob = json.dumps({"message": text, **details}) if details else text
        return self.ok(msg, blob=blob.encode("utf-8", errors="replace"), status=Status.ERROR)

    def reply_error(self, ident: Any, msg: Message, text: str, details: dict[str, Any] | None = None) -> None:
        self.send(ident, self.error(msg, text, details))

    def deadline(self, msg: Message, now: float) -> float:
        """When a parked request gets its timeout error: a little before the sender gives up."""
        budget = msg.timeout_ms / 1000 if msg.timeout_ms > 0 else self.timeout_s
        return now + budget - min(0.25, 0.1 * budget)

    def park(self, ident: Any, msg: Message) -> Parked:
        now = time.monotonic()
        return Parked(ident, msg, self.deadline(msg, now), now)

    def failure(self, exc: BaseException, what: str, table: int | None) -> str:
        """The error text for an unexpected failure; logged (with the traceback unless out of memory)."""
        where = f"{what} of table {table}" if table is not None else what
        if isinstance(exc, DiskFullError):  # the user's disk, not a bug: its message names the path, no traceback
            log.error("parameter server %d could not finish %s: %s", self.server_index, where, exc)
            self._counts["disk_full"] += 1
            return f"parameter server {self.server_index}: {exc}"
        if is_out_of_memory(exc):
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            log.error("parameter server %d ran out of memory in %s: %s", self.server_index, where, first)
            self._counts["out_of_memory"] += 1
            return (
                f"parameter server {self.server_index} ran out of memory in {where} ({first}); the table is as "
                "it was before and the server keeps serving. Free memory on its host, spread the tables over "
                "more servers, or bound the sparse tables' rows (max_rows, ttl_steps)"
            )
        log.error("parameter server %d failed on %s:\n%s", self.server_index, where, traceback.format_exc())
        return f"internal error in {where} on parameter server {self.server_index}: {type(exc).__name__}: {exc}"
