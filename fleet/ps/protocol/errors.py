"""Exceptions of the parameter-server engine.

Every exception that reaches a worker names the server (index and endpoint)
and the operation, because on a job with several servers the traceback alone
does not say which process to look at, and the launcher turns the message into
the job's exit reason.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from fleet.errors import FleetError, PeerError


class PSError(FleetError):
    """Base class of every parameter-server failure."""


class WireError(ValueError):
    """A frame sequence that does not follow the wire format.

    ``request_id`` is the id read from the header when the header was intact
    enough to read it, so the receiver can still address an error reply.
    """

    def __init__(self, message: str, request_id: int = 0, op: int = 0):
        super().__init__(message)
        self.request_id = request_id
        self.op = op


class ShardError(ValueError):
    """A request that does not fit a server's table shard (wrong mode, step, shape): sent back as an error reply.

    ``details``: machine-readable facts for the worker (a ``code`` and its fields), sent with the
    message so that the worker can explain the error in its own terms (parameter names).
    """

    def __init__(self, message: str, details: dict | None = None):
        super().__init__(message)
        self.details = details or {}


class PSServerUnavailable(PSError, PeerError):
    """A server did not answer within the deadline, or its connection was lost (a dead peer)."""

    def __init__(self, message: str, server_index: int, endpoint: str, op: str):
        super().__init__(message)
        self.server_index = server_index
        self.endpoint = endpoint
        self.op = op


class PSAuthError(PSServerUnavailable):
    """A server refused this worker's credentials (the shared secret differs)."""


class PSRemoteError(PSError):
    """A server answered a request with an error (bad shape, unknown table, ...).

    ``details``: what the server said in machine-readable form (a ``code`` and its fields),
    for errors the worker explains in its own terms; empty for plain-text errors.
    """

    def __init__(self, server_index: int, endpoint: str, op: str, message: str, details: dict | None = None):
        super().__init__(f"parameter server {server_index} at {endpoint} rejected {op}: {message}")
        self.server_index = server_index
        self.endpoint = endpoint
        self.op = op
        self.remote_message = message
        self.details = details or {}


UNNAMED_TABLES = (
    "tables are numbered in the order the workers create them; to see their module names, give the model to "
    "fleet.distributed_model(model) before fleet.distributed_optimizer"
)
_TABLE = re.compile(r"\btable (\d+)\b")


def name_tables(message: str, names: Mapping[int, str]) -> str:
    """A server's ``message`` with each ``table N`` it mentions named as this worker's model names it.

    ``names``: table id -> the module's path in the model (``emb_l.3``) or a dense table in words.
    A name the message already holds (a conflicting create names both sides) is not repeated; a
    table without a name gets a hint on how to have it named.
    """
    unnamed = False

    def named(match: re.Match) -> str:
        nonlocal unnamed
        name = names.get(int(match.group(1)))
        if name is None:
            unnamed = True
            return match.group(0)
        return match.group(0) if repr(name) in message else f"{match.group(0)} ({name!r} in this worker's model)"

    out = _TABLE.sub(named, message)
    return f"{out} ({UNNAMED_TABLES})" if unnamed and not names else out


def parse_error_reply(text: str) -> tuple[str, dict]:
    """An error reply's blob: plain text, or a JSON object with ``message`` and the details."""
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except ValueError:
            return text, {}
        if isinstance(data, dict) and isinstance(data.get("message"), str):
            return data.pop("message"), data
    return text, {}


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation failure: Python's MemoryError, or torch's (a RuntimeError on CPU)."""
    if isinstance(exc, MemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "can't allocate memory" in text or "out of memory" in text.lower() or "not enough memory" in text
    )


class PSClientClosed(PSError):
    """The client was closed (or its IO thread died) before the request finished."""
