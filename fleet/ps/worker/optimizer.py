"""The worker side of parameter-server training: a wrapped optimizer over a PSClient.

Each param group becomes one flat dense table (:mod:`fleet.ps.worker.dense_tables`) and each
``fleet.nn.SparseEmbedding`` the optimizer holds one sparse table, whose rows the strategy
serves to the module (:mod:`fleet.ps.modes.rows`, chosen by the update mode). ``step()`` runs the
update mode's worker policy (:mod:`fleet.ps.modes`) under :class:`~fleet.ps.worker.recovery.Recovery`, which rides out server
restarts. Param groups added later (``add_param_group`` on this optimizer, or found at
``step()`` when added to the unwrapped one) get their tables the same way.

With ``dense_placement="allreduce"`` the servers hold the sparse tables only: the dense
parameters stay here and a :class:`LocalDense` (the strategy's
:class:`~fleet.strategies.ps_dense_allreduce.AllReducedDense`) averages
their gradients over the workers and steps them locally (``dense``).
"""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

import torch

from fleet.errors import FleetError
from fleet.ps.client.client import PSClient
from fleet.ps.modes import mode_for
from fleet.ps.modes.rows import RemoteRows
from fleet.ps.protocol.errors import PSRemoteError
from fleet.ps.worker.dense_tables import DenseTables
from fleet.ps.worker.pushed_rows import PushedRows
from fleet.ps.worker.recovery import Recovery
from fleet.ps.worker.step_checks import GradWatch, HyperParameters
from fleet.ps.worker.table_names import TableNames, dense_name, explain_conflict
from fleet.ps.worker.user_group import refuse_user_group
from fleet.runtime import env
from fleet.sparse import backends as tables
from fleet.sparse.optim import OptimizerSpec, ServerOptimizer
from fleet.training import owners
from fleet.training.optimizer import WrappedOptimizer


class LocalDense(Protocol):
    """The dense parameters of a wrapped optimizer when they stay on the workers (``dense_placement="allreduce"``):
    averaged over the workers by the collective engine, stepped here. Built by the strategy, which composes
    the engines (:mod:`fleet.strategies.ps_dense_allreduce`); the parameter server never imports that engine."""

    def zero_grad(self) -> None: ...

    def add_params(self, params: list[torch.Tensor]) -> None: ...

    def before_step(self) -> None: ...

    def step(self) -> float: ...

    def after_step(self) -> float: ...


