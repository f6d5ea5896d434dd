"""Worker 0's side of ``save_persistables`` and ``load_persistables``.

A save (:func:`save_servers`): a new ``save-<n>`` (:mod:`fleet.storage.persist`), every server
writes its shards there and answers with each file's checksum, worker 0 adds its file, then
commits: ``checksums.json`` lists every file, ``latest`` moves. Any failure (a full disk, a
server that refuses, dies or does not answer within ``timeout_s``) removes the unfinished save
and names the save and the server; the save before it stays the one that loads.

A load (:func:`load_servers`): every server checks the save before any server applies it.

Two phases over every server (``LOAD`` with :data:`~fleet.ps.protocol.wire.LOAD_STAGE`, then
``LOAD_COMMIT``): each server reads every file of its part of the save and of the saves it
builds on, checks them against the save's checksums, and loads them into tables built aside
(:mod:`fleet.ps.server.staged_load`); only when every server has done so does any of them swap
its tables. A server that refuses (a damaged file, a table that does not match) or does not
answer within the strategy's ``timeout_s`` makes every server discard what it staged: no table
changed anywhere, and the error says so, naming the server and the file.

What remains: the commit itself is a swap that cannot fail on a server that staged, but a
server can die (or stop answering) between the two phases. Then the servers that answered the
commit hold the save and that one holds whatever it held (nothing, once restarted): the error
says which, and loading the save again puts every server on it.
"""

from __future__ import annotations

from typing import Any

from fleet.errors import DiskFullError, FleetError
from fleet.ps.protocol.errors import PSError, PSRemoteError
from fleet.ps.protocol.wire import LOAD_COMMIT, LOAD_DISCARD, LOAD_STAGE
from fleet.storage import persist

__all__ = ["WORKER_FILE", "load_servers", "save_servers"]

WORKER_FILE = "worker-0.pt"
"""Worker 0's part of a save: its optimizers' states."""


def save_servers(
    client: Any, dirname: str, worker_state: dict[str, Any], delta: bool = False, parent: str | None = None
) -> str:
    """A new save under ``dirname``: every server's shards (``delta``: the sparse rows changed since each
    server's last save, which the manifest names as ``parent``) and ``worker_state`` as :data:`WORKER_FILE`,
    committed; its path. On failure nothing is committed."""
    save = persist.writer(dirname)
    try:
        try:
            replies = client.save(save.path, delta=delta).result()
        except PSRemoteError as error:
            if "No space left on device" in str(error):
                raise DiskFullError(save.path, "saving the parameter servers' shards under", str(error)) from None
            raise FleetError(f"save_persistables into {save.path} failed: {error}") from None
        except PSError as error:  # a server that died or did not answer within timeout_s
            raise FleetError(f"save_persistables into {save.path} failed: {error}") from None
        save.write(WORKER_FILE, worker_state)
        save.commit(parent, sums={rel: entry for reply in replies for rel, entry in reply.get("sums", {}).items()})
    except BaseException:
        save.abort(whole=True)  # the servers' shards too: nothing reads an uncommitted save
        raise
    return save.path


def load_servers(client: Any, source: str) -> list[dict[str, Any]]:
    """Load the save in ``source`` on every server of ``client``, all of them or none; their replies."""
    try:
        client.load(source, phase=LOAD_STAGE).result()
    except PSError as error:
        try:
            client.load(source, phase=LOAD_DISCARD).result()
        except PSError:
            pass  # a server that is gone holds nothing staged that anyone will commit
        raise FleetError(
            f"load_persistables({source!r}) failed: {error}. No table changed on any parameter server "
            "(every server checks the whole save before any applies it)."
        ) from None
    try:
        return client.load(source, phase=LOAD_COMMIT).result()
    except PSError as error:
        raise FleetError(
            f"load_persistables({source!r}) failed while the servers applied the save, after every one of them had "
            f"checked it: {error}. The servers that answered hold the save, the one named holds what it held "
            "before: load the save again."
        ) from None
