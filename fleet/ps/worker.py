"""The worker side of parameter-server training: a wrapped optimizer over a PSClient.

Each param group becomes one flat dense table (worker 0's values win and every
worker starts from them); each :class:`fleet.nn.SparseEmbedding` the optimizer
holds becomes one sparse table. ``step()`` then trains in the strategy's mode:

- sync: push every table's gradient for step ``version`` with the group's current
  lr, pull ``min_version=version + 1`` (dense now, sparse rows at the next forward).
  With backup workers a late push is stale (the server already closed that step
  without it): it is dropped and counted, and since the shard is then past
  ``version`` the pull returns at once with the current values, which the worker
  adopts as its new version (``stale_dropped`` counts this worker's dropped pushes);
- async: pushes and the dense pull run in the background (bounded in flight), so
  the next forward starts at once with the values of the last finished pull;
- geo: the user's optimizer steps locally (rows in a local cache); every
  ``k_steps`` the deltas since the last sync are pushed and the values rebased.

Server restarts (``fleetrun --max-restarts K``, seen as ``FLEET_MAX_RESTARTS`` > 0):
in async and geo mode a :class:`~fleet.ps.errors.PSServerUnavailable` during
``step()``, ``flush()`` or a SparseEmbedding pull is not fatal. The worker waits
(up to the strategy's ``timeout_s``) until every server answers HELLO again,
re-sends its table creates (no-ops for the tables the restarted server loaded
from its last checkpoint; worker 0's current values otherwise), pulls the dense
values again and drops its cached geo rows, then goes on. The updates the
restarted server applied after its last checkpoint are lost (its shards roll
back to the checkpoint), and so are this worker's pushes that were in flight.
In sync mode the restarted shards come back at their checkpoint's version while
the other servers' shards are ahead, so the whole job rolls back instead: every
worker goes to a barrier, worker 0 has every server load the last checkpoint
written by ``fleet.save_persistables``, and after a second barrier every worker
pulls the values and versions again (the steps since that checkpoint are lost; a
sync job that saved no checkpoint yet cannot recover and raises, saying so).
Without restarts every server failure raises, naming the server index and endpoint.
"""

from __future__ import annotations

import json
import re
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from fleet import env, owners
from fleet.errors import FleetError, ModelMismatchError
from fleet.nn.sparse_embedding import SparseEmbedding, sparse_modules
from fleet.optimizer import WrappedOptimizer
from fleet.ps.aggregator import FROZEN, HAS_GRAD, NO_GRAD
from fleet.ps.client import PSClient
from fleet.ps.errors import PSAuthError, PSRemoteError, PSServerUnavailable
from fleet.ps.id_index import IdIndex
from fleet.ps.optim import OptimizerSpec
from fleet.ps.sparse_table import SparseTable

MAX_IN_FLIGHT = 4  # async: pushes waiting for an answer before step() blocks on the oldest


def _model_mismatch(exc: PSRemoteError, dense: list[_Dense], worker: int, model: Any) -> Exception:
    """Turn a conflicting table create into a message naming the first parameter that differs."""
    found = re.search(r"with config (\{.*?\}), this create asks for \w+ with config (\{.*\})", str(exc))
    if "conflicting create" not in str(exc) or not found:
        return exc
    theirs, mine = (json.loads(text).get("shapes") for text in found.groups())
    if theirs is None or mine is None or theirs == mine:
        return exc
    params = next((d.params for d in dense if len(d.params) == len(mine)), [])
    names = {id(p): n for n, p in model.named_parameters()} if model is not None else owners.find_owners(params)
    names = {k: (v.name if isinstance(v, owners.Owner) else v) for k, v in names.items()}
    for position, (a, b) in enumerate(zip(theirs, mine, strict=False)):
        if a != b:
            name = names.get(id(params[position]), f"parameter {position}") if position < len(params) else position
            return ModelMismatchError(
                f"Workers hold different models: {name!r} has shape {b} on worker {worker} but {a} on the worker "
                "that created the parameter-server table first. Every worker must build the same model."
            )
    return ModelMismatchError(
        f"Workers hold different models: worker {worker} has {len(mine)} parameters in a param group where "
        f"the first worker had {len(theirs)}. Every worker must build the same model and optimizer."
    )


