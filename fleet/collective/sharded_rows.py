"""A sparse table sharded across the workers, row-wise by id: each worker holds and updates 1/N of its rows.

The table backend (:class:`fleet.sparse.backends.TableBackend`) of a ``fleet.nn.SparseEmbedding``
(and of the bags and feature collections built on it) in ``mode="sharding"`` by default and in
``mode="collective"`` with ``table_placement="sharded"``. Worker :func:`owner` ``(id)`` holds id's row:
``splitmix64(id) mod workers``, so ids that share a stride (a feature prefix in the high bits,
a multiple of the worker count) still spread evenly. Each worker keeps its own rows in a table of
its own (:class:`~fleet.sparse.backends.LocalRows` over a :class:`TableShard`), with the module's
optimizer, initializer and life cycle.

A step, TorchRec's row-wise layout in fleet's form (:mod:`fleet.collective.all_to_all`):

- **pull** (forward): the batch's unique ids go to their owners, each owner reads (or creates)
  their rows exactly as one process would, and the rows come back: two all-to-alls (ids,
  rows) after one of counts.
- **step** (the optimizer holding the module steps): each worker's (id, gradient) pairs go to
  the owners, clicks and the ids riding along as more columns; the owner divides by the number
  of workers (each worker's loss is its batch's mean) and applies one row-optimizer step in
  which duplicate ids' gradients are summed first: the update one process applies to the union
  of the batches, row for row (the rows a replica applies, :mod:`fleet.collective.sparse_grads`,
  restricted to the owner's). A NaN or Inf on any worker (a flag riding with the counts) skips
  the step on every owner. Every owner steps every step, so clocks and TTLs advance as one table's.

Several tables of one optimizer or collection share their exchanges (:mod:`fleet.collective.sharded_many`).

Rows in ``state_dict`` are gathered from every owner in pieces of at most :data:`PIECE_BYTES`
per worker per exchange, so a saved checkpoint holds every row, and any number of workers
loads it: each keeps the rows it owns (N -> M). ``load_rows`` and loading a state dict keep
the owned rows of what every worker is given. Life cycle: TTL and ``ProbabilityEntry`` follow
one process exactly (same clock; same hash of id and step); ``max_rows`` is split evenly
(``max_rows // workers`` per owner, as a parameter server's cap is split over its servers);
``CountFilterEntry`` counts each id on its owner's sketch, as a parameter server counts it on
its server's, and the sketches are not in ``state_dict`` (they restart after a load, as on a
parameter server). ``num_rows``, ``shrink``, ``export``, ``dense_weight`` and ``state_dict``
are collectives: every worker calls them. ``fleet.join()`` (uneven inputs) is not supported yet.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fleet.collective import all_to_all, sharded_many
from fleet.errors import FleetError
from fleet.sparse import nonfinite
from fleet.sparse.backends import LocalRows, per_row_fields
from fleet.sparse.lifecycle import LifeCycle

PIECE_BYTES = 32 << 20
"""Most bytes of rows one worker contributes to one exchange of a gathered ``state_dict``."""

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _MIX1, _MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _logical_shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)  # torch's >> on int64 is arithmetic


def owner(ids: torch.Tensor, workers: int) -> torch.Tensor:
    """The worker that holds each id's row: splitmix64(id) mod ``workers`` (int64, on ``ids``' device)."""
    h = ids.to(torch.int64) + _GOLDEN  # wrapping int64 arithmetic, as splitmix64's (in place: fewer passes)
    h *= _MIX1
    h ^= _logical_shift(h, 30)
    h *= _MIX2
    h ^= _logical_shift(h, 27)
    if workers & (workers - 1) == 0:  # a power of two: the low bits, the same as the modulo (and 10x cheaper)
        return (h >> 1).bitwise_and_(workers - 1)
    return _logical_shift(h, 1) % workers


def shards(placement: str, by_default: bool, module: Any) -> bool:
    """Whether a strategy with ``table_placement=placement`` shards ``module``'s table across the workers
    (row-wise, "sharded", or whole tables spread over them, "table_wise").

    "auto" shards where the mode does by default (``by_default``: mode="sharding"), except a table
    with a ``max_rows`` cap: sharded, each worker would evict within its share of the cap, which is
    no longer the one-process math; such a table stays replicated unless "sharded" is asked for.
    """
    if placement != "auto":
        return placement in ("sharded", "table_wise")
    return by_default and module.lifecycle.max_rows is None


class TableShard:
    """One worker's part of a table module: the module's settings, with ``max_rows`` split over the workers.

    What :class:`~fleet.sparse.backends.LocalRows` reads of a table module, so that the shard's
    rows live in a table of their own while the module's own table stays empty.
    """

    def __init__(self, module: Any, workers: int, splits: int | None = None):
        """``splits``: the shares ``max_rows`` is split into (default ``workers``; 1 where one worker holds the
        whole table)."""
        splits = workers if splits is None else splits
        self.embedding_dim = module.embedding_dim
        self.initializer = module.initializer
        self.seed = module.seed
        self.optimizer_override = module.optimizer_override
        self.name = type(module).__name__
        config = module.lifecycle.to_config()
        cap = config.get("max_rows")
        if cap is not None and cap < splits:
            raise ValueError(
                f"{self.name}(max_rows={cap}) is sharded across {workers} workers, each holding max_rows // "
                f"{workers} rows: give max_rows >= {workers}, or keep the table replicated (table_placement)"
            )
        self.lifecycle = LifeCycle.from_config(config, shards=splits)


class ShardedRows:
    """A table module's rows sharded across the workers of ``group`` (see the module docstring).

    ``announce(what, module, width, lr, carry=0)``: called before each exchange of a training step
    (what: "pull" or "step"), where the strategy checks that every worker does the same (collective
    mode's lockstep), and returns every worker's ``carry``, by rank (with several tables, through shared
    memory, the announcement is the all-to-all's meeting and carries its segment generation); ``reduce_sum(values)`` sums a float64 vector over the workers (the
    strategy's ``all_reduce``).
    """

    def __init__(
        self,
        module: Any,
        group: Any,
        timeout_s: float,
        where: str,
        reduce_sum: Callable[[torch.Tensor], torch.Tensor],
        announce: Callable[..., list[int] | None] | None = None,
        diagnose: Callable[[], str | None] | None = None,
        local: Any = None,
    ):
        self._module = weakref.ref(module)
        self.group = group
        self.workers = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.timeout_s = timeout_s
        self.where = where
        self._reduce_sum = reduce_sum
        self._announce = announce
        self.diagnose = diagnose
        # gloo moves CPU tensors; NCCL only CUDA ones (the table itself stays in host memory)
        nccl = dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        #: the job's shared-memory all-to-all (CPU workers all on one host), else None: the process group
        self.shared = local if self.device.type == "cpu" else None
        self.shard = TableShard(module, self.workers, self._splits())
        self.local = LocalRows(self.shard)
        """This worker's rows: a table of its own (the module's ``local`` table stays empty)."""
        #: this table's last pull together with others, as requester and as owner (:mod:`sharded_many`): a step
        #: of the same ids reuses its grouping, and its ids need not travel
        self.pulled: sharded_many.Pulled | None = None
        self.served: sharded_many.Served | None = None
        self._adopt(module)

    def _adopt(self, module: Any) -> None:
        """Rows the module's own table took before it was sharded (load_rows, a state dict): keep the owned ones."""
        pending = module.local.pending_rows()
        if pending is None:
            return
        self.local.load_rows_state(self._owned(pending), replace=False)
        empty = {"ids": torch.empty(0, dtype=torch.int64), "rows": torch.empty(0, module.embedding_dim)}
        module.local.load_rows_state(empty, replace=True)

    # ------------------------------------------------------------------ routing
    def _what(self, action: str) -> str:
        module = self._module()
        name = type(module).__name__ if module is not None else "SparseEmbedding"
        return f"{action} the rows of a {name}(dim {self.shard.embedding_dim}) sharded across the workers"

    def owners(self, ids: torch.Tensor) -> torch.Tensor:
        """The worker holding each id's row."""
        return owner(ids, self.workers)

    def _splits(self) -> int:
        """How many shares ``max_rows`` is split into: one per worker, each holding a share of the rows."""
        return self.workers

    #: whether every table of a group has the same owners for the same ids (one hash routes them all)
    same_owners = True

    #: the worker whose share keeps the table-wide counts in ``state_dict`` (each share keeps its own otherwise)
    counts_holder = 0

    def _route(self, ids: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """(the order that groups ``ids`` by owner, how many go to each worker)."""
        owners = self.owners(ids)
        order = torch.argsort(owners, stable=True)
        sends = torch.bincount(owners, minlength=self.workers)
        return order, sends.tolist()

    def exchange(
        self, send: torch.Tensor, sizes: list[int], header: torch.Tensor | None, recv_sizes: list[int] | None, what: str
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
        """:func:`fleet.collective.all_to_all.blocks` among the workers: shared memory on one host, else the
        process group. Received on the CPU (where the table lives)."""
        got, header_got, sizes_got = all_to_all.blocks(
            send.to(self.device), sizes, header, recv_sizes, self.group, self.timeout_s, what, self.diagnose,
            self.shared,
        )  # fmt: skip
        return got.cpu(), header_got, sizes_got

    def exchange_pieces(
        self,
        pieces: list[all_to_all.Piece],
        sizes: list[int],
        header: torch.Tensor | None,
        recv_sizes: list[int] | None,
        dtype: torch.dtype,
        what: str,
        announce: Callable[[int], list[int]] | None = None,
    ) -> tuple[list[torch.Tensor], list[list[int]] | None, list[int]]:
        """:meth:`exchange` of ``pieces`` (:meth:`SharedMemoryAllToAll.exchange_pieces`): worker ``i``'s block
        received is row ``i`` of the result, flat, a view valid until this worker's next exchange (copy what is
        kept); the headers received as lists (or None without a header). ``announce``: the lockstep's
        announcement of this exchange (carrying a value, returning every worker's): through shared memory it is
        the exchange's meeting, else it comes first."""
        if self.shared is not None and self.shared.usable:
            world = self.workers
            done = self.shared.exchange_pieces(
                pieces, sizes, header if header is not None else all_to_all._NO_HEADER.expand(world, 0), dtype, what,
                announce,
            )  # fmt: skip
            if done is not None:
                return done[0], (done[1] if header is not None else None), done[2]
        elif announce is not None:
            announce(0)
        send = torch.cat([all_to_all.piece_values(p) for p in pieces]) if pieces else torch.empty(0, dtype=dtype)
        got, header_got, sizes_got = self.exchange(send.to(dtype), sizes, header, recv_sizes, what)
        return list(got.split(sizes_got)), (header_got.tolist() if header_got is not None else None), sizes_got

    # ------------------------------------------------------------------ a training step
    def pull(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows for unique ``ids``, from their owners (every worker pulls, with its own ids)."""
        module = self._module()
        self.remember_pull(None, None)  # every worker pulls this table alone: a later step sends its ids
        if self._announce is not None:
            self._announce("pull", module, self.shard.embedding_dim, 0.0)
        what = self._what("pulling")
        order, sends = self._route(ids)
        asked, _, recvs = self.exchange(ids.index_select(0, order), sends, None, None, what)
        found = self.local.pull(asked)
        dim = self.shard.embedding_dim
        back, _, _ = self.exchange(found, [n * dim for n in recvs], None, [n * dim for n in sends], what)
        back = back.view(-1, dim).to(ids.device)
        out = torch.empty_like(back)
        out[order.to(back.device)] = back
        return out

    def remember_pull(self, pulled: sharded_many.Pulled | None, served: sharded_many.Served | None) -> None:
        """This table's last pull together with others (:func:`sharded_many.pull_together`), as requester and as
        owner, for a step of the same ids; None, None: forget it (every worker does, at the same pulls)."""
        self.pulled, self.served = pulled, served

    def batch_key(self) -> Any:
        """Tables of one process group pull together (:func:`fleet.sparse.backends.pull_many`)."""
        return self.group

    @classmethod
    def pull_together(cls, backends: list[ShardedRows], ids_list: list[torch.Tensor]) -> list[torch.Tensor]:
        """Rows for each backend's unique ids, every table's in one exchange (:mod:`fleet.collective.sharded_many`)."""
        first = backends[0]
        if len(backends) == 1:
            return [first.pull(ids_list[0])]
        width = sum(b.shard.embedding_dim for b in backends)
        return sharded_many.pull_together(
            backends, ids_list, first._what("pulling"), first._announcing("pull", width, 0.0)
        )

    pulls_ahead = False  # a step's rows must include the step before it: the forward pulls (prefetch_together)

    @classmethod
    def prefetch_together(cls, backends: list[ShardedRows], ids_list: list[torch.Tensor]) -> None:
        """No prefetch: a step's rows must include the step before it (the forward pulls)."""
        return None

    @classmethod
    def step_together(cls, items: list[tuple[ShardedRows, dict[str, Any]]], optimizer_class: type) -> None:
        """Step several tables (one optimizer's), every table's gradients in one exchange."""
        first = items[0][0]
        if len(items) == 1:
            first.step(optimizer_class, items[0][1])
            return
        announce = first._announcing("step", len(items), float(items[0][1]["lr"]))
        sharded_many.step_together(items, optimizer_class, first._what("sending gradients to"), announce)

    def _announcing(self, what: str, width: int, lr: float) -> Callable[[int], list[int]] | None:
        """The lockstep's announcement of an exchange of several tables (``what``: "pull" or "step"), for
        :meth:`exchange_pieces`: carrying a value, returning every worker's."""
        announce = self._announce
        if announce is None:
            return None
        module = self._module()
        return lambda value: announce(what, module, width, lr, value)

    def step(self, optimizer_class: type, group: dict[str, Any]) -> None:
        """Send this worker's row gradients to their owners; apply the ones received here (the mean over the
        workers, clicks summed), or skip the step on every owner where any worker's hold NaN or Inf."""
        ids, grads, lr, finite = self.gradients(group)
        block = sharded_many.with_id_bits(grads, ids)
        if self._announce is not None:
            self._announce("step", self._module(), block.shape[1], lr)
        what = self._what("sending gradients to")
        order, sends = self._route(ids)
        width = block.shape[1]
        flags = torch.full((self.workers, 1), 0 if finite else 1, dtype=torch.int64)
        got, bad, _ = self.exchange(
            block.index_select(0, order.to(block.device)), [n * width for n in sends], flags, None, what
        )
        assert bad is not None
        got = got.view(-1, width)
        self.apply_received(optimizer_class, group, sharded_many.id_bits(got), got[:, :-2], lr, bool(bad.any()))

    def gradients(self, group: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, float, bool]:
        """(ids, [gradients | clicks] as float32, lr, whether all is finite) of the forwards since the last step:
        what travels to the owners (the ids too, as :func:`~fleet.collective.sharded_many.with_id_bits` columns,
        unless the owners know them)."""
        ids, grads, clicks = self._module().take_gradients()
        lr = float(group["lr"])
        if self.shard.lifecycle.active:  # clicks ride along as one more column, summed, not averaged
            column = clicks.to(grads) if clicks is not None else grads.new_zeros(ids.numel())
            grads = torch.cat([grads, column.unsqueeze(1)], 1)
        finite = nonfinite.finite(grads, lr)
        return ids, grads.to(torch.float32), lr, finite

    def apply_received(
        self,
        optimizer_class: type,
        group: dict[str, Any],
        ids: torch.Tensor,
        grads: torch.Tensor,
        lr: float,
        any_bad: bool,
        divided: bool = False,
    ) -> None:
        """Apply the rows every worker sent here (``ids`` and their :meth:`gradients`, every sender's, in rank
        order; ``grads`` is this call's to change): the mean over the workers, once. ``divided``: the gradients
        (not the clicks) are divided by the number of workers already (the caller's copy out of the exchange did
        it). Every sender checked its own gradients and lr (``any_bad``: one found NaN or Inf): not again here."""
        dim = self.shard.embedding_dim
        if any_bad:
            nonfinite.refuse(f"sparse table of {self.shard.name}(dim {dim})", None, self.where)
            return
        if not divided:
            grads[:, :dim].div_(self.workers)
        self.local.apply(optimizer_class, group, ids, grads, lr, where=self.where, checked=True)

    # ------------------------------------------------------------------ the whole table (collectives)
    def num_rows(self) -> int:
        return int(self._reduce_sum(torch.tensor([float(self.local.num_rows())], dtype=torch.float64))[0])

    def shrink(self, threshold: float | None) -> int:
        gone = self.local.shrink(threshold)
        return int(self._reduce_sum(torch.tensor([float(gone)], dtype=torch.float64))[0])

    def export(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids, rows = self.local.export()
        state = self._gather({"ids": ids, "rows": rows}, {})
        return state["ids"], state["rows"]

    def rows_state(self) -> dict[str, Any]:
        """Every owner's rows with their per-row fields (gathered in bounded pieces) and the table's settings."""
        state = self.local.rows_state()
        header = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor) and k != "admission"}
        return self._gather({k: v for k, v in state.items() if isinstance(v, torch.Tensor)}, header)

    def load_rows_state(self, state: dict[str, Any], replace: bool) -> None:
        """Keep the rows this worker owns of ``state`` (every worker is given the same rows)."""
        self.local.load_rows_state(self._owned(state), replace)

    def _owned(self, state: dict[str, Any]) -> dict[str, Any]:
        ids = state["ids"]
        mine = self.owners(ids) == self.rank
        out = {k: v for k, v in state.items() if k != "admission"}  # a sketch counts every owner's ids
        for key, value in per_row_fields(state).items():
            out[key] = value[mine]
        out["ids"] = ids[mine]
        if "counts" in out and self.rank != self.counts_holder:  # the table-wide counts are held once
            out["counts"] = json.dumps({})
        return out

    # ------------------------------------------------------------------ gathering
    def _gather(self, fields: dict[str, torch.Tensor], header: dict[str, Any]) -> dict[str, Any]:
        """Every worker's ``fields`` (per-row tensors) concatenated, and the merged ``header``: each exchange
        carries at most PIECE_BYTES of rows per worker."""
        n = int(fields["ids"].numel())
        layout = {k: [str(v.dtype).removeprefix("torch."), list(v.shape[1:])] for k, v in fields.items()}
        text = json.dumps({"n": n, "layout": layout, "header": header}, sort_keys=True).encode()
        described = [json.loads(t) for t in self._all_gather_bytes(text)]
        keep = _common_fields(described)
        layouts = {key: next(d["layout"][key] for d in described if key in d["layout"]) for key in keep}
        piece = max(1, PIECE_BYTES // max(1, _row_bytes(layouts)))  # the same on every worker
        counts = [d["n"] for d in described]
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in keep}
        for start in range(0, max(counts), piece):
            # the piece's rows, as many as the most any worker has left (the same on every worker): a small table
            # is not padded to a whole piece (PIECE_BYTES per worker and field, across hosts too)
            rows = min(piece, max(counts) - start)
            for key in keep:
                block = _padded(fields.get(key), start, rows, *layouts[key])
                every = [torch.empty_like(block) for _ in range(self.workers)]
                self._all_gather(every, block, f"gathering the rows of a sharded table ({key})")
                for worker, got in enumerate(every):
                    parts[key].append(got[: max(0, min(piece, counts[worker] - start))])
        out: dict[str, Any] = _merged_header([d["header"] for d in described], self._module())
        for key in keep:
            out[key] = torch.cat(parts[key]) if parts[key] else _empty(*layouts[key])
        return out

    def _all_gather(self, every: list[torch.Tensor], block: torch.Tensor, what: str) -> None:
        every_on = [t.to(self.device) for t in every]
        work = dist.all_gather(every_on, block.to(self.device), group=self.group, async_op=True)
        all_to_all.finish(work, self.timeout_s, what, self.diagnose)
        for target, got in zip(every, every_on, strict=True):
            target.copy_(got)

    def _all_gather_bytes(self, data: bytes) -> list[bytes]:
        what = "describing the rows of a sharded table"
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.empty_like(size) for _ in range(self.workers)]
        self._all_gather(sizes, size, what)
        longest = max(int(s) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        every = [torch.empty_like(mine) for _ in range(self.workers)]
        self._all_gather(every, mine, what)
        return [bytes(t[: int(s)].tolist()) for t, s in zip(every, sizes, strict=True)]


def _row_bytes(layout: dict[str, list]) -> int:
    total = 0
    for dtype_name, shape in layout.values():
        count = 1
        for d in shape:
            count *= int(d)
        total += count * torch.empty(0, dtype=getattr(torch, dtype_name)).element_size()
    return total


def _common_fields(described: list[dict[str, Any]]) -> list[str]:
    """The per-row fields every worker holding rows has (a worker without rows may have no table yet)."""
    holding = [d for d in described if d["n"] > 0] or described
    keys = set(holding[0]["layout"])
    for d in holding[1:]:
        keys &= set(d["layout"])
    return ["ids", "rows"] + sorted(keys - {"ids", "rows"})


def _padded(mine: torch.Tensor | None, start: int, piece: int, dtype_name: str, shape: list[int]) -> torch.Tensor:
    block = torch.zeros(piece, *shape, dtype=getattr(torch, dtype_name))
    if mine is not None:
        chunk = mine[start : start + piece]
        block[: chunk.shape[0]] = chunk
    return block


def _empty(dtype_name: str, shape: list[int]) -> torch.Tensor:
    return torch.empty(0, *shape, dtype=getattr(torch, dtype_name))


def _merged_header(headers: list[dict[str, Any]], module: Any) -> dict[str, Any]:
    """One table's settings from every owner's: counts summed, the latest clock, the module's whole life cycle."""
    held = [h for h in headers if "optimizer" in h]
    if not held:
        return {}
    out = dict(held[0])
    out["clock"] = max(int(h.get("clock", 0)) for h in held)
    out["next_expiry"] = max(int(h.get("next_expiry", 0)) for h in held)
    counts: dict[str, int] = {}
    for h in held:
        for key, value in json.loads(h.get("counts", "{}")).items():
            counts[key] = counts.get(key, 0) + int(value)
    out["counts"] = json.dumps(counts, sort_keys=True)
    if module is not None:  # the whole table's cap, not one owner's share
        out["lifecycle"] = json.dumps(module.lifecycle.to_config(), sort_keys=True)
    return out


def refuse_join(what: str) -> FleetError:
    """``fleet.join()`` with sharded tables: a finished worker would have to keep serving its rows."""
    return FleetError(
        f"fleet.join() (uneven inputs) is not supported yet with sparse tables sharded across the workers ({what}): "
        "a worker whose loop ended still owns rows the others pull and update. Give every worker the same number "
        "of batches (fleet.distributed_loader does), or keep the tables replicated: "
        "DistributedStrategy(table_placement='replicated')."
    )
