"""The table requests of :class:`~fleet.ps.server.loop.ParameterServer`: create, pull, push, save, load.

:class:`TableRequests` is an object the server composes: it is given, through its
constructor, the shards it serves (the server's table map), the waitlist for parked
requests, the server's reply helpers (:class:`~fleet.ps.server.replies.Replies`), the counters it adds to, and the
the workers a sync step waits for (``active``), and closes the shards' sync steps. The
server loop dispatches to its public handlers, which return the reply, or None when the
request was parked to be answered later.

A sparse request carries at most the ids of the server's :class:`~fleet.ps.protocol.limits.RequestLimits`
(the client splits bigger batches); a piece of a split push says so with ``arg`` =
:data:`~fleet.ps.protocol.wire.MORE_FOLLOWS`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, MutableMapping
from contextlib import AbstractContextManager
from typing import Any

import torch

from fleet.ps.protocol.limits import BLOB_SLACK, Limit, RequestLimits
from fleet.ps.protocol.wire import (
    DENSE_STATE_GET,
    DENSE_STATE_SET_OPTIMIZER,
    DENSE_STATE_SET_VALUES,
    LOAD_COMMIT,
    LOAD_DISCARD,
    LOAD_NOW,
    LOAD_STAGE,
    MORE_FOLLOWS,
    WRITE_REPLACE,
    Message,
    Op,
    Status,
    op_name,
    row_width,
)
from fleet.ps.server import aggregator as agg
from fleet.ps.server import shard_io, staged_load
from fleet.ps.server.replies import Replies
from fleet.ps.server.waitlist import Parked, Waitlist
from fleet.storage.paths import absolute

Shards = MutableMapping[int, "agg.DenseShard | agg.SparseShard"]


# A table's names in the workers' model: compared when both creates carry them (a worker may find no model
# holding a table that another worker's model holds: names depend on what each process keeps alive).
_NAME_KEYS = ("name", "names")


def _same_table(made: dict[str, Any], asked: dict[str, Any]) -> bool:
    """Whether two creates' configs describe the same table: equal but for names only one of them carries."""

    def unnamed(config: dict[str, Any]) -> str:
        return agg.canonical({k: v for k, v in config.items() if k not in _NAME_KEYS})

    if unnamed(made) != unnamed(asked):
        return False
    return all(made[k] == asked[k] for k in _NAME_KEYS if k in made and k in asked)


