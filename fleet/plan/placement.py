"""Where the tables and the dense layers should live: fleet.plan's placement recommendation.

The mode table (:mod:`fleet.plan.model`) answers "how does each mode scale"; this answers
"for this model on this cluster, which placement" (docs/modes.md, "Where the tables live"):

| candidate | strategy | a worker holds |
|---|---|---|
| ``replicated`` | ``mode="collective", table_placement="replicated"`` | every row, the dense layers |
| ``sharded`` | ``mode="collective", table_placement="sharded"`` | 1/R of the rows, the dense layers |
| ``table_wise`` | ``mode="collective", table_placement="table_wise"`` | whole tables (about 1/R of them), the dense layers |
| ``sharding`` | ``mode="sharding"`` | 1/R of the rows, 1/R of the dense layers (FSDP2) |
| ``ps_<update>`` | ``mode="ps", update=...`` | no rows, the dense values (the servers own them) |
| ``ps_<update>_dense_ar`` | ``... dense_placement="allreduce"`` | no rows, the dense layers |

Per step of one worker, with U_t the unique ids of its batch in table t, d_t its width,
Sp = sum U_t (8 + 4 d_t) the sparse bytes one way, D the dense bytes and R workers (the
collective terms are :class:`~fleet.plan.model.Model`'s):

- **replicated**: the collective step (compute, wait for the slowest, ring all-reduce of D,
  the rows all-gathered: (R-1) x (latency + Sp / bandwidth)), plus applying the other workers'
  (R-1) x U rows, since every replica applies the union's update.
- **sharded**: the same without the all-gather: 5 all-to-alls a step (counts, ids, rows in the
  forward; counts, gradients at the step), each (R-1) latencies, carrying 2 (R-1)/R x Sp;
  an owner looks up and applies about U rows a step, as a local table does; routing each of the
  U ids (grouping, the row gathered and placed, its gradient likewise) costs about two lookups of
  an existing row.
- **table_wise**: each table whole on one holder; a collection's bags go to the holders and one
  pooled vector per bag and feature comes back, its gradient at the step (as many rounds as
  sharded, carrying (R-1)/R x (8 bytes per id and per bag, 2 x 4 x batch x the pooled width)); the holder of the
  largest share of the tables' work (the widest tables spread evenly, one table never split)
  does R x that share of the sparse work where an even split would do 1/R each; copying each
  pooled vector and its gradient costs about two lookups of an existing row.
- **sharding**: sharded tables, and FSDP2's all-gather (twice: forward, backward) and
  reduce-scatter of D: 1.5 ring all-reduces' bytes.
- **PS**: :class:`~fleet.plan.model.Model`'s PS sync / async / geo; with the dense layers
  all-reduced the servers carry only the rows and the workers add a ring all-reduce of D,
  which is a barrier: async then waits for the slowest worker too.

Where the calibration measured a stand-in of the script's tables alone and placed each way on 2
workers (:mod:`fleet.plan.table_steps`), a collective candidate is charged that measured difference
instead of the tables' terms above (:func:`measured_extra_s`): on W6 the rates saw a sixth of what
routing rows costs a worker.

Memory per worker (and per server) rules candidates out: a table holds rows x dim x bytes x the
optimizer's state multiplier (values included: SGD 1, Adagrad 2, Adam 3) plus its id index
(:data:`INDEX_BYTES_PER_ROW`). An update that is not synchronous is ruled out when the
workload needs one process's math (``sync_required``). Of what is left, the fastest by samples/s
wins; a synchronous candidate within :data:`PREFER_SYNC` of a faster stale one is preferred
(the same speed and one process's math).

Pure functions of their inputs: no torch, no processes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fleet.plan.calibration import Calibration, Link
from fleet.plan.model import BUCKET_BYTES, Model, Setup, ring_allreduce_s

INDEX_BYTES_PER_ROW = 16  # a SparseTable's id index: the int64 id and its int64 slot
PREFER_SYNC = 0.10  # a sync candidate this close to the fastest stale one wins (one process's math)
TIE = 0.05  # predictions closer than this are within the model's resolution: the tie-break decides
STATE_MULTIPLIER = {"sgd": 1.0, "momentum": 2.0, "adagrad": 2.0, "rowwise_adagrad": 1.0, "adam": 3.0, "adamw": 3.0}
CANDIDATES = (
    "replicated",
    "sharded",
    "table_wise",
    "sharding",
    "ps_sync",
    "ps_sync_dense_ar",
    "ps_async",
    "ps_async_dense_ar",
    "ps_geo",
)
STRATEGIES = {
    "replicated": 'DistributedStrategy(mode="collective", table_placement="replicated")',
    "sharded": 'DistributedStrategy(mode="collective", table_placement="sharded")',
    "table_wise": 'DistributedStrategy(mode="collective", table_placement="table_wise")',
    "sharding": 'DistributedStrategy(mode="sharding")',
    "ps_sync": 'DistributedStrategy(mode="ps", update="sync")',
    "ps_sync_dense_ar": 'DistributedStrategy(mode="ps", update="sync", dense_placement="allreduce")',
    "ps_async": 'DistributedStrategy(mode="ps", update="async")',
    "ps_async_dense_ar": 'DistributedStrategy(mode="ps", update="async", dense_placement="allreduce")',
    "ps_geo": 'DistributedStrategy(mode="ps", update="geo", k_steps=100)',
}
LABELS = {
    "replicated": "tables replicated",
    "sharded": "tables sharded",
    "table_wise": "tables sharded table-wise",
    "sharding": "sharding (tables and dense sharded)",
    "ps_sync": "servers, sync",
    "ps_sync_dense_ar": "servers, sync, dense all-reduced",
    "ps_async": "servers, async",
    "ps_async_dense_ar": "servers, async, dense all-reduced",
    "ps_geo": "servers, geo (k=100)",
}
STALE = ("ps_async", "ps_async_dense_ar", "ps_geo")
STALE_NOTE = "stale (async) or local (geo) updates; one process's math is required"
SHARDED_EXCHANGES = 5  # forward: counts, ids, rows; step: counts, gradients with their ids


class PlacementError(ValueError):
    """A placement question that cannot be answered as asked (the message names the input at fault)."""


@dataclass(frozen=True)
class Table:
    """One embedding table: its size and how many of its rows one worker's batch touches per step."""

    rows: int
    dim: int
    ids_per_step: float
    """Unique ids of one worker's batch per step (estimate from a sample batch)."""
    name: str = ""
    value_bytes: int = 4
    features: int = 1
    """Features looked up in the table (each pools one vector per sample: table-wise, what travels back)."""
    lookups_per_step: float = 0.0
    """Ids of one worker's batch per step, duplicates included (0: as ``ids_per_step``): table-wise, what travels."""

    def __post_init__(self) -> None:
        if self.rows < 1 or self.dim < 1 or self.ids_per_step < 0 or self.value_bytes < 1:
            raise PlacementError(
                f"table {self.name or '?'}: rows={self.rows}, dim={self.dim}, ids_per_step={self.ids_per_step}, "
                f"value_bytes={self.value_bytes}: rows, dim and value_bytes must be >= 1 and ids_per_step >= 0"
            )
        if self.features < 1 or self.lookups_per_step < 0:
            raise PlacementError(
                f"table {self.name or '?'}: features={self.features}, lookups_per_step={self.lookups_per_step}: "
                "features must be >= 1 and lookups_per_step >= 0"
            )

    def bag_bytes(self, batch: int) -> float:
        """Table-wise, one direction of one step's traffic for this table: the ids and the bags' lengths (int64)
        to the holder; back, the pooled vectors (and at the step their gradients): ``batch`` x features x dim."""
        ids = self.lookups_per_step or self.ids_per_step
        return 8 * (ids + batch * self.features), batch * self.features * self.dim * self.value_bytes

    @property
    def value_total(self) -> float:
        """Bytes of the rows' values alone."""
        return self.rows * self.dim * self.value_bytes

    def bytes(self, state: float) -> float:
        """Bytes the whole table takes with ``state`` x the values (optimizer state included) and its id index."""
        return self.value_total * state + self.rows * INDEX_BYTES_PER_ROW

    @property
    def step_bytes(self) -> float:
        """One direction of one step's sparse traffic: the unique ids (int64) and their rows."""
        return self.ids_per_step * (8 + self.dim * self.value_bytes)


