"""The measured parameters of the cost model, and the fits that turn measurements into them.

A :class:`Calibration` is what :mod:`fleet.plan.model` and :mod:`fleet.plan.simulation` read:
the user's script (computation per step, its spread, gradient bytes, sparse rows per step),
the transports (all-reduce and parameter-server request latency and bandwidth), the server's
apply rates and the host (cores, threads per worker, background load while measuring). Every
number comes from a measurement (:mod:`fleet.plan.probe`, :mod:`fleet.plan.measure`); the few
things that cannot be measured on one machine are listed in :attr:`Calibration.assumptions`.

It is stored as JSON (``python -m fleet.plan calibrate --out cal.json``), so a calibration
taken on a real cluster can be reused: ``fleetrun --plan --calibration cal.json script.py``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fleet.plan.lognormal import LogNormal


class Link(BaseModel):
    """Latency and bandwidth of one transport, fitted to measured (bytes, seconds) points."""

    model_config = ConfigDict(extra="forbid")

    latency_s: float = Field(ge=0)
    """Per message (all-reduce: one hop of the ring; parameter server: one request's round trip)."""

    bandwidth_Bps: float = Field(gt=0)
    """Bytes per second through one hop (all-reduce) or one worker-server connection (parameter server)."""

    loopback: bool = True
    """Measured between processes of one host: the cost is CPU work, which shares the host's cores."""

    where: str = ""
    """Which endpoints were measured (``127.0.0.1``, ``10.0.0.1 <-> 10.0.0.2``)."""

    points: list[tuple[int, float]] = Field(default_factory=list)
    """The measurements the fit came from: (bytes, median seconds)."""

    def seconds(self, nbytes: float) -> float:
        """One message of ``nbytes``."""
        return self.latency_s + nbytes / self.bandwidth_Bps


class TableStat(BaseModel):
    """One embedding table as the calibration run saw it (the placement's input, :mod:`fleet.plan.placement`)."""

    model_config = ConfigDict(extra="forbid")

    dim: int = Field(ge=1)
    ids_per_step: float = Field(ge=0)
    """Unique ids of one step's batch in this table (mean over the timed steps)."""
    rows_seen: int = Field(0, ge=0)
    """Distinct ids the run touched: a lower bound of the table's rows."""
    max_rows: int | None = None
    """The table's ``max_rows`` cap, when it has one."""


class Calibration(BaseModel):
    """Everything the model needs, measured on the user's machines (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    script: str = ""
    """The calibrated training script and its arguments, for the record."""

    device: str = "cpu"
    """Where the script's parameters live ("cpu", "cuda"); the all-reduce was measured there."""

    cores: int = Field(ge=1)
    """CPU cores of one host (processes beyond them share; a loopback transport shares them too)."""

    threads: int = Field(1, ge=1)
    """torch intra-op threads of one worker."""

    background: float = Field(0.0, ge=0)
    """Busy processes other than the job's while the script was timed (load average minus the job)."""

    t_comp_s: float = Field(gt=0)
    """Computation per step of one worker running alone (forward, backward, update, data)."""

    step_sigma: float = Field(0.0, ge=0)
    """Spread of the per-step computation: sigma of a log-normal fitted to the measured steps."""

    steps_timed: int = 0
    """Steps the fit used (after the warm-up)."""

    batch: int | None = None
    """Samples per step and worker (None: unknown; the model then reports steps/s)."""

    dense_bytes: int = Field(0, ge=0)
    """Bytes of dense gradients per step (all parameters that received a gradient)."""

    sparse_rows: float = Field(0.0, ge=0)
    """Unique sparse-embedding rows a worker pulls (and pushes) per step."""

    sparse_new_rows: float = Field(0.0, ge=0)
    """Of those, rows no earlier step touched, which a server creates (as often as in the calibration run)."""

    sparse_local_s: float = Field(0.0, ge=0)
    """Of t_comp, the seconds per step inside the sparse embeddings' lookups (a local table, when timed
    alone): on a parameter server that work moves to the servers."""

    sparse_dim: int = Field(0, ge=0)
    """Width of those rows (float32)."""

    tables: list[TableStat] = Field(default_factory=list)
    """Each sparse table the script looked up (for the placement; empty in calibrations taken before it)."""

    optimizer: str = "sgd"
    """The server-side optimizer the apply rates were measured with (the script's, when fleet has it)."""

    allreduce: Link
    """The process group's all-reduce (gloo on CPU, NCCL on GPU), fitted to 2-process runs."""

    round_s: float | None = None
    """Mean seconds of one small all-reduce between 2 workers, back to back: one synchronizing round of a
    step, scheduling waits included (None: calibrations taken before it; the link's latency is used)."""

    table_steps_s: dict[str, float] = Field(default_factory=dict)
    """Seconds per step of a stand-in of the script's tables (same kind of module, widths, ids, lookups) on 2
    workers of this host: ``local`` (alone, as the probe timed them) and sharded each way (``sharded``,
    ``table_wise``): what sharding costs beyond the rates (:mod:`fleet.plan.table_steps`; empty: not measured)."""

    ps: Link | None = None
    """A parameter-server request: one pull of n bytes from one server."""

    dense_apply_Bps: float | None = None
    """Server: bytes of float32 gradient applied per second (the optimizer's update of a dense shard)."""

    sparse_apply_rows_s: float | None = None
    """Server: sparse gradient rows applied per second."""

    sparse_pull_rows_s: float | None = None
    """Server: existing sparse rows looked up per second."""

    sparse_create_rows_s: float | None = None
    """Server: sparse rows created on first touch per second (growth and initial values included)."""

    ps_request_s: float = Field(0.0, ge=0)
    """Server and client handling of one request, when many are in flight (the wire's latency overlapped)."""

    ps_step_s: float | None = None
    """One worker's parameter-server traffic of one step of this script (push, pull, dense and sparse,
    new rows as often as in the calibration run), replayed without computation: a sync worker's wait."""

    ps_sparse_pull_s: float | None = None
    """Of that, the sparse pull issued after the pushes: what an async worker waits for per step."""

    ps_server_step_s: float | None = None
    """The server process's CPU time per replayed step: its work for one worker-step of this script."""

    ps_client_step_s: float = Field(0.0, ge=0)
    """The worker process's CPU time per replayed step: what waiting for the server still costs a core."""

    load_average: float | None = None
    """The host's 1-minute load average while calibrating."""

    assumptions: list[str] = Field(default_factory=list)
    """What the calibration could not measure here and assumed instead (printed with every plan)."""

    @property
    def step_dist(self) -> LogNormal:
        """One worker's computation per step, alone on its host."""
        return LogNormal.with_mean(self.t_comp_s, self.step_sigma)

    @property
    def sparse_bytes(self) -> float:
        """One direction of the sparse traffic per step: ids (int64) and rows (float32)."""
        return self.sparse_rows * (8 + 4 * self.sparse_dim)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.model_dump_json(indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        path = Path(path)
        try:
            return cls.model_validate(json.loads(path.read_text()))
        except FileNotFoundError:
            raise ValueError(f"calibration file {path} does not exist") from None
        except (ValueError, ValidationError) as error:
            raise ValueError(f"calibration file {path} is not a fleet calibration: {_first_line(error)}") from None


def _first_line(error: Exception) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def fit_link(points: Sequence[tuple[float, float]], messages: int = 1) -> tuple[float, float]:
    """(latency per message, bandwidth) from (bytes, seconds) points of t = messages x latency + bytes / bandwidth.

    In two steps, each from the points that measure it: the bandwidth is the least-squares slope
    of the largest messages (those within 64x of the largest: a token bucket's burst or a cache
    makes mid-sized messages look faster than the link sustains), the latency the median
    intercept of the smallest third. A 2-process ring all-reduce sends 2(R-1) = 2 messages and
    2(R-1)/R x bytes = bytes per worker: ``messages=2``.
    """
    pts = sorted((float(n), float(t)) for n, t in points if t > 0)
    if len({n for n, _ in pts}) < 2:
        raise ValueError(f"a latency/bandwidth fit needs at least 2 sizes, got {len(pts)} points")
    top = pts[-1][0]
    large = [p for p in pts if p[0] >= top / 64]
    if len(large) < 2:
        large = pts[-2:]
    mx = sum(n for n, _ in large) / len(large)
    my = sum(t for _, t in large) / len(large)
    sxx = sum((n - mx) ** 2 for n, _ in large)
    slope = sum((n - mx) * (t - my) for n, t in large) / sxx if sxx > 0 else 0.0
    if slope <= 0:  # flat within noise: bandwidth beyond what these sizes can show
        slope = min(t for _, t in pts) / top / 100
    small = pts[: max(1, len(pts) // 3)]
    intercepts = sorted(t - n * slope for n, t in small)
    latency = max(0.0, intercepts[len(intercepts) // 2])
    return latency / messages, 1.0 / slope


def lognormal_sigma(samples: Sequence[float]) -> float:
    """Sigma of a log-normal fitted to per-step times, robust to a few outliers.

    From the inter-quartile range of log t (sigma = IQR / 1.349 for a normal): a garbage
    collection or a load spike in a 30-step sample would inflate the plain standard deviation.
    """
    logs = sorted(math.log(t) for t in samples if t > 0)
    if len(logs) < 4:
        return 0.0
    q1 = logs[int(0.25 * (len(logs) - 1))]
    q3 = logs[int(0.75 * (len(logs) - 1))]
    return max(0.0, (q3 - q1) / 1.3489795)
