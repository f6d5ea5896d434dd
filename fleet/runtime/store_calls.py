"""Store calls with a deadline.

torch's TCPStore client does not bound a call by its timeout when the store's host stops
answering without closing the connection (a cut link, a host gone, a SIGSTOPped rank 0):
``get``, ``check``, ``add``, ``compare_set`` and ``wait`` then block until TCP itself gives up,
about 15 minutes later, and the client's own lock blocks every later call on it meanwhile
(measured with torch 2.13; only ``set``, which reads no reply, returns). So a call that must
end runs on a helper thread and is abandoned at its deadline: the helper stays blocked, holds
nothing of fleet's, and is a daemon, so it never keeps the process alive.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from fleet.errors import PeerError

T = TypeVar("T")


class StoreSilentError(PeerError):
    """The rendezvous store did not answer a call within its deadline."""

    def __init__(self, message: str, pending: threading.Thread | None = None):
        super().__init__(message)
        self.pending = pending  # the helper still blocked in the call (join it to learn when the store answers)

    def __reduce__(self):
        return type(self), (str(self),)


def within(call: Callable[[], T], timeout_s: float, where: str) -> T:
    """``call()``'s result, or its exception; StoreSilentError naming ``where`` once ``timeout_s`` passed."""
    box: list = []

    def run() -> None:
        try:
            box.append((True, call()))
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread as it is
            box.append((False, error))

    helper = threading.Thread(target=run, name="fleet-store-call", daemon=True)
    helper.start()
    helper.join(timeout_s)
    if not box:
        raise StoreSilentError(f"the rendezvous store at {where} did not answer within {timeout_s:g} s", helper)
    ok, value = box[0]
    if not ok:
        raise value
    return value