@dataclass(frozen=True)
class Workload:
    """The model's side of the question: its tables, its dense layers, its optimizer and its tolerance."""

    tables: tuple[Table, ...]
    dense_bytes: int
    """Bytes of the dense parameters (their gradient is the same size)."""
    state: float = 1.0
    """The optimizer's bytes per value byte, values included (SGD 1, Adagrad 2, Adam 3)."""
    dense_state: float | None = None
    """The same for the dense optimizer (None: ``state``)."""
    sync_required: bool = True
    """One process's math is required: stale (async) and local (geo) updates are ruled out."""
    collection: bool = True
    """The tables are one :class:`~fleet.nn.SparseFeatureCollection`: sharded, they share one exchange a step."""
    dense_units: int = 3
    """``mode="sharding"``: the modules FSDP2 shards as units (each a gather and a reduce-scatter per step)."""

    @property
    def ids_per_step(self) -> float:
        return sum(t.ids_per_step for t in self.tables)

    @property
    def sparse_bytes(self) -> float:
        return sum(t.step_bytes for t in self.tables)

    def table_bytes(self) -> float:
        return sum(t.bytes(self.state) for t in self.tables)

    def dense_total(self) -> float:
        return self.dense_bytes * (self.state if self.dense_state is None else self.dense_state)


