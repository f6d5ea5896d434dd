"""The worker's view of the parameter servers: sharded tables behind futures.

A dense logical table is one flat float32 vector cut into contiguous pieces,
one per server (:func:`shard_ranges`); a sparse table's row ``id`` lives on
server ``id % num_servers``. The client splits every call into one message
per server, sends them in parallel from its IO thread, and reassembles the
replies in the caller's order, so callers never see the sharding. A sparse
batch bigger than the request limits (:mod:`fleet.ps.protocol.limits`) goes as several
requests per server (:mod:`fleet.ps.client.split`), which callers do not see either.

Every method returns a :class:`concurrent.futures.Future` at once. Tensors
handed to a push are sent straight from their memory (no copy): do not
modify them until the push's future has resolved. Callbacks added to these
futures run on the client's IO thread: keep them short, and never wait there
for another request of the same client.

``encryption="curve"`` encrypts and authenticates every connection with keys
derived from the secret (:mod:`fleet.ps.protocol.auth`); the servers must use it too.

A server on this worker's host is reached through its Unix socket rather than TCP
(:mod:`fleet.ps.protocol.local`), found by itself; ``ipc=False`` (or ``FLEET_PS_IPC=0``) keeps TCP.

Failures: a server that does not answer within ``timeout_s`` (or whose
connection drops while a request is in flight) raises
:class:`~fleet.ps.protocol.errors.PSServerUnavailable` naming its index and endpoint;
an error answer raises :class:`~fleet.ps.protocol.errors.PSRemoteError`; a refused
secret raises :class:`~fleet.ps.protocol.errors.PSAuthError` at the handshake.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from fleet.ps.client import many
from fleet.ps.client.dense_layout import DenseLayout, DenseState, json_replies, shard_ranges
from fleet.ps.client.direct import DirectScope
from fleet.ps.client.io import IOThread, Job
from fleet.ps.modes import UpdateMode, of_config
from fleet.ps.protocol import auth
from fleet.ps.protocol.errors import PSAuthError, PSError, PSServerUnavailable
from fleet.ps.protocol.limits import BLOB_SLACK, RequestLimits
from fleet.ps.protocol.liveness import HEARTBEAT_S
from fleet.ps.protocol.wire import (
    DENSE_STATE_GET,
    DENSE_STATE_SET_OPTIMIZER,
    DENSE_STATE_SET_VALUES,
    REDUCE_OPS,
    WRITE_REPLACE,
    Message,
    Op,
    SparsePush,
    row_width,
)
from fleet.storage.paths import absolute

__all__ = ["DenseState", "PSClient", "shard_ranges", "sparse_owner"]

log = logging.getLogger(__name__)
_PULL_DENSE = int(Op.PULL_DENSE)


def sparse_owner(ids: torch.Tensor, num_servers: int) -> torch.Tensor:
    """The server index of each id: a non-negative ``id mod num_servers`` (negative ids too)."""
    return torch.remainder(ids, num_servers)


def _versioned(t: torch.Tensor, replies: Sequence[Message]) -> torch.Tensor:
    """Attach the shards' versions: ``ps_version`` (the minimum) and ``ps_versions`` (per server)."""
    versions = tuple([r.arg for r in replies])
    t.ps_versions = versions  # type: ignore[attr-defined]
    t.ps_version = min(versions) if versions else 0  # type: ignore[attr-defined]
    return t


