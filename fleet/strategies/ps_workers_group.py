"""The workers' own process group in a parameter-server job whose dense layers are all-reduced.

With ``DistributedStrategy(mode="ps", dense_placement="allreduce")`` (PERSIA's hybrid) the
servers hold only the sparse tables; the dense parameters stay on the workers and are averaged
every step by the collective engine's gradient synchroniser
(:class:`~fleet.collective.grad_sync.GradSync`: shared memory among the workers of one host,
the process group across hosts). That needs a group of the workers alone, which a plain
parameter-server job never makes (its workers share parameters only through the servers).

How it is formed: every process of the job, servers included, joins the rendezvous store at
``fleet.init()`` (the join authenticates all of them under the job's secret, so it must count
every process; a server then leaves the store alone and serves). The workers then make
torch.distributed's default group over that store under a prefix of their own, with the worker
index as rank and the worker count as world size: the servers are never ranks of it. Heartbeats
go through the same store under another prefix, so that a collective that fails names the
worker that stopped (:mod:`fleet.collective.liveness`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fleet.collective import transports
from fleet.collective.grad_sync import GradSync
from fleet.collective.liveness import Liveness
from fleet.errors import FleetError, StoreTamperedError
from fleet.runtime import default_group

GROUP_PREFIX = "ps-workers/pg"
HEARTBEAT_PREFIX = "ps-workers/hb"


def need_master(role: Any) -> None:
    """The workers' group meets at the rendezvous store: refuse a launch that gives it no address."""
    if role.master is None:
        raise FleetError(
            f"DistributedStrategy(dense_placement='allreduce') makes a process group of the workers, which meet at "
            f"the job's rendezvous store, but {role.name} has no rendezvous address (launched with source "
            f"{role.source!r}). Launch with fleetrun (it sets FLEET_MASTER), torchrun, mpirun or srun, or set "
            "FLEET_MASTER=host:port of worker 0 on every process; or keep dense_placement='servers'."
        )


_heartbeats: Liveness | None = None  # this process's, shared by a strategy that replaced the one made at init


class WorkersGroup:
    """The default process group of the workers (no servers in it), its heartbeats and its synchroniser.

    The group is made at ``fleet.init()``; the synchroniser (and its transport: shared memory is
    mapped then) at the first ``fleet.distributed_optimizer``, so that a strategy replaced before
    anything was wrapped leaves nothing behind.
    """

    def __init__(self, runtime: Any, config: Any):
        self.config = config
        self.liveness: Liveness | None = None
        self.group: Any = None
        self._sync: GradSync | None = None
        if runtime.role.worker_num > 1:
            self.group, self.liveness = _join(runtime, config)

    @property
    def sync(self) -> GradSync:
        """The job's gradient synchroniser over the workers, shared by every optimizer wrapped (one agreed order)."""
        if self._sync is None:
            config = self.config
            wait_s = config.collective_wait_s  # a live peer is waited for this long (fleet.collective.patience)
            setup = transports.Setup(self.group, wait_s, options=config)
            self._sync = GradSync(
                self.group,
                bucket_bytes=int(config.bucket_mb * (1 << 20)),
                transport=transports.choose(setup),
                timeout_s=wait_s,
                diagnose=self.liveness.describe if self.liveness is not None else None,
                silent_peers=self.liveness.silent_peers if self.liveness is not None else None,
                hooked=self.group is not None,
            )
        return self._sync

    def close(self) -> None:
        """Agree with the other workers that the job is over, then unhook and stop the heartbeats."""
        global _heartbeats
        sync, self._sync = self._sync, None
        try:
            lock = sync.lockstep if sync is not None else None
            if lock is not None and not lock.finished:
                lock.finish()
        finally:
            if sync is not None:
                sync.close()
            if self.liveness is not None:
                self.liveness.close()
                if _heartbeats is self.liveness:
                    _heartbeats = None


def _join(runtime: Any, config: Any) -> tuple[Any, Liveness]:
    """Make (or find, after a strategy was replaced) the workers' default group, and its heartbeats."""
    global _heartbeats
    role = runtime.role
    store = runtime.rendezvous_store()
    if not dist.is_initialized():
        wait_s = max(config.timeout_s, config.collective_wait_s)
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        try:
            dist.init_process_group(
                backend,
                store=dist.PrefixStore(GROUP_PREFIX, store),
                rank=role.worker_index,
                world_size=role.worker_num,
                timeout=timedelta(seconds=wait_s),
            )
        except RuntimeError as error:
            if StoreTamperedError.MARK in str(error):
                raise StoreTamperedError(
                    "a value the workers' process group exchanged does not carry a valid MAC"
                ) from None
            raise
        default_group.made_by_fleet(
            f"this parameter-server job's workers (mode='ps', dense_placement='allreduce'; this process is "
            f"{role.name} of {role.worker_num})"
        )
    elif default_group.found() is not None:  # the script's own group: refused before fleet.init() got here
        raise FleetError("the workers' process group was replaced by the script's own")
    if _heartbeats is None:  # one writer per heartbeat key: a second would look like tampering
        heartbeats = dist.PrefixStore(HEARTBEAT_PREFIX, store)  # signed already: Liveness must not sign again
        _heartbeats = Liveness(
            role.master, HEARTBEAT_PREFIX, role.worker_index, role.worker_num, config.timeout_s, store=heartbeats
        )
    return dist.group.WORLD, _heartbeats