@dataclass(frozen=True)
class Cluster:
    """The cluster's side: how many workers and servers, and the memory each may use."""

    workers: int
    worker_memory_bytes: float
    workers_per_host: int = 1
    servers: int = 0
    """Parameter servers in all (0: the PS candidates are left out, with the reason)."""
    server_memory_bytes: float | None = None
    """None: as much as a worker."""
    background: float = 0.0
    """Busy processes besides the job on every host (0: dedicated hosts; a shared host: the calibration's)."""

    def __post_init__(self) -> None:
        if self.workers < 1 or self.workers_per_host < 1 or self.servers < 0 or self.worker_memory_bytes <= 0:
            raise PlacementError(
                f"cluster: workers={self.workers}, workers_per_host={self.workers_per_host}, servers={self.servers}, "
                f"worker_memory_bytes={self.worker_memory_bytes}: workers >= 1, servers >= 0, memory > 0"
            )

    @property
    def hosts(self) -> int:
        return math.ceil(self.workers / self.workers_per_host)


@dataclass
class Candidate:
    """One placement, predicted; ``ruled_out`` says why it cannot be used (then no time is predicted)."""

    name: str
    strategy: str
    worker_bytes: float
    server_bytes: float = 0.0
    step_s: float | None = None
    samples_per_s: float | None = None
    parts: dict[str, float] = field(default_factory=dict)
    ruled_out: str | None = None

    @property
    def label(self) -> str:
        return LABELS[self.name]


@dataclass
class Recommendation:
    best: Candidate
    reason: str
    candidates: list[Candidate]


def gb(n: float) -> str:
    """Bytes as the plan prints them: GB above 1 GB, MB above 1 MB, else KB."""
    if n >= 1e9:
        return f"{n / 1e9:,.1f} GB"
    if n >= 1e6:
        return f"{n / 1e6:,.1f} MB"
    return f"{n / 1e3:,.0f} KB"


def parse_size(text: str) -> float:
    """``16GB``, ``512MB``, ``2.5G``, ``1000000`` (bytes) -> bytes (powers of 1,000, as the plan prints them)."""
    units = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "M": 1e6, "MB": 1e6, "G": 1e9, "GB": 1e9, "T": 1e12, "TB": 1e12}
    t = text.strip().upper().replace(" ", "")
    number = t.rstrip("KMGTB")
    try:
        value = float(number) * units[t[len(number) :]]
    except (ValueError, KeyError):
        raise PlacementError(f"memory size {text!r}: give a number with an optional unit, e.g. 16GB or 512MB") from None
    if value <= 0:
        raise PlacementError(f"memory size {text!r} must be more than 0")
    return value


def parse_tables(text: str) -> tuple[Table, ...]:
    """``10000000x16:1500,100000x64:1200``: each table's rows x dim and its unique ids per worker-step."""
    tables = []
    for i, part in enumerate(p for p in text.split(",") if p.strip()):
        try:
            size, ids = part.split(":")
            rows, dim = size.lower().split("x")
            tables.append(Table(int(rows), int(dim), float(ids), name=f"table {i}"))
        except ValueError as error:
            if isinstance(error, PlacementError):
                raise
            raise PlacementError(
                f"--tables {part!r}: give each table as ROWSxDIM:IDS (rows, width, unique ids per worker-step), "
                "e.g. 10000000x16:1500"
            ) from None
    if not tables:
        raise PlacementError(f"--tables {text!r} names no table; e.g. --tables 10000000x16:1500,100000x64:1200")
    return tuple(tables)


