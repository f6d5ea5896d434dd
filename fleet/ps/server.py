"""The parameter-server process: one ROUTER socket, one thread, one event loop.

Why single-threaded: every op is either a memcpy-sized table operation or a
bookkeeping step, the tables are not thread-safe, and ZeroMQ already moves
bytes on its own IO thread. Requests that cannot be answered yet (a sync pull
for a version not reached, a create waiting for worker 0's initial values, a
barrier) are parked with a deadline and answered from the loop, so nothing in
the loop ever blocks.

Authentication (see :mod:`fleet.ps.auth`) is ZeroMQ's ZAP with the PLAIN
mechanism; its handler is one more socket polled by this loop.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import zmq

from fleet.ps import aggregator as agg
from fleet.ps import auth, shard_io
from fleet.ps.errors import WireError
from fleet.ps.wire import Message, Op, Status, decode, encode, op_name, read_request_id

log = logging.getLogger(__name__)

_MAX_BATCH = 256  # messages handled per poll wake-up before deadlines are checked again
_IDLE_POLL_MS = 100  # upper bound on a poll, so shutdown() is noticed promptly


@dataclass(slots=True)
class _Parked:
    """A request answered later: the peer's routing id, the request and its deadline."""

    ident: bytes
    msg: Message
    deadline: float
    since: float


def zmq_address(endpoint: str) -> str:
    """'host:port' -> 'tcp://host:port'; port 0 asks ZeroMQ for an ephemeral port."""
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"endpoint {endpoint!r} is not host:port (for example 127.0.0.1:6170)")
    return f"tcp://{host}:{'*' if int(port) == 0 else port}"


