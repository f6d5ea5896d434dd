"""The cost model: step time, samples/s and speed-up of each fleet mode at R workers and S servers.

Every term is a calibrated quantity (:class:`~fleet.plan.calibration.Calibration`) times a
count that follows from the mode's protocol. Per step, with C the computation of one worker
(log-normal, mean T_comp), D the dense gradient bytes, Sp the sparse bytes (ids and rows):

- **collective sync**: ``E[max of R C] + ring(D) + control``. The ring all-reduce of n bytes
  costs ``2(R-1)/R x n / bandwidth + 2(R-1) x latency`` per bucket (fleet's buckets are
  ``bucket_mb``); the control term is fleet's lockstep header, one small all-gather,
  ``(R-1) x latency``; a SparseEmbedding's rows are all-gathered, ``(R-1) x (latency + Sp /
  bandwidth)``. The all-reduce is not assumed to overlap the backward pass (on CPU the
  transport's copies compete with the computation for the same cores).
- **PS sync**, b backup workers: ``E[(R-b)-th fastest of R C] + 3 latencies + max(worker
  transfer, server work)``: push, then a pull that waits for the step, then the sparse pull;
  a server handles R pushes and R pulls of its 1/S share, sums R gradients and applies once.
- **PS async**: no barrier. A worker's step is its computation plus the synchronous sparse
  pull; the servers bound the rate: every worker step costs a server 1/S of a push, an apply
  and a pull, so the step is at least R/S times that.
- **PS geo**: local steps; every k steps a push of the deltas and a pull (and the sparse rows
  touched meanwhile), so the communication is divided by k.

Processes on one host share its cores: with W workers of T threads each, servers busy a
fraction u of the time and ``background`` other busy processes, each gets
``min(1, cores / (W T + u S_host + background))`` of a core, and the computation measured alone
stretches by the ratio of the two shares. A loopback transport (calibrated between processes
of one host) is CPU work and stretches alike; a network link does not.

The speed-up is over one process running the script alone (no fleet, no server). The
speed-up condition is fleet's own (:func:`fleet.telemetry.step_report.speedup_condition`):
T_sync < (R-1)/R x T_comp with T_sync = step - computation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fleet.plan.calibration import Calibration, Link
from fleet.plan.lognormal import LogNormal
from fleet.telemetry.step_report import speedup_condition

MODES = ("collective", "ps_sync", "ps_backup", "ps_async", "ps_geo")
LABELS = {
    "collective": "collective sync",
    "ps_sync": "PS sync",
    "ps_backup": "PS sync + backup",
    "ps_async": "PS async",
    "ps_geo": "PS geo",
}
SYNC_MODES = ("collective", "ps_sync", "ps_backup")
DEFAULT_COUNTS = tuple(2**i for i in range(11))  # 1, 2, 4, ..., 1,024
BUCKET_BYTES = 25 * 2**20  # DistributedStrategy.bucket_mb's default


@dataclass(frozen=True)
class Setup:
    """Where and how the job runs (what is not the script's or the transport's property)."""

    workers: int
    servers: int = 1
    """Parameter servers in all (PS modes); fleetrun spreads them over the hosts."""
    workers_per_host: int = 1
    backup: int = 0
    """PS sync: backup workers b (a step closes with the first R - b gradients)."""
    backup_fraction: float = 0.04
    """ps_backup when ``backup`` is 0: b = ceil(fraction x R) (Chen et al. 2016 used about 4 %)."""
    k_steps: int = 100
    background: float = 0.0
    """Busy processes besides the job on every host (0: dedicated hosts)."""
    bucket_bytes: int = BUCKET_BYTES

    def __post_init__(self) -> None:
        if self.workers < 1 or self.workers_per_host < 1:
            raise ValueError(f"workers={self.workers}, workers_per_host={self.workers_per_host}: both must be >= 1")
        if self.servers < 0 or self.backup < 0 or self.k_steps < 1:
            raise ValueError(f"servers={self.servers}, backup={self.backup}, k_steps={self.k_steps}: out of range")

    @property
    def hosts(self) -> int:
        return math.ceil(self.workers / self.workers_per_host)

    def backups_for(self, mode: str) -> int:
        if mode != "ps_backup":
            return 0
        b = self.backup or math.ceil(self.backup_fraction * self.workers)
        return min(b, self.workers - 1)


@dataclass
class Prediction:
    """One mode at one worker count."""

    mode: str
    workers: int
    step_s: float
    t_comp_s: float  # mean computation per step at this R (contention included)
    t_sync_s: float  # step - computation: communication and waiting
    samples_per_s: float | None
    steps_per_s: float  # worker steps per second, all workers together
    speedup: float  # over one process running the script alone
    condition: dict
    parts: dict[str, float] = field(default_factory=dict)  # where the step goes, seconds

    @property
    def holds(self) -> bool | None:
        return self.condition["holds"]


def ring_allreduce_s(workers: int, nbytes: float, link: Link) -> float:
    """Ring all-reduce of ``nbytes`` over R workers: 2(R-1)/R x bytes/bandwidth + 2(R-1) x latency."""
    if workers <= 1:
        return 0.0
    r = workers
    return 2 * (r - 1) / r * nbytes / link.bandwidth_Bps + 2 * (r - 1) * link.latency_s


def share(cores: int, demand: float) -> float:
    """The fraction of a core each busy process gets when ``demand`` of them want ``cores``."""
    return min(1.0, cores / demand) if demand > 0 else 1.0


class Model:
    """Predictions for one calibration; see the module docstring for the equations."""

    def __init__(self, cal: Calibration):
        self.cal = cal
        self.alone = share(cal.cores, cal.threads + cal.background)

    # --- the host ------------------------------------------------------------------

    def stretch(
        self, setup: Setup, servers_busy: float = 0.0, workers_here: int | None = None, duty: float = 1.0
    ) -> float:
        """How much slower a worker computes in ``setup`` than when it was calibrated.

        ``duty``: the fraction of a step a worker computes; while it waits for a server it leaves
        its core to the others.
        """
        here = min(setup.workers, setup.workers_per_host) if workers_here is None else workers_here
        demand = here * self.cal.threads * duty + servers_busy + setup.background
        return self.alone / share(self.cal.cores, demand)

    def link(self, setup: Setup, link: Link, stretch: float) -> Link:
        """A calibrated link as ``setup`` sees it: a loopback one on a single host shares its cores."""
        if link.loopback and setup.hosts == 1:
            # CPU work on shared cores: the transport slows like the computation does.
            return link.model_copy(
                update={"latency_s": link.latency_s * stretch, "bandwidth_Bps": link.bandwidth_Bps / stretch}
            )
        return link

    def baseline_s(self, setup: Setup) -> float:
        """One process running the script alone on one host of ``setup`` (the speed-up's reference)."""
        return self.cal.t_comp_s * self.stretch(setup, workers_here=1)

    # --- the modes -----------------------------------------------------------------

    def predict(self, mode: str, setup: Setup) -> Prediction:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; the model knows {', '.join(MODES)}")
        if mode != "collective" and setup.servers < 1:
            raise ValueError(f"mode {mode!r} needs at least one server; setup has servers={setup.servers}")
        if mode == "collective":
            step, comp, parts = self._collective(setup)
        else:
            step, comp, parts = self._ps(mode, setup)
        r = setup.workers
        batch = self.cal.batch
        steps_per_s = r / step
        speedup = r * self.baseline_s(setup) / step
        condition = speedup_condition(max(0.0, step - comp), comp, r)
        return Prediction(
            mode=mode,
            workers=r,
            step_s=step,
            t_comp_s=comp,
            t_sync_s=max(0.0, step - comp),
            samples_per_s=steps_per_s * batch if batch else None,
            steps_per_s=steps_per_s,
            speedup=speedup,
            condition=condition,
            parts=parts,
        )

    def _compute(self, stretch: float, ps: bool = False) -> LogNormal:
        """One worker's computation per step; on a parameter server without the local table's work."""
        cal, t = self.cal, self.cal.t_comp_s
        if ps and cal.sparse_rows:
            applied = cal.sparse_rows / cal.sparse_apply_rows_s if cal.sparse_apply_rows_s else 0.0
            t = max(0.1 * t, t - cal.sparse_local_s - applied)
        return LogNormal.with_mean(t * stretch, cal.step_sigma)

    def _collective(self, setup: Setup) -> tuple[float, float, dict[str, float]]:
        cal, r = self.cal, setup.workers
        stretch = self.stretch(setup)
        comp = self._compute(stretch)
        link = self.link(setup, cal.allreduce, stretch)
        buckets = max(1, math.ceil(cal.dense_bytes / setup.bucket_bytes)) if cal.dense_bytes else 0
        parts = {
            "compute": comp.mean,
            "wait for the slowest": comp.expected_max(r) - comp.mean,
            "all-reduce bandwidth": ring_allreduce_s(r, cal.dense_bytes, link) - 2 * (r - 1) * link.latency_s,
            "all-reduce latency": (2 * buckets + 1) * (r - 1) * link.latency_s,  # + the lockstep all-gather
            "sparse rows all-gather": (r - 1) * (link.latency_s + cal.sparse_bytes / link.bandwidth_Bps)
            if cal.sparse_rows
            else 0.0,
        }
        return sum(parts.values()), comp.mean, parts

    def _sparse_lookup_s(self) -> float:
        """Server time to answer one worker's sparse pull: new rows are created, the others looked up."""
        cal = self.cal
        if not cal.sparse_rows:
            return 0.0
        new = min(cal.sparse_new_rows, cal.sparse_rows)
        created = new / cal.sparse_create_rows_s if cal.sparse_create_rows_s else 0.0
        looked = (cal.sparse_rows - new) / cal.sparse_pull_rows_s if cal.sparse_pull_rows_s else 0.0
        return created + looked

    def _server_per_worker_step(self, setup: Setup, link: Link) -> float:
        """Seconds one server works for one step of one worker (4 requests: push and pull, dense and sparse)."""
        cal, s = self.cal, setup.servers
        transfer = 2 * (cal.dense_bytes + cal.sparse_bytes) / link.bandwidth_Bps
        apply = cal.dense_bytes / cal.dense_apply_Bps if cal.dense_apply_Bps else 0.0
        sparse = self._sparse_lookup_s()
        if cal.sparse_rows and cal.sparse_apply_rows_s:
            sparse += cal.sparse_rows / cal.sparse_apply_rows_s
        # Dense shards live on every server, so each one sees every request; the bytes and rows split S ways.
        requests = (4 if cal.sparse_rows else 2) * cal.ps_request_s
        return requests + (transfer + apply + sparse) / s

    def _ps(self, mode: str, setup: Setup) -> tuple[float, float, dict[str, float]]:
        cal, r = self.cal, setup.workers
        if cal.ps is None:
            raise ValueError(
                "this calibration has no parameter-server measurements (ps link); run the calibration again"
            )
        b = setup.backups_for(mode)
        servers_here = setup.servers / setup.hosts
        # First guess: servers always busy, workers always computing; refined from the predicted step.
        busy, duty = servers_here, 1.0
        step, comp_mean, parts = 0.0, 0.0, {}
        for _ in range(40):
            stretch = self.stretch(setup, servers_busy=busy, duty=duty)
            comp = self._compute(stretch, ps=True)
            link = self.link(setup, cal.ps, stretch)
            # Servers on the workers' hosts share their cores: their work stretches too.
            srv = stretch if servers_here > 0 else 1.0
            per_step = self._server_per_worker_step(setup, link) * srv
            # The sparse pull is the one request a worker always waits for: it queues behind the
            # worker's own sparse push, then the rows are looked up (or created) and sent.
            sparse_wait = 0.0
            replayed = cal.ps_server_step_s is not None and cal.ps_step_s is not None
            if replayed:
                # Measured on this script's own traffic (a replayed step): the server's CPU per
                # worker-step, the sync worker's whole wait and the async worker's sparse pull.
                requests = min(cal.ps_server_step_s, (4 if cal.sparse_rows else 2) * cal.ps_request_s)
                per_step = (requests + (cal.ps_server_step_s - requests) / setup.servers) * srv
                lat = link.latency_s
                sparse_wait = (lat + max(0.0, (cal.ps_sparse_pull_s or 0.0) - lat) / setup.servers) * srv
            elif cal.sparse_rows:
                applied = cal.sparse_rows / cal.sparse_apply_rows_s if cal.sparse_apply_rows_s else 0.0
                lookup = (self._sparse_lookup_s() + applied) / setup.servers + 2 * cal.ps_request_s
                sparse_wait = link.latency_s + cal.sparse_bytes / link.bandwidth_Bps + lookup * srv
            if mode in ("ps_sync", "ps_backup") and replayed:
                parts = {
                    "compute": comp.mean,
                    "wait for the slowest": comp.expected_order(r - b, r) - comp.mean,
                    "client and wire": max(0.0, cal.ps_step_s - cal.ps_server_step_s) * srv,
                    "servers: transfer and updates": r * per_step,
                }
                server = r * per_step
            elif mode in ("ps_sync", "ps_backup"):
                worker_io = 2 * (cal.dense_bytes + cal.sparse_bytes) / link.bandwidth_Bps
                parts = {
                    "compute": comp.mean,
                    "wait for the slowest": comp.expected_order(r - b, r) - comp.mean,
                    "request latency": 2 * link.latency_s,
                    "servers: transfer and updates": max(worker_io, r * per_step),
                    # the sparse pull's server work is in the servers' share already
                    "sparse pull": link.latency_s + cal.sparse_bytes / link.bandwidth_Bps if cal.sparse_rows else 0.0,
                }
                server = r * per_step
            elif mode == "ps_async":
                # The pull also waits behind the other workers' requests at the server: an M/D/1
                # queue whose load is the others' share of the server, rho = (R-1) x work / step.
                rho = min(0.95, (r - 1) * per_step / step) if step > 0 else 0.0
                queue = rho / (2 * (1 - rho)) * per_step
                own = comp.mean + sparse_wait + queue
                server = r * per_step
                parts = {
                    "compute": comp.mean,
                    "sparse pull": sparse_wait,
                    "queue at the server": queue,
                    "server saturated": max(0.0, server - own),
                }
            else:  # geo: local steps (rows in a local cache); one exchange every k steps
                k = setup.k_steps
                # Rows touched in k steps: at most k x a step's; assumed all distinct (the most traffic).
                geo = Model(cal.model_copy(update={"sparse_rows": k * cal.sparse_rows, "sparse_new_rows": 0.0}))
                server = r * geo._server_per_worker_step(setup, link) * srv
                exchange = 2 * link.latency_s + max(
                    2 * (cal.dense_bytes + geo.cal.sparse_bytes) / link.bandwidth_Bps, server
                )
                parts = {"compute": comp.mean, "exchange every k steps": exchange / k}
                server /= k
            step = sum(parts.values())
            comp_mean = comp.mean
            new_busy = servers_here * min(1.0, server / step if step > 0 else 1.0)
            # A waiting PS worker still keeps a core busy part of the time (packing, its IO threads).
            new_duty = min(1.0, (comp.mean + cal.ps_client_step_s * srv) / step) if step > 0 else 1.0
            if abs(new_busy - busy) < 1e-3 and abs(new_duty - duty) < 1e-3:
                break
            busy, duty = (busy + new_busy) / 2, (duty + new_duty) / 2  # damped: the two feed each other
        return step, comp_mean, parts

    # --- tables --------------------------------------------------------------------

    def table(
        self, counts: tuple[int, ...] = DEFAULT_COUNTS, modes: tuple[str, ...] = MODES, **setup: object
    ) -> list[Prediction]:
        """Predictions for every mode at every worker count (PS modes skipped without PS calibration)."""
        usable = [m for m in modes if m == "collective" or self.cal.ps is not None]
        return [self.predict(mode, Setup(workers=r, **setup)) for r in counts for mode in usable]  # type: ignore[arg-type]


def breaks_at(predictions: list[Prediction], mode: str) -> int | None:
    """The smallest worker count at which the speed-up condition fails for ``mode`` (None: never in the table)."""
    for p in sorted((p for p in predictions if p.mode == mode), key=lambda p: p.workers):
        if p.holds is False:
            return p.workers
    return None