def state_multiplier(optimizer: str) -> float:
    """The bytes an optimizer keeps per value byte, values included (unknown ones: as Adam, the most)."""
    return STATE_MULTIPLIER.get(optimizer.lower().replace("-", "_"), 3.0)


def calibration_for(cal: Calibration, work: Workload) -> Calibration:
    """``cal`` with the workload's sparse traffic: all tables' ids per step, at the width that gives their bytes."""
    rows = work.ids_per_step
    dim = round(max(0.0, work.sparse_bytes / rows - 8) / 4) if rows else 0
    new = min(cal.sparse_new_rows, rows)
    update: dict[str, object] = {"sparse_rows": rows, "sparse_dim": dim, "sparse_new_rows": new}
    if cal.sparse_pull_rows_s and cal.sparse_create_rows_s:
        # What moves to the servers is the rows' lookup and creation, at the server's measured rates; the
        # probe's time inside the embedding modules also holds the pooling, which stays on the workers.
        lookup = new / cal.sparse_create_rows_s + (rows - new) / cal.sparse_pull_rows_s
        update["sparse_local_s"] = min(cal.sparse_local_s, lookup)
    return cal.model_copy(update=update)


def _dense_on_workers(cal: Calibration) -> Calibration:
    """The PS calibration without the dense layers' traffic and server work (``dense_placement="allreduce"``)."""
    d = cal.dense_bytes
    if cal.ps is None or not d:
        return cal.model_copy(update={"dense_bytes": 0})
    dense_io = 2 * d / cal.ps.bandwidth_Bps + (d / cal.dense_apply_Bps if cal.dense_apply_Bps else 0.0)
    update: dict[str, object] = {"dense_bytes": 0}
    if cal.ps_step_s is not None:
        # a replayed step carried the dense push and pull too; the rows' part stays (at least their pull)
        floor = cal.ps_sparse_pull_s or 0.0
        update["ps_step_s"] = max(floor, cal.ps_step_s - dense_io)
    if cal.ps_server_step_s is not None:
        update["ps_server_step_s"] = max(0.1 * cal.ps_server_step_s, cal.ps_server_step_s - dense_io)
    return cal.model_copy(update=update)


def memory(name: str, work: Workload, cluster: Cluster) -> tuple[float, float]:
    """(bytes per worker, bytes per server) of a candidate."""
    r, s = cluster.workers, max(1, cluster.servers)
    tables, dense = work.table_bytes(), work.dense_total()
    if name == "replicated":
        return tables + dense, 0.0
    if name == "sharded":
        return tables / r + dense, 0.0
    if name == "table_wise":  # whole tables: at least the largest one, at least an even share
        return max(max(t.bytes(work.state) for t in work.tables), tables / r) + dense, 0.0
    if name == "sharding":
        return (tables + dense) / r, 0.0
    if name.endswith("_dense_ar"):
        return dense, tables / s
    # PS, dense on the servers: a worker keeps the dense values it pulls, the servers the rest
    return float(work.dense_bytes), (tables + dense) / s


def sparse_work_s(cal: Calibration) -> float:
    """One worker's lookups and updates of its rows per step: measured (``sparse_local_s``), else from the
    tables' row rates."""
    if cal.sparse_local_s:
        return cal.sparse_local_s
    rows = cal.sparse_rows
    return sum(rows / rate for rate in (cal.sparse_pull_rows_s, cal.sparse_apply_rows_s) if rate)


def largest_share(work: Workload, workers: int) -> float:
    """Table-wise, the share of the tables' work (ids x width) on the busiest holder: at least the largest
    table's (a table is never split), at least an even share."""
    weights = [max(t.lookups_per_step or t.ids_per_step, 1e-9) * t.dim * t.features for t in work.tables]
    return max(max(weights), sum(weights) / workers) / sum(weights)


