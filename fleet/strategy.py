"""DistributedStrategy: what kind of distributed training to run, as plain data.

The model is validated in one place: a bad value raises :class:`StrategyError`
(a ``ValueError``) whose message names the field, the value and what is
allowed. Paddle's spellings (``a_sync``, ``a_sync_configs``) read and write
the same fields as the native ones.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fleet import registry, strategy_file
from fleet.errors import StrategyError
from fleet.ps.protocol.limits import DEFAULT_MAX_REQUEST_IDS, DEFAULT_MAX_REQUEST_MB
from fleet.runtime import env
from fleet.runtime.inject import InjectionSpec

__all__ = ["DistributedStrategy", "StrategyError"]

DEFAULT_TIMEOUT_S = 300.0
LIVE_PEER_WAIT_S = 1800.0  # torch's gloo default: a collective waits this long for a live peer unless timeout_s is set


def _timeout_from_env() -> float:
    """timeout_s's default: FLEET_TIMEOUT_S when set (checked like the field), else 300 s."""
    value = env.current().float(env.FLEET_TIMEOUT_S, DEFAULT_TIMEOUT_S)
    if not 0 < value <= 86400:  # type: ignore[operator]
        raise StrategyError(f"{env.FLEET_TIMEOUT_S}={value:g} is not allowed: seconds, above 0 and at most 86400.")
    return value  # type: ignore[return-value]


def _explain(error: ValidationError) -> str:
    """One paragraph per problem instead of pydantic's multi-line report."""
    lines = []
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"])
        if item["type"] == "extra_forbidden":
            allowed = ", ".join(sorted(DistributedStrategy.model_fields))
            lines.append(f"DistributedStrategy has no field {field!r}. Known fields: {allowed}.")
            continue
        message = item["msg"].removeprefix("Value error, ")
        if not field:
            lines.append(f"DistributedStrategy: {message}")
            continue
        value = item.get("input")
        shown = f" = {value!r}" if not isinstance(value, dict) else ""
        lines.append(f"DistributedStrategy.{field}{shown} is not allowed: {message}.")
    return " ".join(lines)