class PSClient:
    """Talks to every parameter server for one worker; thread-safe, one IO thread per client."""

    def __init__(
        self,
        endpoints: Sequence[str],
        secret: bytes,
        worker_index: int,
        timeout_s: float,
        max_in_flight: int = 16,
        limits: RequestLimits | None = None,
        encryption: str = "none",
        ipc: bool = True,
    ):
        if not endpoints:
            raise ValueError("PSClient needs at least one server endpoint")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}; it must be positive")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight={max_in_flight}; it must be at least 1")
        self.endpoints = tuple(endpoints)
        self.num_servers = len(self.endpoints)
        self.worker_index = worker_index
        self.timeout_s = float(timeout_s)
        self.limits = limits if limits is not None else RequestLimits()
        self._dense: dict[int, DenseLayout] = {}
        self._sparse: dict[int, tuple[int, UpdateMode]] = {}  # table -> (dim, update mode)
        self._closed = False
        self._direct_threads: set[int] = set()  # threads inside direct()
        encryption = auth.check_encryption(encryption)
        # a sparse pull's answer holds at most a request's bytes of rows (fleet.ps.client.bulk)
        bound = self.limits.max_bytes + BLOB_SLACK
        self._io = IOThread(
            self.endpoints, secret, worker_index, max_in_flight, encryption, ipc=ipc, pull_reply_bound=bound
        )
        self._io.start(timeout_s=10.0)
        # Servers tell a dead worker from a busy one by these beats (fleet.ps.protocol.liveness).
        self._beating = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="fleet-ps-heartbeat", daemon=True)
        self._heartbeat.start()

    def _beat(self) -> None:
        while not self._beating.wait(HEARTBEAT_S):
            if self._closed:
                return
            try:
                # Unanswered beats are not errors; a restarted server's answer is (fleet.ps.client.io).
                self._submit(self._all(Op.HELLO), timeout_s=5 * HEARTBEAT_S)
            except PSError:
                return

    # ------------------------------------------------------------ plumbing
    def _msg(self, op: Op, table: int = 0, **fields: Any) -> Message:
        return Message(op=op, table=table, peer=self.worker_index, **fields)

    def _submit(
        self,
        parts: list[tuple[int, Message]],
        combine: Callable[[list[Message]], Any] = lambda replies: None,
        timeout_s: float | None = None,
        settle: bool = False,
    ) -> Future:
        if self._closed:
            raise PSError("this PSClient is closed")
        timeout = float(timeout_s or self.timeout_s)
        if self._direct_threads and threading.get_ident() in self._direct_threads:
            done = self._io.call_direct(parts, combine, timeout)  # no Job: a small pull's time is mostly Python
            if done is not None:
                return done
        return self._io.submit(Job(Future(), parts, combine, timeout, settle=settle))

    def direct(self) -> DirectScope:
        """Inside, this thread's small pulls may be sent and answered on this thread (returning a resolved future).

        For a caller that waits for the answer at once (``client.pull_dense(t).result()``): it saves the
        two hops through the client's IO thread (:mod:`fleet.ps.client.direct`). A pull that is large, or
        made while another request of this client is still queued or unanswered, goes through the IO
        thread as always; either way requests keep their order and the servers' checks.
        """
        return DirectScope(self._direct_threads)

    def _all(self, op: Op, table: int = 0, blob: bytes = b"", **fields: Any) -> list[tuple[int, Message]]:
        return [(s, self._msg(op, table, blob=blob, **fields)) for s in range(self.num_servers)]

    def _dense_layout(self, table_id: int) -> DenseLayout:
        try:
            return self._dense[table_id]
        except KeyError:
            raise PSError(f"dense table {table_id} is unknown to this client: call create_dense first") from None

    def _sparse_info(self, table_id: int) -> tuple[int, UpdateMode]:
        try:
            return self._sparse[table_id]
        except KeyError:
            raise PSError(f"sparse table {table_id} is unknown to this client: call create_sparse first") from None

    # ---------------------------------------------------------- lifecycle
    def hello(self, timeout_s: float | None = None) -> Future:
        """Future[list[dict]]: each server's index, worker count and endpoint; checks the endpoint order."""

        def check(replies: list[Message]) -> list[dict[str, Any]]:
            infos = json_replies(replies)
            for position, info in enumerate(infos):
                if info.get("server_index") != position:
                    raise PSError(
                        f"endpoint {self.endpoints[position]} is listed as server {position} but reports server "
                        f"{info.get('server_index')}: the endpoint list is not in server index order"
                    )
            return infos

        return self._submit(self._all(Op.HELLO), check, timeout_s)

    def wait_for_servers(self, timeout_s: float, cause: BaseException | None = None) -> None:
        """Block until every server answers HELLO (after a server restart), for at most ``timeout_s``.

        Raises ``cause`` (or the last failure) when a server stays away that long.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                self._submit(self._all(Op.HELLO), timeout_s=max(0.5, min(2.0, left))).result()
                return
            except PSAuthError:
                raise
            except PSServerUnavailable as exc:
                if time.monotonic() + 0.2 >= deadline:
                    raise (cause or exc) from exc
            time.sleep(0.2)

    def close(self, stop_servers_for_me: bool = True) -> None:
        """Send STOP (this worker is done) to every server, then stop the IO thread; bounded, never raises."""
        if self._closed:
            return
        self._beating.set()  # no heartbeat may follow the STOP
        self._heartbeat.join(timeout=2 * HEARTBEAT_S)
        if stop_servers_for_me:
            try:
                self._submit(self._all(Op.STOP)).result(self.timeout_s + 1.0)
            except Exception as exc:  # the servers may be gone already; closing must still finish
                log.warning("worker %d: STOP was not acknowledged: %s", self.worker_index, exc)
        self._closed = True
        self._io.close(timeout_s=self.timeout_s + 1.0)

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def transports(self) -> list[str]:
        """How this worker reaches each server, in index order: "ipc" (a Unix socket on this host) or "tcp".

        Decided when the client starts, before its first request to that server leaves.
        """
        return self._io.transports()

    @property
    def stale_pushes(self) -> int:
        """Pushes the servers dropped as stale (sync mode), as counted by this client."""
        return self._io.stale_pushes

    # -------------------------------------------------------------- dense
    def create_dense(
        self, table_id: int, init: torch.Tensor | None, config: dict[str, Any], timeout_s: float | None = None
    ) -> Future:
        """Create a dense table sharded over all servers.

        The worker with ``init`` (worker 0) sets the initial values; others pass
        None and need ``config["size"]``: their future resolves once the table
        exists. ``config`` holds ``optimizer`` and ``update``
        ("sync" | "async" | "geo", default "async") and ``backup_workers``.
        """
        flat = None if init is None else init.detach().reshape(-1).to(torch.float32).contiguous()
        size = flat.numel() if flat is not None else config.get("size")
        if size is None:
            raise ValueError(f"dense table {table_id}: a worker without initial values must give config['size']")
        if flat is not None and config.get("size", size) != size:
            raise ValueError(f"dense table {table_id}: config['size']={config['size']} but init has {size} values")
        layout = DenseLayout.of(table_id, int(size), self.num_servers)
        blobs = layout.shard_configs(config)
        pieces = layout.pieces(flat) if flat is not None else [(s, None) for s in range(self.num_servers)]
        parts = [
            (s, self._msg(Op.CREATE_DENSE, table_id, blob=blobs[s], tensors=[] if piece is None else [piece]))
            for s, piece in pieces
        ]
        self._dense[table_id] = layout
        self._io.name_table(table_id, config.get("name"))
        return self._submit(parts, timeout_s=timeout_s)

    def pull_dense(self, table_id: int, min_version: int = 0) -> Future:
        """Future[Tensor]: the flat values; ``.ps_version`` is the oldest shard version in it.

        With ``min_version`` (sync mode) each server answers once its shard has
        applied that many updates.
        """
        layout = self._dense_layout(table_id)
        me = self.worker_index
        combine = lambda replies: _versioned(layout.join(replies), replies)  # noqa: E731
        if self._direct_threads and self.num_servers == 1 and threading.get_ident() in self._direct_threads:
            if self._closed:
                raise PSError("this PSClient is closed")
            done = self._io.pull_direct(_PULL_DENSE, table_id, me, min_version, combine, self.timeout_s)
            if done is not None:  # the usual blocking pull from one server (W3's round trip): no Message made
                return done
        parts = [(s, Message(Op.PULL_DENSE, table_id, me, arg=min_version)) for s in range(self.num_servers)]
        return self._submit(parts, combine)

    def dense_state(self, table_id: int) -> Future:
        """Future[DenseState]: the table's values, optimizer state and each parameter's step, from every server."""
        layout = self._dense_layout(table_id)
        return self._submit(self._all(Op.DENSE_STATE, table_id, arg=DENSE_STATE_GET), layout.read_state)

    def set_dense_optimizer_state(
        self, table_id: int, named: dict[str, torch.Tensor], param_steps: torch.Tensor, step: int
    ) -> Future:
        """Replace the table's optimizer state (flat, like the values) and its parameters' step counts."""
        layout = self._dense_layout(table_id)
        blob = json.dumps({"names": list(named), "step": int(step)}).encode()
        flat = [layout.flat(t, f"optimizer state {name!r}") for name, t in named.items()]
        steps = param_steps.to(torch.int64).contiguous()
        parts = [
            (s, self._msg(Op.DENSE_STATE, table_id, arg=DENSE_STATE_SET_OPTIMIZER, blob=blob,
                          tensors=[steps, *(t[lo:hi] for t in flat)]))
            for s, (lo, hi) in enumerate(layout.ranges)
        ]  # fmt: skip
        return self._submit(parts)

    def set_dense_values(self, table_id: int, values: torch.Tensor, version: int = 0) -> Future:
        """Overwrite the table's values (parameters the user wrote outside the optimizer).

        ``version``: the version the written values were based on; a sync shard past it drops them.
        """
        flat = self._dense_layout(table_id).flat(values, "the new values")
        parts = [
            (s, self._msg(Op.DENSE_STATE, table_id, arg=DENSE_STATE_SET_VALUES, step=version, tensors=[piece]))
            for s, piece in self._dense_layout(table_id).pieces(flat)
        ]
        return self._submit(parts)

    def _dense_push(
        self, op: Op, table_id: int, values: torch.Tensor, step: int, lr: float, extra: list[torch.Tensor] = ()
    ) -> Future:
        layout = self._dense_layout(table_id)
        flat = layout.flat(values, "but the pushed tensor has")
        parts = [
            (s, self._msg(op, table_id, step=step, lr=lr, tensors=[piece, *extra])) for s, piece in layout.pieces(flat)
        ]
        return self._submit(parts)

    def push_dense_grad(
        self, table_id: int, grad: torch.Tensor, step: int, lr: float, present: torch.Tensor | None = None
    ) -> Future:
        """Future[None]: push a gradient for ``step`` (sync) or to apply now (async) with learning rate ``lr``.

        ``present``: uint8, one flag per parameter of the table (its ``shapes``), 0 where this
        worker has no gradient; None when it has them all.
        """
        extra = [present.to(torch.uint8).contiguous()] if present is not None else []
        return self._dense_push(Op.PUSH_DENSE_GRAD, table_id, grad, step, lr, extra)

    def push_dense_delta(self, table_id: int, delta: torch.Tensor) -> Future:
        """Future[None]: geo mode, add ``delta`` (this worker's change since its last sync) to the values."""
        return self._dense_push(Op.PUSH_DENSE_DELTA, table_id, delta, 0, 0.0)

    # ------------------------------------------------------------- sparse
    def create_sparse(self, table_id: int, config: dict[str, Any], timeout_s: float | None = None) -> Future:
        """Create a sparse table (every worker may call it; identical configs are no-ops).

        ``config``: ``dim``, ``optimizer``, ``initializer``, ``seed``, ``update``, ``backup_workers``.
        """
        if config.get("max_rows") is not None:
            config = {**config, "servers": self.num_servers}  # each server keeps max_rows // servers
        blob = json.dumps(config, sort_keys=True).encode()
        self._sparse[table_id] = (int(config["dim"]), of_config(config))
        self._io.name_table(table_id, config.get("name"))
        return self._submit(self._all(Op.CREATE_SPARSE, table_id, blob), timeout_s=timeout_s)

    def pull_sparse(self, table_id: int, ids: torch.Tensor, min_version: int = 0) -> Future:
        """Future[Tensor]: rows ``[len(ids), dim]`` in the order of ``ids`` (unique ids; missing rows are created).

        With ``min_version`` every server is asked (empty id lists included), so
        that every shard has reached the version before this worker pushes.
        """
        return self._pull_sparse([(table_id, ids, min_version)], one=True)

    def pull_sparse_many(self, requests: Sequence[tuple[int, torch.Tensor, int]]) -> Future:
        """Future[list[Tensor]]: the rows of each ``(table_id, unique ids, min_version)``, as :meth:`pull_sparse`
        gives them, in one request per server for all the tables (:mod:`fleet.ps.client.many`)."""
        return self._pull_sparse(requests, one=False)

    def _pull_sparse(self, requests: Sequence[tuple[int, torch.Tensor, int]], one: bool) -> Future:
        tables = [int(t) for t, _, _ in requests]
        dims = [self._sparse_info(t)[0] for t in tables]
        ids = [x.detach().reshape(-1).to(torch.int64).contiguous() for _, x, _ in requests]
        versions = [int(v) for _, _, v in requests]
        per_server = many.split_by_server(ids, tables, dims, self.num_servers, every_server=any(versions))
        plan = many.pack(per_server, self.limits, many.pull_pieces_of(ids, self.limits))
        parts = [(r.server, many.pull_message(r, ids, versions, self._msg)) for r in plan]

        def assemble(replies: list[Message]) -> list[torch.Tensor]:
            out = many.gather_pulls(plan, replies, ids, dims)
            for t, versions in out:
                t.ps_versions = versions  # type: ignore[attr-defined]
                t.ps_version = min(versions) if versions else 0  # type: ignore[attr-defined]
            return out[0][0] if one else [t for t, _ in out]

        return self._submit(parts, assemble)

    def push_sparse_grads_many(self, pushes: Sequence[SparsePush]) -> Future:
        """Future[None]: every table's row gradients (as :meth:`push_sparse_grad`), in one request per server
        for all the tables (:mod:`fleet.ps.client.many`); a table's stale push is counted as one."""
        return self._push_sparse(pushes, Op.PUSH_SPARSE_GRAD)

    def _push_sparse(self, pushes: Sequence[SparsePush], op: Op) -> Future:
        """Gradient pushes share requests (PUSH_SPARSE_GRAD_MANY); delta pushes go one table per request."""
        pushes = [many.checked_push(p, self._sparse_info(p.table)[0]) for p in pushes]
        tables = [p.table for p in pushes]
        dims = [self._sparse_info(t)[0] for t in tables]
        every = any(self._sparse_info(t)[1].pushes_to_every_server for t in tables)
        per_server = many.split_by_server([p.ids for p in pushes], tables, dims, self.num_servers, every)
        share = op == Op.PUSH_SPARSE_GRAD
        plan = many.pack(per_server, self.limits, many.push_pieces_of(pushes, self.limits), share)
        return self._submit([(r.server, many.push_message(r, pushes, self._msg, op)) for r in plan])

    def push_sparse_grad(
        self,
        table_id: int,
        ids: torch.Tensor,
        grads: torch.Tensor,
        step: int,
        lr: float,
        clicks: torch.Tensor | None = None,
    ) -> Future:
        """Future[None]: gradients of rows ``ids`` (duplicates are summed by the server), with optional clicks.

        ``step``: the sync step (sync mode), else this worker's step count (the tables' clock).
        """
        return self.push_sparse_grads_many([SparsePush(table_id, ids, grads, step, lr, clicks)])

    def push_sparse_delta(
        self, table_id: int, ids: torch.Tensor, deltas: torch.Tensor, step: int = 0, clicks: torch.Tensor | None = None
    ) -> Future:
        """Future[None]: geo mode, add ``deltas`` to rows ``ids``; ``step`` is this worker's step count;
        ``clicks`` (one per id, optional) the clicks recorded for those rows since the last sync."""
        return self._push_sparse([SparsePush(table_id, ids, deltas, step, 0.0, clicks)], Op.PUSH_SPARSE_DELTA)

    def shrink(self, table_id: int, threshold: float | None = None, timeout_s: float | None = None) -> Future:
        """Future[int]: every server evicts the table's expired rows (and rows scoring below ``threshold``)."""
        blob = json.dumps({"threshold": threshold}).encode()

        def total(replies: list[Message]) -> int:
            return sum(int(info["removed"]) for info in json_replies(replies))

        return self._submit(self._all(Op.SHRINK, table_id, blob=blob), total, timeout_s)

    def export_sparse(self, table_id: int) -> Future:
        """Future[(ids, rows)]: every row of sparse table ``table_id``, from all servers."""

        def gather(replies: list[Message]) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.cat([r.tensors[0] for r in replies]), torch.cat([r.tensors[1] for r in replies])

        return self._submit(self._all(Op.EXPORT_SPARSE, table_id), gather)

    def read_sparse_page(self, table_id: int, server: int, start: int) -> Future:
        """Future[(ids, {field: tensor}, total, optimizer config)]: one bounded page of server ``server``'s rows
        from slot ``start`` (the first page, ``start=0``, puts the shard's rows in id order first).

        Fields are every per-row tensor of a save (rows, steps, optimizer state, statistics); the
        server gives at most one request's worth (:mod:`fleet.ps.protocol.limits`) of ``total`` rows.
        """
        dim, _ = self._sparse_info(table_id)
        msg = self._msg(Op.EXPORT_SPARSE, table_id, arg=int(start), step=self.limits.ids_per_request(dim))

        def unpack(replies: list[Message]) -> tuple[torch.Tensor, dict[str, torch.Tensor], int, dict[str, Any]]:
            info = json_replies(replies)[0]
            tensors = replies[0].tensors
            fields = dict(zip(info["names"], tensors[1:], strict=True))
            return tensors[0], fields, int(info["total"]), info["optimizer"]

        return self._submit([(server, msg)], unpack)

    def write_sparse_rows(
        self, table_id: int, ids: torch.Tensor, fields: dict[str, torch.Tensor], replace: bool = False
    ) -> Future:
        """Future[None]: set rows ``ids`` (unique) to ``fields`` ({"rows": [n, dim], optional per-row fields}),
        in requests under the limits; ``replace`` clears every server's shard first."""
        self._sparse_info(table_id)
        ids = ids.detach().reshape(-1).to(torch.int64).contiguous()
        fields = {k: v.detach().contiguous() for k, v in fields.items()}
        most = self.limits.ids_per_request(row_width(fields))
        blob = json.dumps({"names": list(fields)}).encode()
        parts = [
            (s, self._msg(Op.WRITE_SPARSE_ROWS, table_id, arg=WRITE_REPLACE if first and replace else 0, blob=blob,
                          tensors=piece))
            for s, first, piece in many.write_pieces(ids, list(fields.values()), self.num_servers, most, replace)
        ]  # fmt: skip
        return self._submit(parts)

    def sparse_rows(self, table_id: int) -> Future:
        """Future[int]: the rows sparse table ``table_id`` holds now, over all servers."""

        def total(replies: list[Message]) -> int:
            return sum(int(info["tables"].get(str(table_id), {}).get("rows", 0)) for info in json_replies(replies))

        return self._submit(self._all(Op.STATS), total)

    # ---------------------------------------------------------- job-wide
    def barrier(self, timeout_s: float | None = None) -> Future:
        """Future[None]: resolves when every (not yet stopped) worker reached the barrier on every server.

        Going through every server also means each server has handled every
        request the workers sent before the barrier.
        """
        return self._submit(self._all(Op.BARRIER), timeout_s=timeout_s)

    def all_reduce(self, values: torch.Tensor, op: str = "sum", timeout_s: float | None = None) -> Future:
        """Future[Tensor]: ``values`` (as a float64 vector) reduced element-wise over every worker still running.

        ``op``: "sum", "max" or "min". Server 0 answers once every worker that has not stopped sent a
        vector of the same length (``fleet.metrics``' one collective in a parameter-server job).
        """
        if op not in REDUCE_OPS:
            raise ValueError(f"all_reduce op={op!r}; expected one of {', '.join(REDUCE_OPS)}")
        flat = values.detach().reshape(-1).to(device="cpu", dtype=torch.float64).contiguous()
        msg = self._msg(Op.ALL_REDUCE, arg=REDUCE_OPS.index(op), tensors=[flat])
        return self._submit([(0, msg)], lambda replies: replies[0].tensors[0].clone(), timeout_s)

    def save(self, dirname: str, timeout_s: float | None = None, delta: bool = False) -> Future:
        """Future[list[dict]]: every server writes its shards under ``dirname`` (a path the servers can reach).

        ``delta``: sparse tables write only the rows changed since the servers' previous save.
        """
        path = absolute(dirname).encode()
        # settle: on one server's error the caller removes the directory, so every server must be done with it
        return self._submit(self._all(Op.SAVE, blob=path, arg=int(delta)), json_replies, timeout_s, settle=True)

    def load(self, dirname: str, timeout_s: float | None = None, phase: int = 0) -> Future:
        """Future[list[dict]]: every server restores its shards from ``dirname`` (same number of servers).

        ``phase``: :data:`~fleet.ps.protocol.wire.LOAD_NOW`, or one step of a load every server
        checks before any applies (``LOAD_STAGE``, then ``LOAD_COMMIT`` or ``LOAD_DISCARD``).
        """
        path = absolute(dirname).encode()
        return self._submit(self._all(Op.LOAD, blob=path, arg=phase), json_replies, timeout_s, settle=True)

    def stats(self) -> Future:
        """Future[list[dict]]: each server's counters, in server order."""
        return self._submit(self._all(Op.STATS), json_replies)