def _predict(
    name: str, model: Model, cal: Calibration, work: Workload, cluster: Cluster, batch: int | None = None
) -> tuple[float, dict]:
    r = cluster.workers
    setup = Setup(
        workers=r,
        servers=max(1, cluster.servers),
        workers_per_host=cluster.workers_per_host,
        background=cluster.background,
    )
    if name in ("replicated", "sharded", "sharding", "table_wise"):
        _, _, collective = model._collective(setup)
        stretch = model.stretch(setup)
        link = model.link(setup, cal.allreduce, stretch)
        ring = collective["all-reduce bandwidth"] * (1.5 if name == "sharding" else 1.0)
        parts = {"compute": collective["compute"], "wait for the slowest": collective["wait for the slowest"]}
        parts["dense all-reduce bytes"] = ring
        measured = measured_extra_s(name, cal, r)
        if r > 1:
            rounds = sync_rounds(name, work, cal, tables=measured is None)
            parts[f"{rounds} synchronizing rounds"] = rounds * (r - 1) * round_s(cal, link, setup, stretch)
        if measured is not None:
            # the tables' exchanges, routing and holders' work as measured on a stand-in of them (rounds included)
            parts["the tables sharded (measured on 2 workers)"] = measured
        elif name == "replicated" and r > 1:
            parts["rows all-gathered"] = (r - 1) * work.sparse_bytes / link.bandwidth_Bps
            if cal.sparse_apply_rows_s:
                # every replica applies the union's rows: the others' (R-1) x U besides its own
                parts["apply the others' rows"] = (r - 1) * cal.sparse_rows / cal.sparse_apply_rows_s * stretch
        elif name == "table_wise" and r > 1:
            ids, pooled = (
                sum(x) for x in zip(*(t.bag_bytes(batch or cal.batch or 1) for t in work.tables), strict=True)
            )
            parts["bags to their holders, pooled vectors back"] = (r - 1) / r * (ids + 2 * pooled) / link.bandwidth_Bps
            # the busiest holder does r x its share of the tables' work, where an even split does 1/r each
            uneven = r * largest_share(work, r) - 1
            parts["the busiest holder's extra sparse work"] = uneven * sparse_work_s(cal) * stretch
            if cal.sparse_pull_rows_s:
                # each pooled vector, and its gradient, copied into and out of the exchange
                vectors = (batch or cal.batch or 1) * sum(t.features for t in work.tables)
                parts["copy the pooled vectors"] = 2 * vectors / cal.sparse_pull_rows_s * stretch
        elif r > 1:
            parts["rows to and from their owners"] = 2 * (r - 1) / r * work.sparse_bytes / link.bandwidth_Bps
            if cal.sparse_pull_rows_s:
                # per unique id: grouped by owner, its row gathered into the exchange and placed, its gradient
                # likewise at the step: about two lookups of an existing row (W6: a third of a sharded worker's CPU)
                parts["route the rows by id"] = 2 * cal.sparse_rows / cal.sparse_pull_rows_s * stretch
        return sum(parts.values()), parts
    dense_ar = name.endswith("_dense_ar")
    mode = name.removesuffix("_dense_ar")
    if not dense_ar:
        p = model.predict(mode, setup)
        parts = dict(p.parts)
        if mode in ("ps_sync", "ps_backup") and r > 1 and cal.ps_step_s is not None:
            # the replayed step had no peer to wait for: the servers' barrier is one more synchronizing round
            stretch = model.stretch(setup)
            parts["the step's barrier"] = (r - 1) * round_s(
                cal, model.link(setup, cal.allreduce, stretch), setup, stretch
            )
        return sum(parts.values()), parts
    rows_only = Model(_dense_on_workers(cal))
    p = rows_only.predict(mode, setup)
    parts = dict(p.parts)
    stretch = model.stretch(setup)
    link = model.link(setup, cal.allreduce, stretch)
    bytes_s = ring_allreduce_s(r, cal.dense_bytes, link) - 2 * (r - 1) * link.latency_s
    parts["dense all-reduce"] = bytes_s + (r - 1) * round_s(cal, link, setup, stretch) if r > 1 else 0.0
    if mode == "ps_async" and r > 1:
        # the all-reduce is a barrier: the async workers wait for the slowest of them every step
        comp = cal.step_dist
        parts["wait for the slowest"] = (comp.expected_max(r) - comp.mean) * stretch
    return sum(parts.values()), parts