class DistributedStrategy(BaseModel):
    """How a job trains across processes. Every field has a safe default."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    mode: str = "collective"
    """"collective" (all-reduce data parallel), "sharding" (FSDP2: parameters, gradients and
    optimizer state sharded over the workers), "ps" (parameter server), or a name given to
    ``fleet.register_strategy``."""

    update: Literal["sync", "async", "geo"] = "sync"
    """How updates are applied. Collective supports "sync"; the parameter server all three."""

    k_steps: int = Field(100, ge=1)
    """geo mode: local steps between two pushes of parameter deltas."""

    backup_workers: int = Field(0, ge=0)
    """PS sync mode: apply a step's update after the first N - backup_workers gradients."""

    nonfinite: Literal["skip", "error"] = "skip"
    """A sparse table's or a PS dense table's update holding NaN or Inf: "skip" it (the table stays as
    it was, the worker warns naming the table and the step, the servers count it per worker), as
    AMP's GradScaler skips an inf step; "error" raises instead. In PS sync mode a skipped push counts
    as absent: the step averages the other workers' gradients."""

    max_request_ids: int = Field(DEFAULT_MAX_REQUEST_IDS, ge=1, le=1 << 26)
    """PS: ids one sparse pull or push request carries. Workers split bigger batches into several
    requests, so that no request holds a server's loop for long while other workers wait; a
    server refuses a request over its limits with an error naming them (fleet.ps.protocol.limits)."""

    max_request_mb: float = Field(DEFAULT_MAX_REQUEST_MB, ge=0.0625, le=1024)
    """PS: MiB one sparse request, or its reply, carries (ids, rows and clicks); with wide rows
    this, not ``max_request_ids``, sets how many ids go in one request."""

    ps_encryption: Literal["none", "curve"] = "none"
    """PS: "curve" encrypts and authenticates every worker-server connection (ZeroMQ CURVE, keys
    derived from the job's secret, which then never travels); "none" authenticates with the
    secret in clear text (ZeroMQ PLAIN), enough on a network only the job's hosts share."""

    ps_ipc: bool = True
    """PS: a worker reaches a server on its own host through a Unix domain socket (ZeroMQ
    ``ipc://``) instead of TCP, found by itself and under the same authentication and limits;
    False keeps TCP everywhere (as does ``FLEET_PS_IPC=0`` in the environment)."""

    ps_server_threads: int | None = Field(None, ge=0, le=256)
    """PS: threads each server runs its table operations on, one table at a time per table and in
    arrival order (fleet.ps.server.lanes); 0 runs them all on the server's loop thread. None: none
    on a machine of 2 cores or fewer, else half the cores, at most 8."""

    dense_placement: Literal["servers", "allreduce"] = "servers"
    """PS: where the dense parameters (every parameter that is not a ``fleet.nn`` sparse table) live.
    "servers": flat tables on the parameter servers, which step them; each step pushes their
    gradients and pulls their values. "allreduce" (PERSIA's hybrid): they stay on the workers, their
    gradients are averaged every step by the collective engine (shared memory on one host, the
    process group across hosts; ``bucket_mb`` and ``shared_memory`` apply) and the user's optimizer
    steps them on every worker, so they are identical on every worker after every step; the servers
    hold only the sparse tables, in sync, async or geo mode. Not with ``backup_workers`` (the
    all-reduce waits for every worker) nor with restarts (``fleetrun --max-restarts``)."""

    servers: int = Field(0, ge=0)
    """Under rank-only launchers (torchrun, mpirun, srun): the first ``servers`` ranks serve."""

    timeout_s: float = Field(default_factory=lambda: _timeout_from_env(), gt=0, le=86400)
    """Deadline of every blocking wait (rendezvous, server requests, collectives). Default 300, or
    ``FLEET_TIMEOUT_S`` from the environment. Left at its default, a collective waits longer for a peer
    whose heartbeat is alive (:attr:`collective_wait_s`, 30 minutes: rank-0-only evaluation or saving);
    a dead or stopped peer is named within about 10 s either way (docs/failures.md)."""

    bucket_mb: float = Field(25.0, gt=0, le=4096)
    """Collective: size of a gradient bucket; buckets are all-reduced as backward fills them."""

    grad_compression: Literal["none", "fp16", "bf16"] = "none"
    """Collective: dtype gradients travel in (averaged before casting, so fp16 does not overflow)."""

    shared_memory: bool = True
    """Collective: when every worker runs on one host, sum CPU gradient buckets through shared
    memory (/dev/shm) instead of the process group (uncompressed buckets only). Sharding: FSDP2's
    all-gathers and reduce-scatters of CPU parameters too."""

    sharding_stage: Literal[2, 3] = 3
    """Sharding: 3 shards the parameters too and gathers each layer's again in backward (ZeRO-3,
    FSDP); 2 gathers them once per step, whole from forward to the end of backward (ZeRO-2's
    communication and peak memory). Gradients and optimizer state are sharded in both."""

    shard_modules: list[str] = Field(default_factory=list)
    """Sharding: class names of the submodules to shard as units (e.g. ["TransformerBlock"]);
    by default every child module that holds parameters, and inside containers (ModuleList,
    ModuleDict, Sequential) their blocks, recursively."""

    mixed_precision: Literal["none", "bf16", "fp16"] = "none"
    """Sharding: compute in this dtype (FSDP2's MixedPrecisionPolicy); gradients reduce in float32."""

    grad_accumulation_steps: int = Field(1, ge=1)
    """Collective, Paddle's gradient merge: ``optimizer.step()`` calls per real step (the loop calls
    ``backward()`` and ``step()`` on every micro-batch); gradients are reduced once, on the last one. A
    DDP-style loop (several ``backward()`` calls, then one ``step()``) is refused with an error: keep it
    at 1 there and skip the reductions with ``no_sync()`` or ``model.require_backward_grad_sync = False``."""

    local_sgd_steps: int = Field(0, ge=0)
    """Collective: if > 0, no gradient all-reduce; parameters are averaged every this many steps."""

    table_placement: Literal["auto", "replicated", "sharded", "table_wise"] = "auto"
    """Where the rows of ``fleet.nn.SparseEmbedding`` tables (bags, feature collections) live in
    collective and sharding mode: "replicated" (every worker holds every row; each step's row
    gradients go to every worker), "sharded" (each worker holds the rows whose id hashes to it,
    1/N of them; ids and rows, then gradients, go to their owners by all-to-all), "table_wise"
    (each table whole on one worker, the tables spread so that the workers' shares of their widths
    are about even; a ``SparseFeatureCollection``'s bags are pooled by the tables' holders and only
    pooled vectors and their gradients travel: TorchRec's table-wise sharding), or "auto":
    sharded in mode="sharding" (its promise is memory per worker of about 1/N) except tables with
    a ``max_rows`` cap (sharded, the cap is split over the workers), replicated in mode="collective".
    In mode="ps" the servers hold the tables ("auto" only). See docs/modes.md, "Where the tables live"."""

    seed: int = 0
    """Seed for anything fleet itself draws (sparse row initialisation)."""

    inject: InjectionSpec | None = None
    """Tests and demos: a straggler delay or a crash on chosen worker ranks, e.g.
    ``{"ranks": [1], "delay": {"mu": -1.0, "sigma": 0.5}}`` (see fleet.runtime.inject; FLEET_INJECT wins)."""

    @property
    def collective_wait_s(self) -> float:
        """How long a collective waits for a worker whose heartbeat is alive: ``timeout_s`` when chosen (the
        strategy field, or FLEET_TIMEOUT_S), else :data:`LIVE_PEER_WAIT_S` (torch's own gloo default)."""
        chosen = "timeout_s" in self.model_fields_set or env.current().has(env.FLEET_TIMEOUT_S)
        return self.timeout_s if chosen else max(self.timeout_s, LIVE_PEER_WAIT_S)

    # --- validation -----------------------------------------------------------

    def __init__(self, **data: Any):
        try:
            super().__init__(**data)
        except ValidationError as error:
            raise StrategyError(_explain(error)) from None

    def __setattr__(self, name: str, value: Any) -> None:
        prop = getattr(type(self), name, None)
        if isinstance(prop, property):
            prop.__set__(self, value)
            return
        try:
            super().__setattr__(name, value)
        except ValidationError as error:
            raise StrategyError(_explain(error)) from None

    @model_validator(mode="before")
    @classmethod
    def _paddle_aliases(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        configs = data.pop("a_sync_configs", None)
        if configs is not None:
            if not isinstance(configs, dict):
                raise ValueError(f"a_sync_configs must be a dict such as {{'k_steps': 100}}, got {configs!r}")
            unknown = set(configs) - {"k_steps"}
            if unknown:
                raise ValueError(f"a_sync_configs knows only 'k_steps', got {sorted(unknown)}")
            if "k_steps" in configs:
                data["k_steps"] = configs["k_steps"]
                if data.get("a_sync") and configs["k_steps"] and "update" not in data:
                    data["update"] = "geo"
        sharding_configs = data.pop("sharding_configs", None)
        if sharding_configs is not None:
            if not isinstance(sharding_configs, dict) or set(sharding_configs) - {"stage"}:
                raise ValueError(f"sharding_configs must be a dict such as {{'stage': 3}}, got {sharding_configs!r}")
            if "stage" in sharding_configs:
                data["sharding_stage"] = sharding_configs["stage"]
        if "sharding" in data:
            sharding = data.pop("sharding")
            if not isinstance(sharding, bool):
                raise ValueError(f"sharding must be True or False, got {sharding!r}")
            if sharding:
                data.setdefault("mode", "sharding")
        if "a_sync" in data:
            a_sync = data.pop("a_sync")
            if not isinstance(a_sync, bool):
                raise ValueError(f"a_sync must be True or False, got {a_sync!r}")
            data.setdefault("mode", "ps")
            if "update" not in data:
                geo = configs is not None and configs.get("k_steps", 0) > 0
                data["update"] = ("geo" if geo else "async") if a_sync else "sync"
        return data

    @field_validator("mode")
    @classmethod
    def _registered_mode(cls, mode: str) -> str:
        if mode not in registry.names():
            raise ValueError(f"expected one of {', '.join(repr(n) for n in registry.names())}")
        return mode

    @model_validator(mode="after")
    def _tables_on_workers(self) -> DistributedStrategy:
        if self.table_placement != "auto" and self.mode == "ps":
            raise ValueError(
                f"table_placement={self.table_placement!r} places sparse tables on the workers; in mode='ps' the "
                "servers hold them (keep table_placement='auto', or use mode='collective' or 'sharding')"
            )
        return self

    @model_validator(mode="after")
    def _supported_combination(self) -> DistributedStrategy:
        registry.check_combination(self)
        return self

    # --- Paddle's spellings ----------------------------------------------------

    @property
    def sharding(self) -> bool:
        """Paddle: True for sharded data parallelism (mode="sharding")."""
        return self.mode == "sharding"

    @sharding.setter
    def sharding(self, value: bool) -> None:
        if value:
            self._replace(mode="sharding")
        else:  # back to plain data parallelism: the sharding options go with it
            self._replace(mode="collective", sharding_stage=3, shard_modules=[], mixed_precision="none")

    @property
    def sharding_configs(self) -> dict[str, int]:
        """Paddle: ``{"stage": 2 or 3}``."""
        return {"stage": self.sharding_stage}

    @sharding_configs.setter
    def sharding_configs(self, value: dict[str, int]) -> None:
        if not isinstance(value, dict) or set(value) - {"stage"}:
            raise StrategyError(f"sharding_configs = {value!r} is not allowed: expected {{'stage': 2 or 3}}.")
        if "stage" in value:
            self._replace(sharding_stage=value["stage"])

    @property
    def a_sync(self) -> bool:
        """Paddle: True for asynchronous (async or geo) parameter-server updates."""
        return self.update != "sync"

    @a_sync.setter
    def a_sync(self, value: bool) -> None:
        update = self.update if value and self.update != "sync" else ("async" if value else "sync")
        self._replace(mode="ps", update=update)

    @property
    def a_sync_configs(self) -> dict[str, int]:
        """Paddle: ``{"k_steps": N}``; k_steps > 0 with a_sync means geo."""
        return {"k_steps": self.k_steps if self.update == "geo" else 0}

    @a_sync_configs.setter
    def a_sync_configs(self, value: dict[str, int]) -> None:
        k_steps = value.get("k_steps", 0) if isinstance(value, dict) else value
        if isinstance(k_steps, int) and k_steps > 0:
            self._replace(k_steps=k_steps, update="geo" if self.update != "sync" else "sync")
        elif k_steps == 0:
            self._replace(update="async" if self.update == "geo" else self.update)
        else:
            raise StrategyError(f"a_sync_configs = {value!r} is not allowed: expected {{'k_steps': N}} with N >= 0.")

    def _replace(self, **changes: Any) -> None:
        """Change several fields at once, validating the result as a whole."""
        updated = DistributedStrategy(**{**self.model_dump(), **changes})
        self.__dict__.update(updated.__dict__)
        self.__pydantic_fields_set__.update(changes)

    # --- files and the environment ---------------------------------------------

    @classmethod
    def from_file(cls, path: str | Path) -> DistributedStrategy:
        """Read a strategy from TOML (``.toml``) or JSON (``.json``).

        A TOML file may hold the fields at top level or under a ``[strategy]`` table.
        """
        try:
            data = strategy_file.read(path)
        except strategy_file.StrategyFileError as error:
            raise StrategyError(str(error)) from None
        try:
            return cls(**data)
        except StrategyError as error:
            raise StrategyError(f"In strategy file {str(path)!r}: {error}") from None

    @classmethod
    def from_env(cls, reader: env.EnvReader | None = None) -> DistributedStrategy | None:
        """The strategy the launch configuration chose, if any (FLEET_STRATEGY, then FLEET_STRATEGY_FILE)."""
        reader = reader or env.current()
        text = reader.str(env.FLEET_STRATEGY)
        if text is not None:
            try:
                data = json.loads(text)
            except json.JSONDecodeError as error:
                raise StrategyError(f"{env.FLEET_STRATEGY} does not hold valid JSON: {error}.") from None
            try:
                return cls(**data)
            except StrategyError as error:
                raise StrategyError(f"In {env.FLEET_STRATEGY}: {error}") from None
        path = reader.str(env.FLEET_STRATEGY_FILE)
        return cls.from_file(path) if path is not None else None

    def to_json(self) -> str:
        return self.model_dump_json()