class _Dense:
    """One param group's flat table. The group is looked up each time: load_state_dict replaces the dicts."""

    def __init__(self, table_id: int, optimizer: torch.optim.Optimizer, index: int):
        self.table_id = table_id
        self.optimizer = optimizer
        self.index = index
        self.params = [p for p in self.group["params"] if p.numel() > 0]
        self.size = sum(p.numel() for p in self.params)
        self.version = 0

    @property
    def group(self) -> dict[str, Any]:
        return self.optimizer.param_groups[self.index]

    def values(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params]) if self.params else torch.zeros(0)

    def grads(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The flat gradient, and (only when some parameter has none) a uint8 presence flag per parameter.

        A parameter without a gradient (frozen, or unused by this worker) counts as zero in the
        servers' average, and one that no worker has a gradient for is not stepped at all, as
        torch.optim skips a parameter whose ``.grad`` is None. Sparse gradients (an
        ``nn.Embedding(sparse=True)`` in a dense table) travel dense.
        """
        parts, flags = [], []
        for p in self.params:
            grad = p.grad
            if grad is None:
                parts.append(torch.zeros(p.numel(), dtype=torch.float32))
                flags.append(NO_GRAD if p.requires_grad else FROZEN)
            else:
                parts.append((grad.to_dense() if grad.is_sparse else grad).detach().reshape(-1))
                flags.append(HAS_GRAD)
        flat = torch.cat(parts) if parts else torch.zeros(0)
        return flat, None if all(f == HAS_GRAD for f in flags) else torch.tensor(flags, dtype=torch.uint8)

    @torch.no_grad()
    def assign(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p))
            offset += n


class _RemoteRows:
    """A SparseEmbedding's rows on the servers (sync/async): each forward pulls its unique ids."""

    def __init__(self, client: PSClient, table_id: int, sync: bool = True):
        self.client = client
        self.table_id = table_id
        self.sync = sync
        self.version = 0
        self.guard: Callable[[Callable[[], Any]], Any] = lambda fn: fn()  # set by PSOptimizer: server restarts

    def pull(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.guard(lambda: self.client.pull_sparse(self.table_id, ids, self.version).result())
        if self.sync and self.version:
            # backup workers: a late worker finds the shards ahead and pushes for their version. (Only
            # with min_version > 0 is every server asked, so that ps_version is the oldest shard's.)
            self.version = max(self.version, int(getattr(rows, "ps_version", 0)))
        return rows


class _GeoRows:
    """Geo mode: rows cached locally, trained by the local optimizer, synced every k steps."""

    def __init__(self, client: PSClient, table_id: int, module: SparseEmbedding, spec: OptimizerSpec):
        self.client = client
        self.table_id = table_id
        self.module = module
        self.local = SparseTable(module.embedding_dim, spec, module.initializer, module.seed)
        self.base = SparseTable(module.embedding_dim, spec, module.initializer, module.seed)
        self.known = IdIndex()  # ids whose rows came from the servers: O(batch) per check, not O(seen)
        self.touched: list[torch.Tensor] = []
        self.guard: Callable[[Callable[[], Any]], Any] = lambda fn: fn()  # set by PSOptimizer: server restarts

    def forget(self) -> None:
        """After a server restart: every row is fetched from the servers again; unsynced changes are dropped."""
        self.known = IdIndex()
        self.touched = []

    def _fetch(self, ids: torch.Tensor) -> None:
        missing = ids[self.known.lookup(ids) < 0]
        if missing.numel():
            new = torch.unique(missing)
            self._rebase(new, self.client.pull_sparse(self.table_id, new).result())
            self.known.insert_new(new)  # only once the rows arrived

    def _rebase(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        self.local.add_delta(ids, rows - self.local.pull(ids))
        self.base.add_delta(ids, rows - self.base.pull(ids))

    def pull(self, ids: torch.Tensor) -> torch.Tensor:
        self.guard(lambda: self._fetch(ids))
        return self.local.pull(ids)

    def apply(self, ids: torch.Tensor, grads: torch.Tensor, lr: float) -> None:
        if ids.numel():
            self.local.apply_gradient(ids, grads, lr)
            self.touched.append(ids)

    def sync(self) -> None:
        if not self.touched:
            return
        ids = torch.unique(torch.cat(self.touched))
        self.touched = []
        delta = self.local.pull(ids) - self.base.pull(ids)
        self.client.push_sparse_delta(self.table_id, ids, delta).result()
        self._rebase(ids, self.client.pull_sparse(self.table_id, ids).result())


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
    ):
        super().__init__(optimizer)
        self.client = client
        self.mode = config.update
        self.k_steps = max(1, int(getattr(config, "k_steps", 1) or 1))
        self.is_first = role.worker_index == 0
        self._local_steps = 0
        self._local_s = 0.0
        self._pushes: deque[Future] = deque()
        self._pull: list[Future] | None = None
        self.restartable = (env.current().int(env.FLEET_MAX_RESTARTS, 0) or 0) > 0
        self.last_checkpoint: str | None = None  # set by fleet.save_persistables / load_persistables
        self.server_restarts = 0  # server restarts this worker recovered from
        self._creates: list[Callable[[], Future]] = []  # re-sent after a server restart
        self._new_table = new_table
        self._base = {"update": self.mode, "backup_workers": int(config.backup_workers)}
        self._worker = role.worker_index
        self._model = model
        self.dense: list[_Dense] = []
        self.sparse: list[tuple[SparseEmbedding, int, Any]] = []  # (module, param group index, rows)
        self._groups: list[list[int]] = []  # the parameters of each param group with a table, by id
        indices = range(len(optimizer.param_groups))
        created = [f for i in indices for f in self._add_dense(i)] + [f for i in indices for f in self._add_sparse(i)]
        self._settle(created, self.dense)

    def _add_dense(self, index: int) -> list[Future]:
        entry = _Dense(self._new_table(), self._inner, index)
        self._groups.append([id(p) for p in entry.group["params"]])
        if entry.size == 0:
            return []
        spec = OptimizerSpec.from_torch(type(self._inner), entry.group)
        # The shapes travel in the config: a worker whose model differs gets a conflicting create.
        cfg = {**self._base, "optimizer": spec.to_config(), "shapes": [list(p.shape) for p in entry.params]}
        cfg = cfg if self.is_first else {**cfg, "size": entry.size}
        self._creates.append(
            lambda e=entry, c=cfg: self.client.create_dense(e.table_id, e.values() if self.is_first else None, c)
        )
        self.dense.append(entry)
        return [self._creates[-1]()]

    def _add_sparse(self, index: int) -> list[Future]:
        futures = []
        group = self._inner.param_groups[index]
        for module, _ in sparse_modules(self._inner, [group]):
            spec = OptimizerSpec.from_torch(type(self._inner), group)
            table_id = self._new_table()
            sparse_cfg = {**self._base, **module.table_config(spec)}
            self._creates.append(lambda t=table_id, c=sparse_cfg: self.client.create_sparse(t, c))
            futures.append(self._creates[-1]())
            if self.mode == "geo":
                rows: Any = _GeoRows(self.client, table_id, module, module.optimizer_override or spec)
            else:
                rows = _RemoteRows(self.client, table_id, sync=self.mode == "sync")
            rows.guard = self._guard
            module.remote = rows
            module.table = None
            self.sparse.append((module, index, rows))
        return futures

    def _settle(self, created: list[Future], entries: list[_Dense], check_values: bool = False) -> None:
        """Wait for the tables' creation, then start every worker from worker 0's values."""
        for future in created:
            try:
                future.result()
            except PSRemoteError as exc:
                raise _model_mismatch(exc, self.dense, self._worker, self._model) from None
        pulls = [self.client.pull_dense(d.table_id) for d in entries]
        for entry, future in zip(entries, pulls, strict=True):
            values = future.result()
            if check_values and not torch.equal(values, entry.values()):
                raise FleetError(
                    f"The parameters of param group {entry.index}, added to the optimizer with add_param_group on "
                    f"the unwrapped optimizer, hold different values on worker {self._worker} than on worker 0, so "
                    "this worker's forward pass used values the job does not train. Call add_param_group on the "
                    "optimizer fleet.distributed_optimizer returned (it gives every worker worker 0's values), or "
                    "initialise them identically on every worker."
                )
            entry.assign(values)
            entry.version = int(values.ps_version)
            entry.base = entry.values().clone()  # type: ignore[attr-defined]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._inner.add_param_group(param_group)
        self._adopt_new_groups(check_values=False)

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
        if len(groups) == len(self._groups):
            return
        self._flush()  # async: nothing in flight refers to the old list of tables
        first = len(self.dense)
        indices = range(len(self._groups), len(groups))
        created = [f for i in indices for f in self._add_dense(i)] + [f for i in indices for f in self._add_sparse(i)]
        self._settle(created, self.dense[first:], check_values=check_values and not self.is_first)

    @property
    def stale_dropped(self) -> int:
        """This worker's pushes the servers dropped as stale (sync with backup workers), per table and server."""
        return self.client.stale_pushes

    # ------------------------------------------------------------------ step
    def step(self, closure=None):  # noqa: D102
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._adopt_new_groups()
        started = time.perf_counter()
        if self.mode == "sync":
            self._guard(self._sync_step)
        elif self.mode == "async":
            self._guard(self._async_step)
        else:
            self._guard(self._geo_step)
        comm_s = time.perf_counter() - started - self._local_s
        self._local_s = 0.0
        self.metrics.set_dropped(self.stale_dropped)
        self._end_step(comm_s=comm_s)  # step timings, straggler watch and injection (fleet.metrics / fleet.inject)
        return loss

    def _push_sparse(self) -> list[Future]:
        futures = []
        for module, index, rows in self.sparse:
            ids, grads = module.take_gradients()
            lr = float(self._inner.param_groups[index]["lr"])
            futures.append(self.client.push_sparse_grad(rows.table_id, ids, grads, rows.version, lr))
        return futures

    def _sync_step(self) -> None:
        try:
            self._sync_push_pull()
        except PSRemoteError as exc:
            raise self._explain(exc) from None

    def _explain(self, exc: PSRemoteError) -> Exception:
        """A server's structured error, in this worker's terms (parameter names)."""
        details = exc.details
        if details.get("code") != "trainable_mismatch":
            return exc
        entry = next((d for d in self.dense if d.table_id == details["table"]), None)
        param = entry.params[details["parameter"]] if entry is not None else None
        name = owners.names_of([param])[0] if param is not None else f"parameter {details['parameter']}"
        return FleetError(
            f"Workers disagree about which parameters train: {name!r} trains (requires_grad=True) on worker "
            f"{details['trains_on']} but is frozen on worker {details['frozen_on']} in the same step. Freeze and "
            "unfreeze parameters the same way on every worker (the change takes effect at the next step)."
        )

    def _sync_push_pull(self) -> None:
        futures = []
        for d in self.dense:
            grad, present = d.grads()
            futures.append(self.client.push_dense_grad(d.table_id, grad, d.version, float(d.group["lr"]), present))
        futures += self._push_sparse()
        for future in futures:
            future.result()
        pulls = [self.client.pull_dense(d.table_id, d.version + 1) for d in self.dense]
        for entry, future in zip(self.dense, pulls, strict=True):
            values = future.result()
            entry.assign(values)
            entry.version = int(values.ps_version)
        for _, _, rows in self.sparse:
            rows.version += 1

    def _async_step(self) -> None:
        for d in self.dense:
            grad, present = d.grads()
            self._pushes.append(self.client.push_dense_grad(d.table_id, grad, 0, float(d.group["lr"]), present))
        self._pushes.extend(self._push_sparse())
        while self._pushes and (len(self._pushes) > MAX_IN_FLIGHT or self._pushes[0].done()):
            self._pushes.popleft().result()
        if self._pull is not None and all(f.done() for f in self._pull):
            for entry, future in zip(self.dense, self._pull, strict=True):
                entry.assign(future.result())
            self._pull = None
        if self._pull is None and self.dense:
            self._pull = [self.client.pull_dense(d.table_id) for d in self.dense]

    def _geo_step(self) -> None:
        started = time.perf_counter()
        self._inner.step()
        for module, index, rows in self.sparse:
            ids, grads = module.take_gradients()
            rows.apply(ids, grads, float(self._inner.param_groups[index]["lr"]))
        self._local_s = time.perf_counter() - started  # computation, not communication
        self._local_steps += 1
        if self._local_steps % self.k_steps == 0:
            self.geo_sync()

    def geo_sync(self) -> None:
        """Push the changes since the last sync, then take the servers' values."""
        futures = [self.client.push_dense_delta(d.table_id, d.values() - d.base) for d in self.dense]  # type: ignore[attr-defined]
        for future in futures:
            future.result()
        for _, _, rows in self.sparse:
            rows.sync()
        pulls = [self.client.pull_dense(d.table_id) for d in self.dense]
        for entry, future in zip(self.dense, pulls, strict=True):
            values = future.result()
            entry.assign(values)
            entry.base = values.clone()  # type: ignore[attr-defined]

    # ------------------------------------------------------------- server restarts
    def _guard(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn``; with restarts, a lost server is waited for and resynchronised with (:meth:`_recover`).

        A step or flush is not retried (its pushes are lost; the next step goes on from the servers'
        values); anything else (a pull for a forward) runs again.
        """
        while True:
            try:
                return fn()
            except PSAuthError:
                raise
            except PSServerUnavailable as exc:
                if not self.restartable:
                    raise
                self._recover(exc)
                if fn in (self._sync_step, self._async_step, self._geo_step, self._flush):
                    return None  # this step's pushes are lost; the next step goes on from the servers' values

    def _recover(self, exc: PSServerUnavailable) -> None:
        """Wait for the restarted server, re-create the tables it lacks and take the servers' values."""
        timeout_s = self.client.timeout_s
        print(
            f"fleet: worker {self.client.worker_index}: {exc}; waiting up to {timeout_s:.0f} s for its restart",
            flush=True,
        )
        for future in [*self._pushes, *(self._pull or [])]:
            try:
                future.result()
            except Exception:  # noqa: BLE001 - lost with the server; the values are pulled again below
                pass
        self._pushes.clear()
        self._pull = None
        self.client.wait_for_servers(timeout_s, cause=exc)
        if self.mode == "sync":
            self._roll_back(exc)
            return
        for future in [create() for create in self._creates]:
            future.result()
        self.refresh()
        for _, _, rows in self.sparse:
            if isinstance(rows, _GeoRows):
                rows.forget()
        self.server_restarts += 1
        print(
            f"fleet: worker {self.client.worker_index}: parameter server {exc.server_index} is back; "
            f"resynchronised (server restart {self.server_restarts})",
            flush=True,
        )

    def _roll_back(self, exc: PSServerUnavailable) -> None:
        """Sync: every worker and every server go back to the last checkpoint together."""
        if self.last_checkpoint is None:
            raise PSServerUnavailable(
                f"{exc} The server was restarted, but a sync job can only resume from a checkpoint that every "
                "server loads together, and none was saved yet: call fleet.save_persistables(dirname) periodically.",
                server_index=exc.server_index,
                endpoint=exc.endpoint,
                op=exc.op,
            ) from exc
        self.client.barrier().result()  # nobody pushes while the servers reload
        if self.is_first:
            self.client.load(self.last_checkpoint).result()
        self.client.barrier().result()
        self.refresh()
        self.server_restarts += 1
        print(
            f"fleet: worker {self.client.worker_index}: parameter server {exc.server_index} is back; every "
            f"server rolled back to {self.last_checkpoint} (server restart {self.server_restarts})",
            flush=True,
        )

    # ------------------------------------------------------------------ lifecycle
    def flush(self) -> None:
        """Wait for background pushes and pulls (async) so the servers hold this worker's updates."""
        self._guard(self._flush)

    def _flush(self) -> None:
        while self._pushes:
            self._pushes.popleft().result()
        if self._pull is not None:
            for entry, future in zip(self.dense, self._pull, strict=True):
                entry.assign(future.result())
            self._pull = None

    def refresh(self) -> None:
        """Pull the servers' current dense values into the parameters (after a load)."""
        pulls = [self.client.pull_dense(d.table_id) for d in self.dense]
        for entry, future in zip(self.dense, pulls, strict=True):
            values = future.result()
            entry.assign(values)
            entry.version = int(values.ps_version)
            entry.base = values.clone()  # type: ignore[attr-defined]
        for _, _, rows in self.sparse:
            if isinstance(rows, _RemoteRows) and self.dense:
                rows.version = self.dense[0].version  # sync: every table advances once per step