class TableRequests:
    """Handlers for the table ops of one server, over the shards it is given."""

    def __init__(
        self,
        shards: Shards,
        waiting: Waitlist,
        replies: Replies,
        counts: MutableMapping[str, int],
        active: Callable[[], set[int]],
        *,
        server_index: int,
        num_workers: int,
        limits: RequestLimits,
        checkpoint_record_dir: str | None = None,
        outside: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext,
    ):
        self._shards = shards
        # Around a table's own work (its kernels release the GIL): on a table thread, the server's lock is let
        # go meanwhile, so that other tables' threads and the loop go on (fleet.ps.server.lanes).
        self._outside = outside
        self._waiting = waiting
        self._replies = replies
        self._counts = counts
        self._active = active
        self.server_index = server_index
        self.num_workers = num_workers
        self.limits = limits
        #: what a request of any kind but a dense table's values may carry (fleet.ps.protocol.limits)
        self.request_budget = limits.budget()
        self.checkpoint_record_dir = checkpoint_record_dir  # where each SAVE is recorded for a restart
        self.last_save: str | None = None  # the directory of this server's last save or load
        self._staged: staged_load.StagedLoad | None = None  # a LOAD_STAGE waiting for its commit (or discard)
        self._most_ids: dict[int, int] = {}  # row width -> the ids one request carries (fits)

    def close_step(self, shard: agg.Shard) -> bool:
        """Close the shard's sync step if it is complete (see Shard.maybe_step); never raises.

        When applying the step fails (out of memory), the shard keeps the step's gradients and
        its version, records why in ``step_error``, and the workers waiting for the step hear
        it now rather than at their timeout; the next push, stop or barrier tries again.
        """
        if not shard.mode.closes_steps:
            return False  # applied on arrival (async, geo): no step to close, no worker sets to build per push
        try:
            return shard.maybe_step(self._active(), set(self._waiting.barrier))
        except Exception as exc:
            what = f"applying sync step {shard.version}"
            shard.fail_step(self._replies.failure(exc, what, shard.table_id))
            for parked in self._waiting.ready_pulls(shard.table_id, 1 << 62):
                self._replies.reply_error(parked.ident, parked.msg, shard.step_error)
            return False

    def close_ready_steps(self) -> None:
        """After workers stopped or reached a barrier: sync steps waiting only for them may complete."""
        for table, shard in self._shards.items():
            if self.close_step(shard):
                self.answer_pulls(table)

    def expire_pulls(self, pulls: list[tuple[int, Parked]], now: float) -> None:
        """Answer pulls that waited past their deadline for a version, naming the workers the step misses."""
        active = self._active()
        for table, parked in pulls:
            shard = self._shards[table]
            self._replies.reply_error(
                parked.ident,
                parked.msg,
                f"{op_name(parked.msg.op)} of table {table} waited {now - parked.since:.2f} s for version "
                f"{parked.msg.arg}, but the shard is at version {shard.version}; missing pushes for step "
                f"{shard.version} from workers {shard.waiting_for(active)} "
                f"({shard.mode.name} needs {shard.needs(active)})",
            )

    def budget(self, op: int, table: int) -> Limit | None:
        """What a message of kind ``op`` may carry: a dense table's values are its shard, anything else the limit."""
        if op == Op.CREATE_DENSE:
            return None  # the creator sets the size; the values must match it (checked on creation)
        if op in (Op.PUSH_DENSE_GRAD, Op.PUSH_DENSE_DELTA, Op.DENSE_STATE):
            shard = self._shards.get(table)
            if not isinstance(shard, agg.DenseShard):
                return self.request_budget  # unknown or sparse: refused by the handler, with the reason
            copies = 3 if op == Op.DENSE_STATE else 1  # values, or optimizer state (Adam: two vectors)
            return Limit(
                4 * copies * shard.size + 8 * shard.parameters + BLOB_SLACK,
                f"a {op_name(op)} of dense table {table} carries at most {copies} x its shard here "
                f"({shard.size:,} float32 values)",
            )
        return self.request_budget

    def _shard(self, msg: Message, kind: str) -> agg.DenseShard | agg.SparseShard:
        shard = self._shards.get(msg.table)
        if shard is None:
            raise agg.ShardError(f"unknown table {msg.table} (create it first; this server has {sorted(self._shards)})")
        if shard.kind != kind:
            raise agg.ShardError(f"table {msg.table} is {shard.kind}, but {op_name(msg.op)} needs a {kind} table")
        return shard

    @staticmethod
    def _expect(msg: Message, *names: str) -> list[Any]:
        if len(msg.tensors) != len(names):
            raise agg.ShardError(
                f"{op_name(msg.op)} carries {len(msg.tensors)} tensors, expected {len(names)} ({', '.join(names)})"
            )
        return msg.tensors

    def create(self, ident: bytes, msg: Message) -> Message | None:
        dense = msg.op == Op.CREATE_DENSE
        try:
            config = json.loads(bytes(msg.blob).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise agg.ShardError(f"table {msg.table}: config is not UTF-8 JSON ({exc})") from None
        if not isinstance(config, dict):
            raise agg.ShardError(f"table {msg.table}: config must be a JSON object, got {type(config).__name__}")
        existing = self._shards.get(msg.table)
        if existing is not None:
            self._check_same(existing, "dense" if dense else "sparse", config)
            return self._replies.ok(msg, version=existing.version)
        if dense:
            init = msg.tensors[0] if len(msg.tensors) == 1 else None
            if len(msg.tensors) > 1:
                raise agg.ShardError(f"CREATE_DENSE carries {len(msg.tensors)} tensors, expected 0 or 1 (init)")
            if init is None:  # not the creator: wait until the creator's initial values arrive
                self._waiting.creates[msg.table].append(self._replies.park(ident, msg))
                return None
            shard = agg.DenseShard(msg.table, config, self.num_workers)
            shard.set(init)
        else:
            self._expect(msg)
            shard = agg.SparseShard(msg.table, config, self.num_workers)
        self._shards[msg.table] = shard
        self.answer_creates(msg.table)
        return self._replies.ok(msg)

    def _check_same(self, shard: agg.Shard, kind: str, config: dict[str, Any]) -> None:
        if shard.kind != kind or not _same_table(shard.config, config):
            details = {
                "code": "conflicting_create",
                "table": shard.table_id,
                "existing": {"kind": shard.kind, "config": shard.config},
                "requested": {"kind": kind, "config": config},
            }
            made, asked = shard.config.get("name"), config.get("name")  # the module's path in the workers' model
            named = f" ({made!r}; this create is for {asked!r})" if made != asked else f" ({made!r})" if made else ""
            raise agg.ShardError(
                f"conflicting create of table {shard.table_id}{named}: it exists as {shard.kind} with config "
                f"{shard.key}, this create asks for {kind} with config {agg.canonical(config)}",
                details,
            )

    def answer_creates(self, table: int) -> None:
        shard = self._shards[table]
        for parked in self._waiting.take_creates(table):
            try:
                self._check_same(shard, "dense", json.loads(bytes(parked.msg.blob).decode("utf-8")))
                self._replies.send(parked.ident, self._replies.ok(parked.msg, version=shard.version))
            except agg.ShardError as exc:
                self._replies.reply_error(parked.ident, parked.msg, str(exc), exc.details)
            except ValueError as exc:
                self._replies.reply_error(parked.ident, parked.msg, str(exc))
            except Exception as exc:  # noqa: BLE001 - answered, and the next parked request still is
                self._replies.reply_error(
                    parked.ident, parked.msg, self._replies.failure(exc, op_name(parked.msg.op), table)
                )

    def pull(self, ident: bytes, msg: Message) -> Message | None:
        if msg.op == Op.PULL_DENSE:
            shard = self._shard(msg, "dense")
            self._expect(msg)
        else:
            shard = self._shard(msg, "sparse")
            ids = self._expect(msg, "ids")[0]
            shard.check_ids(ids)
            self.limits.check_ids("PULL_SPARSE", msg.table, ids.numel(), shard.dim)
        if getattr(shard, "broken", None) is not None:
            raise agg.ShardError(*shard.broken)
        if msg.arg > shard.version and shard.step_error is not None:
            raise agg.ShardError(shard.step_error)
        if msg.arg > shard.version:
            self._waiting.pulls[msg.table].append(self._replies.park(ident, msg))
            return None
        return self._pull_reply(shard, msg)

    def quick_dense(self, table: int, min_version: int, limit: int) -> tuple[int, bytes] | None:
        """(version, values' bytes) that :meth:`pull` would answer a PULL_DENSE (no tensors) of ``table`` with
        ``min_version`` with now, when the table is a dense one of at most ``limit`` bytes that answers at once;
        else None (:meth:`pull` says why, or parks it).

        Called on the loop thread with the table threads idle (as :meth:`pull` is then). Fields, not a
        :class:`Message`: the server's quick pull reads a request without making one.
        """
        shard = self._shards.get(table)
        if shard is None or shard.kind != "dense" or min_version > shard.version:
            return None
        assert isinstance(shard, agg.DenseShard)
        if shard.broken is not None:
            return None
        data = shard.snapshot_bytes(limit)
        return None if data is None else (shard.version, data)

    def _pull_reply(self, shard: agg.Shard, msg: Message) -> Message:
        with self._outside():
            rows = shard.snapshot() if isinstance(shard, agg.DenseShard) else shard.pull(msg.tensors[0])
        return self._replies.ok(msg, tensors=[rows], version=shard.version)

    def fits(self, count: int, dim: int) -> bool:
        """Whether a sparse request of ``count`` ids of rows of width ``dim`` is within the limits
        (:meth:`~fleet.ps.protocol.limits.RequestLimits.check_ids` says why not)."""
        most = self._most_ids.get(dim)
        if most is None:
            most = self._most_ids[dim] = self.limits.ids_per_request(dim)
        return count <= most

    def pull_now(self, shard: agg.SparseShard, ids: torch.Tensor, out: torch.Tensor) -> int:
        """What :meth:`pull` does for a sparse pull that answers at once (the caller checked the ids, the limits and
        the version): ``shard``'s rows of ``ids`` written into ``out``; the version to answer with."""
        with self._outside():
            shard.pull(ids, out=out)
        return shard.version

    def push(self, ident: bytes, msg: Message) -> Message:
        status = Status.OK
        more = msg.arg == MORE_FOLLOWS
        if msg.op == Op.PUSH_SPARSE_GRAD:
            shard = self._shard(msg, "sparse")
            # Clicks travel only when the worker recorded some.
            ids, grads, *clicks = msg.tensors if len(msg.tensors) == 3 else self._expect(msg, "ids", "grads")
            self.limits.check_ids("PUSH_SPARSE_GRAD", msg.table, ids.numel(), shard.dim)
            status = self.push_sparse_grad(
                shard, msg.peer, msg.step, ids, grads, msg.lr, clicks[0] if clicks else None, more
            )
            return self._replies.ok(msg, version=shard.version, status=status)
        if msg.op == Op.PUSH_DENSE_GRAD:
            shard = self._shard(msg, "dense")
            # The presence flags travel only when some parameter has no gradient.
            grad, *present = msg.tensors if len(msg.tensors) == 2 else self._expect(msg, "grad")
            try:
                with self._outside():
                    fresh = shard.push_grad(msg.peer, msg.step, grad, msg.lr, present[0] if present else None)
                if not fresh:
                    status = Status.STALE
            except agg.ShardError as exc:
                if shard.broken is not None:  # the workers waiting for this step learn why it never comes
                    for parked in self._waiting.ready_pulls(msg.table, 1 << 62):
                        self._replies.reply_error(parked.ident, parked.msg, str(exc), exc.details)
                raise
        elif msg.op == Op.PUSH_DENSE_DELTA:
            shard = self._shard(msg, "dense")
            delta = self._expect(msg, "delta")[0]
            with self._outside():
                shard.push_delta(delta, worker=msg.peer, step=msg.step)
        else:
            shard = self._shard(msg, "sparse")
            # Clicks travel only when the worker recorded some.
            ids, deltas, *clicks = msg.tensors if len(msg.tensors) == 3 else self._expect(msg, "ids", "deltas")
            self.limits.check_ids("PUSH_SPARSE_DELTA", msg.table, ids.numel(), shard.dim)
            with self._outside():
                shard.push_delta(
                    ids, deltas, step=msg.step, more=more, clicks=clicks[0] if clicks else None, worker=msg.peer
                )
        self._pushed(shard, status, more)
        return self._replies.ok(msg, version=shard.version, status=status)

    def push_sparse_grad(
        self,
        shard: agg.SparseShard,
        worker: int,
        step: int,
        ids: torch.Tensor,
        grads: torch.Tensor,
        lr: float,
        clicks: torch.Tensor | None,
        more: bool = False,
        finite: bool = False,
    ) -> Status:
        """A sparse gradient push (the caller checked its limits); its status (OK or STALE) after what follows a push.

        ``finite``: the caller found every value (gradients, clicks, lr) finite already (see SparseShard.push_grad).
        """
        with self._outside():
            fresh = shard.push_grad(worker, step, ids, grads, lr, clicks, more, finite=finite)
        status = Status.OK if fresh else Status.STALE
        self._pushed(shard, status, more)
        return status

    def _pushed(self, shard: agg.Shard, status: Status, more: bool) -> None:
        """After a push: count a stale one, close the sync step it may complete, answer the pulls waiting for it."""
        if status == Status.STALE and not more:
            self._counts["stale_dropped"] += 1
        self.close_step(shard)
        if shard.step_error is not None:  # this push completed a step that could not be applied
            raise agg.ShardError(shard.step_error)
        self.answer_pulls(shard.table_id)

    def answer_pulls(self, table: int) -> None:
        shard = self._shards[table]
        for parked in self._waiting.ready_pulls(table, shard.version):
            try:
                self._replies.send(parked.ident, self._pull_reply(shard, parked.msg))
            except (agg.ShardError, ValueError) as exc:
                self._replies.reply_error(parked.ident, parked.msg, str(exc))
            except Exception as exc:  # noqa: BLE001 - answered, and the next parked pull still is
                self._replies.reply_error(
                    parked.ident, parked.msg, self._replies.failure(exc, op_name(parked.msg.op), table)
                )

    def dense_state(self, ident: bytes, msg: Message) -> Message:
        """A dense shard's values and optimizer state, read or replaced (see wire.DENSE_STATE_GET)."""
        shard = self._shard(msg, "dense")
        assert isinstance(shard, agg.DenseShard)
        if msg.arg == DENSE_STATE_GET:
            self._expect(msg)
            values, param_steps, named, step = shard.optimizer_state()
            blob = json.dumps({"names": list(named), "step": step}).encode()
            return self._replies.ok(
                msg, tensors=[values, param_steps, *named.values()], blob=blob, version=shard.version
            )
        if msg.arg == DENSE_STATE_SET_VALUES:
            values = self._expect(msg, "values")[0]
            shard.check_values("values", values)
            if shard.stale_write(msg.step):
                # Written on values of a step that has closed since (a backup worker, late): applying
                # them would undo that step. Dropped like its late gradient; it takes the new values.
                self._counts["stale_dropped"] += 1
                return self._replies.ok(msg, version=shard.version, status=Status.STALE)
            shard.set(values)
            return self._replies.ok(msg, version=shard.version)
        if msg.arg != DENSE_STATE_SET_OPTIMIZER:
            raise agg.ShardError(f"DENSE_STATE arg {msg.arg} is none of get (0), set optimizer (1), set values (2)")
        try:
            meta = json.loads(msg.text())
            names, step = list(meta["names"]), int(meta["step"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise agg.ShardError(
                'DENSE_STATE set carries a JSON object such as {"names": ["exp_avg"], "step": 3}'
            ) from None
        if len(msg.tensors) != 1 + len(names):
            raise agg.ShardError(
                f"DENSE_STATE set carries {len(msg.tensors)} tensors for {len(names)} state names + steps"
            )
        shard.set_optimizer_state(msg.tensors[0], dict(zip(names, msg.tensors[1:], strict=True)), step)
        return self._replies.ok(msg, version=shard.version)

    def shrink(self, ident: bytes, msg: Message) -> Message:
        """Evict, in sparse table ``msg.table``, rows past their TTL and (with a threshold) rows scoring below it."""
        try:
            threshold = json.loads(msg.text() or "{}").get("threshold")
        except (json.JSONDecodeError, AttributeError):
            raise agg.ShardError('SHRINK carries a JSON object such as {"threshold": 0.5}') from None
        if threshold is not None and not isinstance(threshold, int | float):
            raise agg.ShardError(f"SHRINK threshold must be a number or null, got {threshold!r}")
        shard = self._shard(msg, "sparse")
        return self._replies.ok(msg, blob=json.dumps({"removed": shard.table.shrink(threshold)}).encode())

    def export_sparse(self, ident: bytes, msg: Message) -> Message:
        """Every (id, row) of sparse table ``msg.table`` on this server, for ``fleet.export_for_inference``;
        with ``step`` > 0 one bounded page of every per-row field from slot ``arg`` (``state_dict``)."""
        shard = self._shard(msg, "sparse")
        self._expect(msg)
        if msg.step <= 0:
            return self._replies.ok(msg, tensors=list(shard.table.export()), version=shard.version)
        table = shard.table
        if msg.arg == 0:  # a read starts: rows in id order, as a load writes them (see SparseTable.sort_by_id)
            table.sort_by_id()
        count = min(int(msg.step), self.limits.rows_per_request(row_width(table.copy_rows(slice(0, 0)))))
        ids, fields = table.rows_page(int(msg.arg), count)
        blob = json.dumps(
            {"names": list(fields), "total": len(table), "optimizer": table.optimizer.to_config()}
        ).encode()
        return self._replies.ok(msg, tensors=[ids, *fields.values()], blob=blob, version=shard.version)

    def write_sparse_rows(self, ident: bytes, msg: Message) -> Message:
        """Set rows of sparse table ``msg.table`` (``load_state_dict``, ``load_rows``); ``arg`` 1: clear it first."""
        shard = self._shard(msg, "sparse")
        try:
            names = list(json.loads(msg.text())["names"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise agg.ShardError('WRITE_SPARSE_ROWS carries a JSON object such as {"names": ["rows"]}') from None
        if len(msg.tensors) != 1 + len(names):
            raise agg.ShardError(f"WRITE_SPARSE_ROWS carries {len(msg.tensors)} tensors for ids + {len(names)} fields")
        ids, values = msg.tensors[0], dict(zip(names, msg.tensors[1:], strict=True))
        shard.check_ids(ids)
        self.limits.check_ids("WRITE_SPARSE_ROWS", msg.table, ids.numel(), row_width(values) if ids.numel() else 1)
        shard.table.write_rows(ids, values, replace=msg.arg == WRITE_REPLACE)
        return self._replies.ok(msg, version=shard.version)

    def save(self, ident: bytes, msg: Message) -> Message:
        """``arg`` 1: a delta on the last save (or load) of this server; 0: a base."""
        last = self.last_save
        if msg.arg == 1 and last is None:
            raise agg.ShardError(
                f"a delta save needs an earlier save (or load) of parameter server {self.server_index} to build "
                "on: save a base first (save_persistables(dirname, mode='base'))"
            )
        if msg.arg == 1 and absolute(msg.text()) == last:
            raise agg.ShardError(f"a delta save cannot overwrite the save it builds on ({last}): use a new directory")
        files, sums = shard_io.save_shards(msg.text(), self.server_index, self._shards, last if msg.arg == 1 else None)
        self.last_save = absolute(msg.text())
        record_dir = self.checkpoint_record_dir
        if record_dir:  # a restarted server loads its shards from here (fleetrun --max-restarts)
            shard_io.record_checkpoint(record_dir, self.server_index, msg.text())
        return self._replies.ok(msg, blob=json.dumps({"files": files, "sums": sums}).encode())

    def load(self, ident: bytes, msg: Message) -> Message:
        """``arg``: LOAD_NOW (stage and apply), or one phase of a load across servers (see wire.LOAD_STAGE)."""
        dirname = absolute(msg.text())
        if msg.arg == LOAD_NOW:
            loaded = self.restore(dirname)
        elif msg.arg == LOAD_STAGE:
            self._staged = None  # a new load replaces one never committed
            self._staged = self._stage(dirname)
            loaded = self._staged.tables
        elif msg.arg == LOAD_COMMIT:
            staged, self._staged = self._staged, None
            if staged is None or staged.dirname != dirname:
                raise agg.ShardError(
                    f"parameter server {self.server_index}: LOAD commit of {dirname}, but "
                    + ("nothing is staged" if staged is None else f"the staged load is of {staged.dirname}")
                    + ": no table changed"
                )
            loaded = self._apply(staged)
        elif msg.arg == LOAD_DISCARD:
            self._staged, loaded = None, []
        else:
            raise agg.ShardError(f"LOAD arg {msg.arg} is none of now (0), stage (1), commit (2), discard (3)")
        return self._replies.ok(msg, blob=json.dumps({"tables": loaded}).encode())

    def restore(self, dirname: str) -> list[int]:
        """Load this server's shards saved under ``dirname`` (tables, values, optimizer state, versions):
        every file read and checked first; on any failure no table changed."""
        return self._apply(self._stage(absolute(dirname)))

    def _stage(self, dirname: str) -> staged_load.StagedLoad:
        return staged_load.stage(dirname, self.server_index, self._shards, self.num_workers, self._check_same)

    def _apply(self, staged: staged_load.StagedLoad) -> list[int]:
        loaded = staged.apply(self._shards)
        self.last_save = staged.dirname
        for table in loaded:
            self.answer_creates(table)
            self.answer_pulls(table)
        return loaded