class PSOptimizer(WrappedOptimizer):
    """``step()`` trains through the parameter servers; the surface stays ``torch.optim.Optimizer``'s."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        client: PSClient,
        config: Any,
        role: Any,
        new_table: Callable[[], int],
        model: torch.nn.Module | None = None,
        dense: LocalDense | None = None,
    ):
        super().__init__(optimizer)
        self._dense = dense  # None: the dense parameters are tables on the servers
        self.client = client
        self.config = config
        self.is_first = role.worker_index == 0
        self._worker = role.worker_index
        self._role = role
        self._model = model
        self._new_table = new_table
        self.mode = mode_for(config.update)
        self._base = self.mode.table_config(config)
        self.tables = DenseTables(client, optimizer, self._base, self.is_first, new_table)
        self.sparse: list[tuple[Any, int, Any]] = []  # (table module, param group index, rows)
        self._sparse_creates: list[Callable[[], Future]] = []
        self._groups: list[list[int]] = []  # the parameters of each param group with a table, by id
        self._hyper = HyperParameters(optimizer)  # what the servers step with: changing it is refused
        self._grad_watch = GradWatch() if self.mode.watches_grads else None  # gradients written after backward
        self.update = self.mode.worker(self, config)
        self.recovery = Recovery(self, (env.current().int(env.FLEET_MAX_RESTARTS, 0) or 0) > 0)
        self._add_groups(range(len(optimizer.param_groups)), check_values=False)
        if dense is None:  # else every worker took worker 0's buffers through the workers' group
            self._share_buffers()

    def _share_buffers(self) -> None:
        """Every worker starts from worker 0's buffers too (a random projection, spectral_norm's u and v),
        as from its parameters, through server 0's all-reduce.

        Why in two rounds: most buffers (BatchNorm's statistics, a causal mask) are equal on every
        worker already, and a large one would not fit a request (``max_request_mb``). First one
        fingerprint per buffer (its bytes' hash: max and min over the workers, one all-reduce); then only the buffers
        that differ, worker 0 sending its values and the others zeros, in pieces under the limit.
        """
        buffers = [b for b in owners.model_buffers(self.parameters())[0] if b.numel()]
        if not buffers:
            return
        prints = torch.tensor([_fingerprint(b) for b in buffers], dtype=torch.float64)
        # max and min in one round: the max of the negated fingerprints is minus their min (exact in float64)
        extremes = self.client.all_reduce(torch.cat([prints, -prints]), "max").result()
        highest, lowest = extremes[: len(buffers)], -extremes[len(buffers) :]
        differ = [b for b, hi, lo in zip(buffers, highest.tolist(), lowest.tolist(), strict=True) if hi != lo]
        if not differ:
            return
        flat = torch.cat([b.detach().reshape(-1).to(device="cpu", dtype=torch.float64) for b in differ])
        if not self.is_first:
            flat.zero_()
        piece = max(1, self.client.limits.max_bytes // 8)  # float64 values: one request each
        total = torch.cat([self.client.all_reduce(part, "sum").result() for part in flat.split(piece)])
        offset = 0
        with torch.no_grad():
            for b in differ:
                b.copy_(total[offset : offset + b.numel()].view_as(b).to(b.dtype))
                offset += b.numel()

    @property
    def last_checkpoint(self) -> str | None:
        return self.recovery.last_checkpoint

    def remember_checkpoint(self, dirname: str) -> None:
        """fleet.save_persistables / load_persistables: where a sync job rolls back after a server restart."""
        self.recovery.remember_checkpoint(dirname)

    @property
    def server_restarts(self) -> int:
        return self.recovery.server_restarts

    @property
    def stale_dropped(self) -> int:
        """This worker's pushes the servers dropped as stale (sync with backup workers), per table and server."""
        return self.client.stale_pushes

    def creates(self) -> list[Callable[[], Future]]:
        """Every table's create, to send again after a server restart."""
        return [*self.tables.creates, *self._sparse_creates]

    # ------------------------------------------------------------------ tables
    def _add_groups(self, indices: range, check_values: bool) -> None:
        self._check_dtypes(indices)
        first = len(self.tables.entries)
        created = []
        names = TableNames(self.parameters(), self._model)
        for index in indices:  # dense tables first, then the sparse ones: every worker gets the same ids
            self._groups.append([id(p) for p in self._inner.param_groups[index]["params"]])
            self._hyper.record(index)
            if self._dense is None:
                created += self.tables.create(index, lambda i, params: _dense_names(names, i, params))
        if self._dense is not None and indices.start > 0:
            # added after wrapping: worker 0's values on every worker (those at wrapping were broadcast then)
            self._dense.add_params([p for i in indices for p in self._inner.param_groups[i]["params"]])
        first_sparse = len(self.sparse)
        for index in indices:
            created += self._add_sparse(index, names)
        self.tables.settle(created, self.tables.entries[first:], self._explain, self._worker, check_values)
        self._send_given_rows(self.sparse[first_sparse:])
        self._watch_grads()

    def _send_given_rows(self, added: list[tuple[Any, int, Any]]) -> None:
        """Rows a table took before it went to the servers (``load_rows``, ``from_pretrained``, ``load_state_dict``):
        worker 0 writes them, and nobody pulls before they are there (every worker wraps: all reach the barrier)."""
        given = [(rows, module.local.pending_rows()) for module, _, rows in added]
        given = [(rows, held) for rows, held in given if held is not None]
        if not given:
            return
        if self.is_first:
            for rows, held in given:
                rows.load_rows_state(held, replace=False)
        self.client.barrier().result()

    def _check_dtypes(self, indices: range) -> None:
        """The servers keep dense values, gradients and optimizer state in float32: refuse any other dtype
        rather than train a float64 (or bfloat16) model in float32 arithmetic without a word."""
        if self._dense is not None:
            return  # the dense parameters stay here, stepped by the user's optimizer in their own dtype
        for index in indices:
            for p in self._inner.param_groups[index]["params"]:
                if p.numel() and p.dtype != torch.float32:
                    raise FleetError(
                        f"Parameter {self._name(p)!r} is {str(p.dtype).removeprefix('torch.')}, but the parameter "
                        "servers hold dense parameters, their gradients and the optimizer state in float32, so it "
                        "would train in float32 arithmetic, unlike one process. Convert the model to float32 "
                        "(model.float()) for a parameter-server job, or use mode='collective' (any dtype)."
                    )

    def _watch_grads(self) -> None:
        if self._grad_watch is not None:
            self._grad_watch.watch([p for entry in self.tables.entries for p in entry.params])

    def _check_step(self) -> None:
        """Refuse what the servers cannot do as one process would (:mod:`fleet.ps.worker.step_checks`)."""
        served = set() if self.mode.steps_locally else {e.index for e in self.tables.entries}
        served |= {index for module, index, _ in self.sparse if module.optimizer_override is None}
        self._hyper.check(sorted(served))
        if self._grad_watch is not None:
            self._grad_watch.check([p for entry in self.tables.entries for p in entry.params], self._name)
            self._watch_grads()  # parameters unfrozen since

    def _add_sparse(self, index: int, names: TableNames) -> list[Future]:
        futures = []
        group = self._inner.param_groups[index]
        for module, _ in tables.modules_in(self._inner, [group]):
            spec = OptimizerSpec.from_torch(type(self._inner), group, rows=True, where="by the parameter server")
            table_id = self._new_table()
            sparse_cfg = {**self._base, **module.table_config(spec)}
            name = names.module(module)  # type: ignore[arg-type]
            if name is not None:  # compared by the servers: workers whose table N is another module conflict
                sparse_cfg["name"] = name
            self._sparse_creates.append(lambda t=table_id, c=sparse_cfg: self.client.create_sparse(t, c))
            futures.append(self._sparse_creates[-1]())
            rows = self.mode.rows(self.client, table_id, module, spec)
            if self._dense is not None and isinstance(rows, RemoteRows):
                rows = PushedRows.like(rows)  # the user's optimizer steps here too (the dense layers)
            rows.guard_with(self.recovery.guard)
            self.sparse.append((module, index, rows))
        return futures

    def rows_for(self, module: Any) -> Any:
        """The table backend of a SparseEmbedding this optimizer holds (None if it holds none)."""
        return next((rows for m, _, rows in self.sparse if m is module), None)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._inner.add_param_group(param_group)
        self._adopt_new_groups(check_values=False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        if self._dense is not None:
            self._dense.zero_grad()
        self._watch_grads()  # a layer unfrozen before zero_grad is watched from this backward on

    def _adopt_new_groups(self, check_values: bool = True) -> None:
        """Give param groups added since the last look their tables (at add_param_group, or at step())."""
        groups = self._inner.param_groups
        for index, known in enumerate(self._groups):
            if index >= len(groups) or [id(p) for p in groups[index]["params"]] != known:
                raise FleetError(
                    f"param group {index} of the optimizer changed its parameters after fleet.distributed_optimizer "
                    "(in parameter-server mode each param group is a table on the servers): add parameters with "
                    "add_param_group instead."
                )
        if len(groups) > len(self._groups):
            self.update.flush()  # async: nothing in flight refers to the old list of tables
            self._add_groups(range(len(self._groups), len(groups)), check_values=check_values and not self.is_first)

    # ------------------------------------------------------------------ step
    def step(self, closure=None):  # noqa: D102
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        refuse_user_group(self.config, self._role, "after fleet.init()")  # its own distributed mode, mid-job
        self._adopt_new_groups()
        self._check_step()
        started = time.perf_counter()
        if self._dense is not None:
            self._dense.before_step()
        try:
            self.recovery.guard(self._send_parameter_writes, lossy=True)
            local_s = self.recovery.guard(self.update.step, lossy=True) or 0.0
        except PSRemoteError as exc:
            raise self._explain(exc) from None
        dense_wait_s = 0.0
        if self._dense is not None:
            if not self.mode.steps_locally:  # geo's step stepped the user's optimizer already
                local_s += self._dense.step()
            dense_wait_s = self._dense.after_step()  # the all-reduces' waits, mostly during backward
        self.metrics.set_dropped(self.stale_dropped)
        # step timings, straggler watch and injection (fleet.telemetry.timing / fleet.runtime.inject)
        self._end_step(comm_s=time.perf_counter() - started - local_s + dense_wait_s)
        return loss

    def geo_sync(self) -> None:
        """Geo mode: push the changes since the last sync now, then take the servers' values."""
        self.update.sync()

    def flush(self) -> None:
        """Wait for background pushes and pulls (async) so the servers hold this worker's updates."""
        self.recovery.guard(self._send_parameter_writes, lossy=True)
        self.recovery.guard(self.update.flush, lossy=True)

    def _send_parameter_writes(self) -> None:
        """Parameters the user wrote since fleet last set them replace the servers' values, as they would
        replace a single process's: model.load_state_dict, clamping or re-initialising weights by hand."""
        written = [entry for entry in self.tables.entries if entry.written()]
        if not written:
            return
        self.update.discard_pull()
        futures = [self.client.set_dense_values(entry.table_id, entry.values(), entry.version) for entry in written]
        for future in futures:
            future.result()
        for entry in written:
            entry.mark_clean()
            if self.mode.steps_locally:
                entry.rebase()  # the write is the servers' value now, not a delta to add

    # ------------------------------------------------------------------ state dicts
    def state_dict(self) -> dict[str, Any]:
        """torch's format, holding the servers' optimizer state for the dense parameters (geo: the local one).

        Sparse tables' rows and their optimizer state are not in it: save them with fleet.save_persistables.
        """
        if self.mode.steps_locally or not self.tables.entries:
            return self._inner.state_dict()
        self.flush()
        futures = [self.client.dense_state(entry.table_id) for entry in self.tables.entries]
        server_state: dict[Any, dict[str, Any]] = {}
        for entry, future in zip(self.tables.entries, futures, strict=True):
            read = self.recovery.guard(future.result)
            spec = OptimizerSpec.from_torch(type(self._inner), entry.group, where="by the parameter server")
            offset = 0
            for index, p in enumerate(entry.params):
                n = p.numel()
                pieces = {name: t[offset : offset + n].view_as(p).clone() for name, t in read.named.items()}
                per_param = torch_param_state(spec, pieces, int(read.param_steps[index]))
                if per_param:
                    server_state[p] = per_param
                offset += n
        held = {p for entry in self.tables.entries for p in entry.params}
        local = self._inner.state
        merged = defaultdict(dict, {p: v for p, v in local.items() if p not in held})
        merged.update(server_state)
        self._inner.state = merged  # torch's own packing (param indices, param_groups) over the servers' state
        try:
            return self._inner.state_dict()
        finally:
            self._inner.state = local

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the user's optimizer (param groups, lr, ...) and send the dense optimizer state to the servers."""
        self._inner.load_state_dict(state_dict)
        if self.mode.steps_locally or not self.tables.entries:
            return  # geo steps with the local optimizer: its state is where it belongs
        self.flush()
        futures = []
        for entry in self.tables.entries:
            spec = OptimizerSpec.from_torch(type(self._inner), entry.group, where="by the parameter server")
            names = ServerOptimizer(spec).state_names
            flat = {name: torch.zeros(entry.size) for name in names}
            if "sum" in flat:
                flat["sum"].fill_(spec.initial_accumulator_value)
            steps = torch.zeros(len(entry.params), dtype=torch.int64)
            offset = 0
            for index, p in enumerate(entry.params):
                n = p.numel()
                loaded = self._inner.state.get(p, {})
                for name in names:
                    if loaded.get(name) is not None:
                        flat[name][offset : offset + n] = loaded[name].detach().reshape(-1).to(torch.float32)
                steps[index] = param_step(loaded)
                offset += n
            futures.append(self.client.set_dense_optimizer_state(entry.table_id, flat, steps, int(steps.max())))
        for future in futures:
            self.recovery.guard(future.result)
        for entry in self.tables.entries:
            for p in entry.params:  # the servers hold it now; a stale local copy would only mislead
                self._inner.state.pop(p, None)

    def refresh(self) -> None:
        """Pull the servers' current dense values into the parameters (after a load or a restart)."""
        self.tables.refresh()
        if not self.mode.steps_locally and self.sparse:
            # Each table's own version (its oldest shard's): a table added after step 0 is behind the dense
            # ones, and a later pull or push at the dense version would wait for steps that never come.
            servers = self.client.stats().result()
            for _, _, rows in self.sparse:
                rows.advance(min(int(s["tables"][str(rows.table_id)]["version"]) for s in servers))

    # ------------------------------------------------------------------ errors
    def _name(self, param: torch.Tensor) -> str:
        """The parameter's name in the model (given to distributed_model, or found holding it)."""
        if self._model is not None:
            name = next((n for n, p in self._model.named_parameters() if p is param), None)
            if name is not None:
                return name
        return owners.names_of([param])[0]

    def _explain(self, exc: PSRemoteError) -> Exception:
        """A server's structured error in this worker's terms: the parameters by name."""
        details = exc.details
        code = details.get("code")
        if code == "trainable_mismatch":
            entry = next((e for e in self.tables.entries if e.table_id == details["table"]), None)
            param = entry.params[details["parameter"]] if entry is not None else None
            name = owners.names_of([param])[0] if param is not None else f"parameter {details['parameter']}"
            return FleetError(
                f"Workers disagree about which parameters train: {name!r} trains (requires_grad=True) on worker "
                f"{details['trains_on']} but is frozen on worker {details['frozen_on']} in the same step. Freeze "
                "and unfreeze parameters the same way on every worker (the change takes effect at the next step)."
            )
        if code == "conflicting_create":
            return explain_conflict(details, self._worker) or exc
        return exc


def _dense_names(names: TableNames, index: int, params: list[torch.Tensor]) -> dict[str, Any]:
    """A dense table's names for its create: the parameters' paths, and the table in words (none when some
    parameter is held by no model)."""
    held = names.params(params)
    return {} if held is None else {"name": dense_name(index, held), "names": held}


def torch_param_state(spec: OptimizerSpec, pieces: dict[str, torch.Tensor], step: int) -> dict[str, Any]:
    """One parameter's state as the torch.optim class of ``spec`` keeps it ({} where torch keeps none)."""
    return spec.rule.torch_state(pieces, step)


def param_step(state: dict[str, Any]) -> int:
    """The step count the servers need for one parameter's loaded torch state."""
    if "step" in state:
        return int(float(state["step"]))
    return 1 if state.get("momentum_buffer") is not None else 0  # SGD counts no steps; a buffer means it stepped


def _fingerprint(buffer: torch.Tensor) -> float:
    """A 48-bit hash of a buffer's bytes, as a float64 (exact): equal buffers, equal fingerprints."""
    raw = buffer.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    return float(int.from_bytes(hashlib.blake2b(raw.tobytes(), digest_size=6).digest(), "little"))