class ParameterServer:
    """Holds table shards and answers workers until every worker has sent STOP.

    ``endpoint`` is bound at construction (so a port clash surfaces at once and
    port 0 resolves to :attr:`endpoint`); :meth:`serve` runs the loop in the
    calling thread and returns the stats. :meth:`shutdown` may be called from
    any thread.
    """

    def __init__(
        self,
        endpoint: str,
        secret: bytes,
        server_index: int,
        num_workers: int,
        timeout_s: float,
        *,
        max_message_bytes: int = -1,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers}; a parameter server needs at least one worker")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}; it must be positive")
        self.server_index = server_index
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        auth.check_secret(secret)
        self._ctx = zmq.Context(io_threads=1)
        try:
            self._zap = auth.ZapHandler(self._ctx, secret)
            sock = self._ctx.socket(zmq.ROUTER)
            sock.linger = 2000  # let the last STOP replies leave before the context closes
            auth.configure_server(sock)
            sock.maxmsgsize = max_message_bytes
            sock.sndhwm = sock.rcvhwm = 10000
            if ":" in endpoint.rpartition(":")[0]:
                sock.ipv6 = True
            self._sock = sock
            sock.bind(zmq_address(endpoint))
            bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except Exception:
            self._ctx.destroy(linger=0)
            raise
        self.endpoint = bound.removeprefix("tcp://")
        self._shutdown = threading.Event()
        self._closed = False
        self._shards: dict[int, agg.DenseShard | agg.SparseShard] = {}
        self._pulls: dict[int, list[_Parked]] = defaultdict(list)  # table -> pulls waiting for a version
        self._creates: dict[int, list[_Parked]] = defaultdict(list)  # table -> creates waiting for the table
        self._barrier: dict[int, _Parked] = {}  # worker -> its parked BARRIER
        self._stopped: set[int] = set()
        self._started = time.monotonic()
        self._ops: dict[str, int] = defaultdict(int)
        self._table_ops: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._counts: dict[str, int] = defaultdict(int)
        self._handlers = {
            Op.HELLO: self._hello,
            Op.CREATE_DENSE: self._create,
            Op.CREATE_SPARSE: self._create,
            Op.PULL_DENSE: self._pull,
            Op.PULL_SPARSE: self._pull,
            Op.PUSH_DENSE_GRAD: self._push,
            Op.PUSH_SPARSE_GRAD: self._push,
            Op.PUSH_DENSE_DELTA: self._push,
            Op.PUSH_SPARSE_DELTA: self._push,
            Op.BARRIER: self._barrier_op,
            Op.SAVE: self._save,
            Op.LOAD: self._load,
            Op.STATS: lambda ident, msg: self._ok(msg, blob=json.dumps(self.stats()).encode()),
            Op.STOP: self._stop,
        }

    # ------------------------------------------------------------------ loop
    def serve(self) -> dict[str, Any]:
        """Answer requests until all workers stopped or :meth:`shutdown`; then close and return stats."""
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._zap.socket, zmq.POLLIN)
        log.info("parameter server %d serving at %s", self.server_index, self.endpoint)
        try:
            while not self._shutdown.is_set() and len(self._stopped) < self.num_workers:
                ready = dict(poller.poll(self._poll_timeout_ms()))
                if self._zap.socket in ready:
                    self._zap.serve()
                if self._sock in ready:
                    for _ in range(_MAX_BATCH):
                        try:
                            frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._handle(frames)
                self._expire(time.monotonic())
        finally:
            self._close()
        return self.stats()

    def shutdown(self) -> None:
        """Ask :meth:`serve` to return (thread-safe); parked requests get an error reply."""
        self._shutdown.set()

    def _poll_timeout_ms(self) -> int:
        now, nearest = time.monotonic(), _IDLE_POLL_MS / 1000
        for parked in self._all_parked():
            nearest = min(nearest, parked.deadline - now)
        return max(0, int(nearest * 1000) + 1)

    def _all_parked(self):
        for waiting in self._pulls.values():
            yield from waiting
        for waiting in self._creates.values():
            yield from waiting
        yield from self._barrier.values()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for parked in list(self._all_parked()):
            self._reply_error(parked.ident, parked.msg, "the parameter server is shutting down")
        self._pulls.clear()
        self._creates.clear()
        self._barrier.clear()
        self._sock.close()
        self._zap.close()
        self._ctx.term()
        log.info("parameter server %d at %s stopped", self.server_index, self.endpoint)

    # ------------------------------------------------------------- dispatch
    def _handle(self, frames: list[Any]) -> None:
        if len(frames) < 2:
            self._counts["dropped"] += 1  # not even an identity plus one frame: nobody to answer
            return
        ident = frames[0].bytes
        self._counts["bytes_in"] += sum(len(f) for f in frames[1:])
        try:
            msg = decode(frames[1:])
        except WireError as exc:
            self._counts["malformed"] += 1
            rid, op = (exc.request_id, exc.op) if exc.request_id else read_request_id(frames[1])
            self._reply_error(ident, Message(op=op, request_id=rid), f"malformed message: {exc}")
            return
        name = op_name(msg.op)
        self._ops[name] += 1
        if msg.status != Status.REQUEST:
            self._reply_error(ident, msg, f"{name} arrived with reply status {msg.status}; expected a request")
            return
        if not 0 <= msg.peer < self.num_workers:
            self._reply_error(ident, msg, f"worker index {msg.peer} is outside [0, {self.num_workers - 1}]")
            return
        if msg.op not in (Op.HELLO, Op.BARRIER, Op.SAVE, Op.LOAD, Op.STATS, Op.STOP):
            self._table_ops[msg.table][name] += 1
        try:
            reply = self._handlers[Op(msg.op)](ident, msg)
        except (agg.ShardError, ValueError, KeyError, TypeError) as exc:
            reply = self._error(msg, str(exc) or type(exc).__name__)
        except Exception as exc:  # a bug in a table must not take the server down
            log.error("parameter server %d failed on %s:\n%s", self.server_index, name, traceback.format_exc())
            reply = self._error(msg, f"internal error {type(exc).__name__}: {exc}")
        if reply is not None:
            self._send(ident, reply)

    def _send(self, ident: bytes, reply: Message) -> None:
        frames = encode(reply)
        self._counts["bytes_out"] += sum(len(f) for f in frames)
        try:  # ROUTER drops rather than blocks on a full or unknown peer; NOBLOCK makes sure
            self._sock.send_multipart([ident, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            self._counts["replies_dropped"] += 1
            log.warning("could not answer %s: %s", op_name(reply.op), exc)

    def _ok(self, msg: Message, *, tensors=None, blob: bytes = b"", version: int = 0, status=Status.OK) -> Message:
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

    def _error(self, msg: Message, text: str) -> Message:
        self._counts["errors"] += 1
        return self._ok(msg, blob=text.encode("utf-8", errors="replace"), status=Status.ERROR)

    def _reply_error(self, ident: bytes, msg: Message, text: str) -> None:
        self._send(ident, self._error(msg, text))

    def _deadline(self, msg: Message, now: float) -> float:
        """When a parked request gets its timeout error: a little before the sender gives up."""
        budget = msg.timeout_ms / 1000 if msg.timeout_ms > 0 else self.timeout_s
        return now + budget - min(0.25, 0.1 * budget)

    def _park(self, ident: bytes, msg: Message) -> _Parked:
        now = time.monotonic()
        return _Parked(ident, msg, self._deadline(msg, now), now)

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

    @property
    def _active(self) -> set[int]:
        return set(range(self.num_workers)) - self._stopped

    # ------------------------------------------------------------------ ops
    def _hello(self, ident: bytes, msg: Message) -> Message:
        info = {"server_index": self.server_index, "num_workers": self.num_workers, "endpoint": self.endpoint}
        return self._ok(msg, blob=json.dumps(info).encode())

    def _create(self, ident: bytes, msg: Message) -> Message | None:
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
            return self._ok(msg, version=existing.version)
        if dense:
            init = msg.tensors[0] if len(msg.tensors) == 1 else None
            if len(msg.tensors) > 1:
                raise agg.ShardError(f"CREATE_DENSE carries {len(msg.tensors)} tensors, expected 0 or 1 (init)")
            if init is None:  # not the creator: wait until the creator's initial values arrive
                self._creates[msg.table].append(self._park(ident, msg))
                return None
            shard = agg.DenseShard(msg.table, config, self.num_workers)
            shard.set(init)
        else:
            self._expect(msg)
            shard = agg.SparseShard(msg.table, config, self.num_workers)
        self._shards[msg.table] = shard
        self._answer_creates(msg.table)
        return self._ok(msg)

    def _check_same(self, shard: agg.Shard, kind: str, config: dict[str, Any]) -> None:
        if shard.kind != kind or shard.key != agg.canonical(config):
            raise agg.ShardError(
                f"conflicting create of table {shard.table_id}: it exists as {shard.kind} with config {shard.key}, "
                f"this create asks for {kind} with config {agg.canonical(config)}"
            )

    def _answer_creates(self, table: int) -> None:
        shard = self._shards[table]
        for parked in self._creates.pop(table, []):
            try:
                self._check_same(shard, "dense", json.loads(bytes(parked.msg.blob).decode("utf-8")))
                self._send(parked.ident, self._ok(parked.msg, version=shard.version))
            except (agg.ShardError, ValueError) as exc:
                self._reply_error(parked.ident, parked.msg, str(exc))

    def _pull(self, ident: bytes, msg: Message) -> Message | None:
        if msg.op == Op.PULL_DENSE:
            shard = self._shard(msg, "dense")
            self._expect(msg)
        else:
            shard = self._shard(msg, "sparse")
            shard.check_ids(self._expect(msg, "ids")[0])
        if msg.arg > shard.version:
            self._pulls[msg.table].append(self._park(ident, msg))
            return None
        return self._pull_reply(shard, msg)

    def _pull_reply(self, shard: agg.Shard, msg: Message) -> Message:
        if isinstance(shard, agg.DenseShard):
            return self._ok(msg, tensors=[shard.snapshot()], version=shard.version)
        return self._ok(msg, tensors=[shard.pull(msg.tensors[0])], version=shard.version)

    def _push(self, ident: bytes, msg: Message) -> Message:
        status = Status.OK
        if msg.op == Op.PUSH_DENSE_GRAD:
            shard = self._shard(msg, "dense")
            if not shard.push_grad(msg.peer, msg.step, self._expect(msg, "grad")[0], msg.lr):
                status = Status.STALE
        elif msg.op == Op.PUSH_SPARSE_GRAD:
            shard = self._shard(msg, "sparse")
            if not shard.push_grad(msg.peer, msg.step, *self._expect(msg, "ids", "grads"), msg.lr):
                status = Status.STALE
        elif msg.op == Op.PUSH_DENSE_DELTA:
            shard = self._shard(msg, "dense")
            shard.push_delta(self._expect(msg, "delta")[0])
        else:
            shard = self._shard(msg, "sparse")
            shard.push_delta(*self._expect(msg, "ids", "deltas"))
        if status == Status.STALE:
            self._counts["stale_dropped"] += 1
        shard.maybe_step(len(self._active))
        self._answer_pulls(msg.table)
        return self._ok(msg, version=shard.version, status=status)

    def _answer_pulls(self, table: int) -> None:
        waiting = self._pulls.get(table)
        if not waiting:
            return
        shard = self._shards[table]
        still = []
        for parked in waiting:
            if parked.msg.arg > shard.version:
                still.append(parked)
                continue
            try:
                self._send(parked.ident, self._pull_reply(shard, parked.msg))
            except (agg.ShardError, ValueError) as exc:
                self._reply_error(parked.ident, parked.msg, str(exc))
        self._pulls[table] = still

    def _barrier_op(self, ident: bytes, msg: Message) -> None:
        if msg.peer in self._barrier:
            raise agg.ShardError(f"worker {msg.peer} entered the barrier twice")
        self._barrier[msg.peer] = self._park(ident, msg)
        self._release_barrier()
        return None

    def _release_barrier(self) -> None:
        if self._barrier and len(self._barrier) >= len(self._active):
            for parked in self._barrier.values():
                self._send(parked.ident, self._ok(parked.msg))
            self._barrier.clear()

    def _stop(self, ident: bytes, msg: Message) -> Message:
        self._stopped.add(msg.peer)
        self._barrier.pop(msg.peer, None)
        # fewer workers now: sync steps and barriers waiting for the stopped one may complete
        for table, shard in self._shards.items():
            if shard.maybe_step(len(self._active)):
                self._answer_pulls(table)
        self._release_barrier()
        return self._ok(msg)

    def _save(self, ident: bytes, msg: Message) -> Message:
        files = shard_io.save_shards(msg.text(), self.server_index, self._shards)
        return self._ok(msg, blob=json.dumps({"files": files}).encode())

    def _load(self, ident: bytes, msg: Message) -> Message:
        loaded = []
        for table, kind, config, state in shard_io.load_shards(msg.text(), self.server_index):
            shard = self._shards.get(table)
            if shard is None:
                shard = (agg.DenseShard if kind == "dense" else agg.SparseShard)(table, config, self.num_workers)
                self._shards[table] = shard
            else:
                self._check_same(shard, kind, config)
            shard.load(state)
            loaded.append(table)
        for table in loaded:
            if table in self._creates:
                self._answer_creates(table)
            self._answer_pulls(table)
        return self._ok(msg, blob=json.dumps({"tables": loaded}).encode())

    # ------------------------------------------------------------- deadlines
    def _expire(self, now: float) -> None:
        for table, waiting in list(self._pulls.items()):
            keep = []
            for parked in waiting:
                if parked.deadline > now:
                    keep.append(parked)
                    continue
                shard = self._shards[table]
                need = shard.required(len(self._active))
                self._reply_error(
                    parked.ident,
                    parked.msg,
                    f"{op_name(parked.msg.op)} of table {table} waited {now - parked.since:.2f} s for version "
                    f"{parked.msg.arg}, but the shard is at version {shard.version}; missing pushes for step "
                    f"{shard.version} from workers {shard.waiting_for(self._active)} ({shard.mode} needs {need})",
                )
            self._pulls[table] = keep
        for table, waiting in list(self._creates.items()):
            self._creates[table] = [p for p in waiting if p.deadline > now]
            for parked in waiting:
                if parked.deadline <= now:
                    self._reply_error(
                        parked.ident,
                        parked.msg,
                        f"table {table} was not created with initial values (by worker 0) within "
                        f"{now - parked.since:.2f} s",
                    )
        for worker, parked in list(self._barrier.items()):
            if parked.deadline <= now:
                del self._barrier[worker]
                missing = sorted(self._active - set(self._barrier) - {worker})
                self._reply_error(
                    parked.ident, parked.msg, f"barrier timed out after {now - parked.since:.2f} s: workers {missing}"
                )

    # ----------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        """Counters for tests, metrics and the end-of-run report (JSON-serialisable)."""
        stale: dict[str, int] = defaultdict(int)
        for shard in self._shards.values():
            for worker, n in shard.stale_dropped.items():
                stale[str(worker)] += n
        return {
            "server_index": self.server_index,
            "endpoint": self.endpoint,
            "uptime_s": round(time.monotonic() - self._started, 3),
            "ops": dict(self._ops),
            "table_ops": {str(t): dict(ops) for t, ops in self._table_ops.items()},
            "tables": {str(t): shard.info() for t, shard in self._shards.items()},
            "stale_dropped": dict(stale),
            "stopped_workers": sorted(self._stopped),
            **{k: self._counts.get(k, 0) for k in ("bytes_in", "bytes_out", "errors", "malformed")},
            "auth_rejected": self._zap.rejected,
            "dropped": self._counts.get("dropped", 0) + self._counts.get("replies_dropped", 0),
        }


def main(argv: list[str] | None = None) -> int:
    """Process entry point: ``python -m fleet.ps.server --endpoint H:P --index I --workers N``.

    The secret comes from FLEET_SECRET (hex), never from the command line,
    where other users of the machine could read it.
    """
    from fleet import env

    parser = argparse.ArgumentParser(description="fleet parameter server")
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    secret_hex = env.current().require(env.FLEET_SECRET, "the parameter server authenticates workers with it")
    try:
        secret = bytes.fromhex(secret_hex)
    except ValueError:
        raise env.EnvError(f"{env.FLEET_SECRET} is not hex") from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        server = ParameterServer(args.endpoint, secret, args.index, args.workers, args.timeout)
    except zmq.ZMQError as exc:
        if exc.errno == zmq.EADDRINUSE:
            log.error("cannot bind %s: address in use", args.endpoint)
            return env.EXIT_PORT_IN_USE
        raise
    print(f"fleet parameter server {args.index} listening on {server.endpoint}", flush=True)
    stats = server.serve()
    print(json.dumps(stats), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