def measured_extra_s(name: str, cal: Calibration, workers: int) -> float | None:
    """What sharding the tables adds to a worker's step, from the calibration's stand-in of them
    (:mod:`fleet.plan.table_steps`, 2 workers): its step sharded less its step alone. ``sharding`` shards
    rows as ``sharded`` does. None where not measured (the model's estimate from rates is used).

    Measured for 2 workers: for R the part that grows with the share of ids sent elsewhere, (R-1)/R, is
    scaled from its 1/2 (an approximation: the exchanges' rounds grow with R-1, the routing does not)."""
    steps = cal.table_steps_s
    key = "sharded" if name == "sharding" else name
    if workers < 2 or key not in steps or "local" not in steps:
        return None
    return max(0.0, steps[key] - steps["local"]) * (2 * (workers - 1) / workers)


def sync_rounds(name: str, work: Workload, cal: Calibration, tables: bool = True) -> int:
    """Synchronizing collectives per step of a collective candidate (each waits for every worker).

    The lockstep header and one all-reduce per 25 MB bucket of dense gradients; replicated tables:
    per table an announcement and three all-gathers (counts, ids, gradients); sharded tables: per
    exchange group (one :class:`~fleet.nn.SparseFeatureCollection`, or each table) two announcements
    and five all-to-alls (table-wise on the process group as well: the bags with their counts, the
    pooled vectors, their gradients with their counts); sharding: FSDP2's all-gather (forward, backward) and reduce-scatter per unit.
    """
    buckets = max(1, math.ceil(work.dense_bytes / BUCKET_BYTES)) if work.dense_bytes else 0
    rounds = 1 + buckets
    groups = 1 if work.collection else len(work.tables)
    if name == "replicated":
        return rounds + (4 * len(work.tables) if tables else 0)
    if tables:  # (False: the tables' own rounds are in a measured step, :func:`measured_extra_s`)
        rounds += (2 + SHARDED_EXCHANGES) * groups
    if name == "sharding":
        rounds += 3 * work.dense_units - buckets  # FSDP2 replaces the bucketed all-reduce
    return rounds


def round_s(cal: Calibration, link: Link, setup: Setup, stretch: float) -> float:
    """One synchronizing round between two workers: measured (scheduling waits included) or 2 latencies."""
    if cal.round_s is None:
        return 2 * link.latency_s
    if cal.allreduce.loopback and setup.hosts == 1:
        return cal.round_s * stretch  # processes sharing the cores wait longer for each other
    return cal.round_s


def _ruled_out(name: str, worker_b: float, server_b: float, work: Workload, cluster: Cluster, cal: Calibration):
    if name.startswith("ps_") and cluster.servers < 1:
        return "no servers in this cluster (give --servers)"
    if name.startswith("ps_") and cal.ps is None:
        return "no parameter-server measurements in the calibration"
    if name in STALE and work.sync_required:
        return STALE_NOTE
    if worker_b > cluster.worker_memory_bytes:
        what = {
            "replicated": "tables and dense layers",
            "sharded": "1/R of the tables and the dense layers",
            "table_wise": "the largest table (or 1/R of them) and the dense layers",
        }
        return (
            f"{what.get(name, 'its share')} {gb(worker_b)} per worker do not fit in {gb(cluster.worker_memory_bytes)}"
        )
    server_mem = cluster.server_memory_bytes or cluster.worker_memory_bytes
    if name.startswith("ps_") and server_b > server_mem:
        return f"the tables' share {gb(server_b)} per server does not fit in {gb(server_mem)}"
    return None


def candidates(
    cal: Calibration, work: Workload, cluster: Cluster, batch: int | None = None, only: tuple[str, ...] = CANDIDATES
) -> list[Candidate]:
    """Every candidate placement (of ``only``): memory, and step time and samples/s where it can run."""
    unknown = [n for n in only if n not in CANDIDATES]
    if unknown:
        raise PlacementError(f"unknown placements {unknown}; the plan knows {', '.join(CANDIDATES)}")
    cal = calibration_for(cal, work)
    model = Model(cal)
    batch = batch or cal.batch
    out = []
    for name in only:
        worker_b, server_b = memory(name, work, cluster)
        why_not = _ruled_out(name, worker_b, server_b, work, cluster, cal)
        step, parts, rate = None, {}, None
        if why_not is None or why_not == STALE_NOTE:
            # stale candidates are still predicted: the user sees what the tolerance would buy
            step, parts = _predict(name, model, cal, work, cluster, batch)
            rate = cluster.workers * batch / step if batch else None
        out.append(Candidate(name, STRATEGIES[name], worker_b, server_b, step, rate, parts, why_not))
    return out


