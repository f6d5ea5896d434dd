"""A parameter-server job refuses a torch.distributed default group the script made itself.

fleet gives a parameter-server job's workers no process group: they share parameters only
through the servers. A group found in one of its processes was made by the script
(:mod:`fleet.runtime.default_group`), typically by its own distributed mode switched on by the
torchrun variables fleetrun sets for workers (Facebook's DLRM: DDP on the MLPs, embedding
tables split over the ranks, ``all_to_all``). That mode builds a different model on each
worker and communicates behind the servers' back, so the job would fail far away (a
conflicting table create, a gloo "Connection closed by peer" once a server leaves) or train
differently from one process; under rank-only launchers the group even counts the servers,
which leave it at ``fleet.init()``. The check runs at ``fleet.init()`` (group made before),
at ``fleet.distributed_optimizer`` and at every ``optimizer.step()`` (made after): one
``is_initialized`` test.

With ``dense_placement="allreduce"`` fleet makes the workers' default group itself
(:mod:`fleet.strategies.ps_workers_group`); that one is fleet's (:func:`default_group.found` passes
over it), and a script's own is refused all the same: fleet's would be a second default group.
"""

from __future__ import annotations

from typing import Any

from fleet.runtime import default_group


def refuse_user_group(config: Any, role: Any, when: str) -> None:
    """Raise :class:`~fleet.errors.UserProcessGroupError` if the script made a default group.

    ``when``: "before fleet.init()" or "after fleet.init()".
    """
    found = default_group.found()
    if found is None:
        return
    job = f"this parameter-server job (mode='ps', update={config.update!r}; this process is {role.name})"
    servers = (
        " It counts the servers as ranks, and they leave it at fleet.init() to serve."
        if found.world_size != role.worker_num
        else ""
    )
    shared = (
        "The workers of this parameter-server job average their dense layers through the process group fleet makes "
        "for them at fleet.init() (dense_placement='allreduce') and share the tables through the servers"
        if getattr(config, "dense_placement", "servers") == "allreduce"
        else "The workers of a parameter-server job share parameters only through the servers and have no process group"
    )
    raise default_group.refuse(
        found,
        job,
        when,
        f"{shared}: a script's own distributed mode (DDP, DistributedSampler, embedding tables split over the ranks, "
        f"all_to_all) builds a different model on each worker or trains differently from one process.{servers}",
        "Remove the init_process_group call and what it switches on (fleet.distributed_loader shards the data, "
        "fleet.metrics reduces metrics over the workers). Under fleetrun every worker sees torchrun's variables "
        "(WORLD_SIZE, RANK, ...): a script that turns on its own distributed mode from them must keep it off in a "
        "fleet job (test fleet.worker_num() / fleet.is_server() rather than WORLD_SIZE).",
    )
