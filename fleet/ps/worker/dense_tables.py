"""A worker's dense tables: one flat table per param group, created on the servers, read back one way.

Each param group of the wrapped optimizer becomes one table (its parameters back to back;
worker 0's values win and every worker starts from them). :meth:`DenseTables.adopt` is the
one path by which server values reach the parameters (at creation, after every sync step,
geo sync, async pull, load and server restart): assign, then optionally the version the
values belong to and the geo base.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from fleet.errors import FleetError
from fleet.ps.client.client import PSClient
from fleet.ps.protocol.errors import PSRemoteError
from fleet.ps.protocol.wire import FROZEN, HAS_GRAD, NO_GRAD
from fleet.sparse.optim import OptimizerSpec
from fleet.sparse.row_optimizers.rowwise_adagrad import RowWiseAdagrad
from fleet.training import owners


class GroupTable:
    """One param group's flat table. The group is looked up each time: load_state_dict replaces the dicts."""

    def __init__(self, table_id: int, optimizer: torch.optim.Optimizer, index: int):
        self.table_id = table_id
        self.optimizer = optimizer
        self.index = index
        self.params = [p for p in self.group["params"] if p.numel() > 0]
        self.size = sum(p.numel() for p in self.params)
        self.version = 0
        self.base = torch.zeros(0)  # geo: the values at the last sync
        self._written_at = self._param_versions()

    @property
    def group(self) -> dict[str, Any]:
        return self.optimizer.param_groups[self.index]

    @property
    def lr(self) -> float:
        return float(self.group["lr"])

    def values(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params]) if self.params else torch.zeros(0)

    def rebase(self, values: torch.Tensor | None = None) -> None:
        """Geo: ``values`` (default: the parameters now) are the servers' values, not a delta to add."""
        self.base = self.values() if values is None else values.clone()

    def at_version(self, version: int) -> None:
        """The servers' version these parameters hold."""
        self.version = version

    def grads(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The flat gradient, and (only when some parameter has none) a uint8 flag per parameter:
        HAS_GRAD, NO_GRAD (trainable, no gradient here) or FROZEN (``requires_grad=False``).

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
                if grad.is_sparse and isinstance(self.optimizer, RowWiseAdagrad):
                    held_by = owners.find_owners([p])[id(p)].module
                    torch_class = type(held_by).__name__ if held_by is not None else "nn.Embedding"
                    fleet_class = (
                        "SparseEmbeddingBag" if isinstance(held_by, torch.nn.EmbeddingBag) else "SparseEmbedding"
                    )
                    raise FleetError(
                        f"a parameter of shape {tuple(p.shape)} has a sparse gradient ({torch_class}(sparse=True)) "
                        "and RowWiseAdagrad would step its rows row-wise, but the parameter servers hold dense "
                        f"parameters as flat blocks and step them element-wise: use fleet.nn.{fleet_class} for a "
                        "row-wise table in a parameter-server job (or torch.optim.Adagrad for this parameter)."
                    )
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
        self.mark_clean()

    def _param_versions(self) -> list[int]:
        return [p._version for p in self.params]

    def mark_clean(self) -> None:
        """The parameters hold what fleet put there (server values, or geo's own local step)."""
        self._written_at = self._param_versions()

    def written(self) -> bool:
        """Whether the user wrote the parameters since fleet last did (model.load_state_dict, clamping, ...).

        Every in-place write bumps a tensor's version counter, so this costs one integer per parameter.
        """
        return self._param_versions() != self._written_at


class DenseTables:
    """The optimizer's group tables on the servers."""

    def __init__(
        self,
        client: PSClient,
        optimizer: torch.optim.Optimizer,
        base_config: dict[str, Any],
        is_first: bool,
        new_table: Callable[[], int],
    ):
        self.client = client
        self.optimizer = optimizer
        self.base_config = base_config
        self.is_first = is_first
        self.new_table = new_table
        self.entries: list[GroupTable] = []
        self.creates: list[Callable[[], Future]] = []  # every table's create, re-sent after a server restart

    def create(
        self, index: int, naming: Callable[[int, list[torch.Tensor]], dict[str, Any]] | None = None
    ) -> list[Future]:
        """Create param group ``index``'s table (nothing for a group without dense parameters).

        ``naming(index, params)``: the table's names in the model, added to its config
        (:mod:`fleet.ps.worker.table_names`).
        """
        entry = GroupTable(self.new_table(), self.optimizer, index)
        if entry.size == 0:
            return []
        spec = OptimizerSpec.from_torch(type(self.optimizer), entry.group, where="by the parameter server")
        # The shapes (and names) travel in the config: a worker whose model differs gets a conflicting create.
        cfg = {**self.base_config, "optimizer": spec.to_config(), "shapes": [list(p.shape) for p in entry.params]}
        if naming is not None:
            cfg.update(naming(index, entry.params))
        cfg = cfg if self.is_first else {**cfg, "size": entry.size}
        self.creates.append(
            lambda: self.client.create_dense(entry.table_id, entry.values() if self.is_first else None, cfg)
        )
        self.entries.append(entry)
        return [self.creates[-1]()]

    def pull(self, entries: Sequence[GroupTable] | None = None, min_versions: Sequence[int] | None = None) -> list:
        entries = self.entries if entries is None else entries
        versions = min_versions or [0] * len(entries)
        return [self.client.pull_dense(e.table_id, v) for e, v in zip(entries, versions, strict=True)]

    def adopt(
        self,
        futures: Sequence[Future],
        entries: Sequence[GroupTable] | None = None,
        version: bool = True,
        base: bool = False,
        check: Callable[[GroupTable, torch.Tensor], None] | None = None,
    ) -> None:
        """Take the pulled values into the parameters (and their version, and the geo base)."""
        for entry, future in zip(self.entries if entries is None else entries, futures, strict=True):
            values = future.result()
            if check is not None:
                check(entry, values)
            entry.assign(values)
            if version:
                entry.at_version(int(values.ps_version))
            if base:
                entry.rebase(values)

    def refresh(self, entries: Sequence[GroupTable] | None = None) -> None:
        """Every value, version and base from the servers (after a create, a load or a server restart)."""
        self.adopt(self.pull(entries), entries, version=True, base=True)

    def settle(
        self,
        created: list[Future],
        entries: list[GroupTable],
        explain: Callable[[PSRemoteError], Exception],
        worker: int,
        check_values: bool = False,
    ) -> None:
        """Wait for new tables to exist, then start every worker from worker 0's values."""
        for future in created:
            try:
                future.result()
            except PSRemoteError as exc:
                raise explain(exc) from None

        def same_as_worker_0(entry: GroupTable, values: torch.Tensor) -> None:
            if not torch.equal(values, entry.values()):
                raise FleetError(
                    f"The parameters of param group {entry.index}, added to the optimizer with add_param_group on "
                    f"the unwrapped optimizer, hold different values on worker {worker} than on worker 0, so this "
                    "worker's forward pass used values the job does not train. Call add_param_group on the "
                    "optimizer fleet.distributed_optimizer returned (it gives every worker worker 0's values), or "
                    "initialise them identically on every worker."
                )

        self.adopt(
            self.pull(entries), entries, version=True, base=True, check=same_as_worker_0 if check_values else None
        )