def _family(name: str) -> str:
    """Where the tables live: on every worker, split across the workers, or on the servers."""
    return "replicated" if name == "replicated" else ("servers" if name.startswith("ps_") else "split")


def _why(best: Candidate, others: list[Candidate], work: Workload, cluster: Cluster, cal: Calibration) -> str:
    """One line: what the winner saves against the best placement of the tables elsewhere, and any tie."""
    if not others:
        return f"{best.label}: the only candidate that fits and keeps the updates this workload needs"
    elsewhere = next((c for c in others if _family(c.name) != _family(best.name)), None)
    clauses = [] if elsewhere is None else [_against(best, elsewhere, work, cluster, cal)]
    nearest = others[0]
    if nearest is not elsewhere and (elsewhere is None or nearest.step_s <= (1 + TIE) * best.step_s):
        clauses.append(_against(best, nearest, work, cluster, cal))
    return f"{best.label}: " + "; ".join(clauses)


def _against(best: Candidate, other: Candidate, work: Workload, cluster: Cluster, cal: Calibration) -> str:
    """Why ``best`` over ``other``: a tie within the model's resolution, or the costs that differ."""
    r, sparse = cluster.workers, work.sparse_bytes
    gain = other.step_s / best.step_s - 1
    if abs(gain) < TIE:
        edge = []
        if best.worker_bytes < 0.9 * other.worker_bytes:
            edge.append(f"{gb(best.worker_bytes)} per worker against {gb(other.worker_bytes)}")
        if other.name.startswith("ps_") and not best.name.startswith("ps_"):
            edge.append("no servers to run")
        tie = f"as fast as {other.label} within the model's resolution ({gain:+.1%} step time)"
        return tie + (f", with {' and '.join(edge)}" if edge else "")
    if gain < 0:  # only a sync candidate is chosen over a faster one: a stale one within PREFER_SYNC
        return f"{-gain:.0%} slower than {other.label}, whose updates are stale: one process's math is worth that"
    rounds = {
        n: sync_rounds(n, work, cal, tables=measured_extra_s(n, cal, r) is None)
        for n in ("replicated", "sharded", "sharding", "table_wise")
    }
    extra = {n: measured_extra_s(n, cal, r) for n in (best.name, other.name)}
    if extra[best.name] is not None and extra[other.name] is not None:
        how = (
            f"the tables' exchanges add {extra[best.name] * 1e3:.1f} ms a step against {extra[other.name] * 1e3:.1f} "
            "ms (measured on a stand-in of the tables, 2 workers)"
        )
    elif best.name.startswith("ps_") and extra[other.name] is not None:
        how = (
            f"the servers take the rows' lookups and updates off the workers ({work.ids_per_step:,.0f} ids a step) "
            f"and spare the tables' exchanges among them ({extra[other.name] * 1e3:.1f} ms a step, measured)"
        )
    elif best.name == "table_wise" and other.name in ("sharded", "sharding", "replicated"):
        ids, pooled = (sum(x) for x in zip(*(t.bag_bytes(cal.batch or 1) for t in work.tables), strict=True))
        how = (
            f"{rounds['table_wise']} synchronizing rounds with the bags to their holders and pooled vectors back "
            f"({gb((r - 1) / r * (ids + 2 * pooled))} a step) beat {rounds[other.name]} rounds"
            + (f" with {gb(2 * (r - 1) / r * sparse)} of rows" if other.name != "replicated" else "")
            + f", and the busiest holder has {largest_share(work, r):.0%} of the tables' work"
        )
    elif best.name in ("sharded", "sharding") and other.name == "table_wise":
        how = (
            f"every table is split evenly; table-wise, one worker would hold {largest_share(work, r):.0%} of the "
            "tables' work (a table is never split)"
        )
    elif best.name in ("sharded", "sharding") and other.name == "replicated":
        how = (
            f"{rounds[best.name]} synchronizing rounds and {gb(2 * (r - 1) / r * sparse)} of rows a step beat "
            f"{rounds['replicated']} rounds, {gb((r - 1) * sparse)} of rows all-gathered and the other workers' "
            f"{(r - 1) * work.ids_per_step:,.0f} rows applied"
        )
    elif best.name == "replicated" and other.name in ("sharded", "sharding", "table_wise"):
        how = (
            f"{gb(work.table_bytes())} of tables fit every worker, and {rounds['replicated']} synchronizing rounds "
            f"with {gb((r - 1) * sparse)} of rows all-gathered beat {rounds[other.name]} rounds to the owners"
        )
    elif best.name.startswith("ps_") and not other.name.startswith("ps_"):
        how = (
            f"the servers take the rows' lookups and updates off the workers ({work.ids_per_step:,.0f} ids a step) "
            f"and spare the {rounds[other.name]} synchronizing rounds of {other.label}"
        )
    elif not best.name.startswith("ps_") and other.name.startswith("ps_"):
        how = "the rows' round trips to the servers cost more than exchanging them among the workers"
    elif best.name.endswith("_dense_ar") and not other.name.endswith("_dense_ar"):
        how = f"the {gb(work.dense_bytes)} of dense layers are all-reduced instead of pushed and pulled at the servers"
    elif other.name.endswith("_dense_ar") and not best.name.endswith("_dense_ar"):
        how = f"pushing and pulling {gb(work.dense_bytes)} of dense layers at the servers beats all-reducing them"
    else:
        how = "by the calibrated costs"
    return f"{gain:.0%} faster than {other.label}: {how}"


def recommend(
    cal: Calibration, work: Workload, cluster: Cluster, batch: int | None = None, only: tuple[str, ...] = CANDIDATES
) -> Recommendation:
    """The fastest placement (of ``only``) that fits and keeps the updates the workload needs, and one line on why."""
    if not work.tables:
        raise PlacementError("the workload has no embedding tables: there is no table placement to choose")
    cands = candidates(cal, work, cluster, batch, only)
    usable = sorted((c for c in cands if c.ruled_out is None), key=lambda c: c.step_s or math.inf)
    if not usable:
        reasons = "; ".join(f"{c.name}: {c.ruled_out}" for c in cands)
        raise PlacementError(f"no placement fits this model on this cluster: {reasons}")
    best = usable[0]
    if best.name in STALE:
        sync = [c for c in usable if c.name not in STALE]
        if sync and sync[0].step_s <= (1 + PREFER_SYNC) * best.step_s:
            best = sync[0]
    tied = [c for c in usable if c.step_s <= (1 + TIE) * best.step_s and (c.name in STALE) == (best.name in STALE)]
    if len(tied) > 1:
        # Within the model's resolution the step time does not decide: the one needing no servers, then
        # the least memory per worker (room for the tables to grow and for the batch), then the step time.
        pool = [c for c in tied if c.name.startswith("ps_") == min(c.name.startswith("ps_") for c in tied)]
        least = min(c.worker_bytes for c in pool)
        best = min((c for c in pool if c.worker_bytes <= 1.1 * least), key=lambda c: c.step_s)
    others = sorted((c for c in usable if c is not best), key=lambda c: c.step_s)
    why = _why(best, others, work, cluster, calibration_for(cal, work))
    rep = next((c for c in cands if c.name == "replicated"), None)
    if rep is not None and rep.ruled_out and "fit" in rep.ruled_out:
        why += f" (replicated: {rep.ruled_out})"
    return Recommendation(best, why, cands)


def workload_from(cal: Calibration, rows: list[int] | None = None, sync_required: bool = True) -> Workload:
    """The workload a calibration saw: its tables (``rows`` given, or the rows the run touched), dense bytes, optimizer.

    Without ``rows`` a table's size is the larger of its ``max_rows`` and the ids the calibration run
    touched, a lower bound: the memory check then only rules out what surely does not fit.
    """
    if rows is not None and len(rows) != len(cal.tables):
        raise PlacementError(
            f"--table-rows gives {len(rows)} sizes for the {len(cal.tables)} tables the calibration run looked up"
        )
    tables = tuple(
        Table(
            rows[i] if rows is not None else max(1, t.rows_seen, t.max_rows or 0),
            t.dim,
            t.ids_per_step,
            name=f"table {i}",
        )
        for i, t in enumerate(cal.tables)
    )
    return Workload(tables, cal.dense_bytes, state=state_multiplier(cal.optimizer), sync_required=sync_required)
