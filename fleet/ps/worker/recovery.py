"""A worker riding out a parameter-server restart (``fleetrun --max-restarts K``).

In async and geo mode a :class:`~fleet.ps.protocol.errors.PSServerUnavailable` during ``step()``,
``flush()`` or a SparseEmbedding pull is not fatal. The worker waits (up to the strategy's
``timeout_s``) until every server answers HELLO again, re-sends its table creates (no-ops
for the tables the restarted server loaded from its last checkpoint; worker 0's current
values otherwise), pulls the dense values again and drops its cached geo rows, then goes
on. The updates the restarted server applied after its last checkpoint are lost (its shards
roll back to the checkpoint), and so are this worker's pushes that were in flight.

In sync mode the restarted shards come back at their checkpoint's version while the other
servers' shards are ahead, so the whole job rolls back instead: every worker goes to a
barrier, worker 0 has every server load the last checkpoint written by
``fleet.save_persistables``, and after a second barrier every worker pulls the values and
versions again (the steps since that checkpoint are lost; a sync job that saved no
checkpoint yet cannot recover and raises, saying so). Without restarts every server
failure raises, naming the server index and endpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from fleet.ps.protocol.errors import PSAuthError, PSServerUnavailable


class Recoverable(Protocol):
    """What recovery uses of the wrapped optimizer (``fleet.ps.worker.optimizer.PSOptimizer``)."""

    client: Any  # fleet.ps.client.client.PSClient
    mode: Any  # fleet.ps.modes.UpdateMode
    update: Any  # its fleet.ps.modes.WorkerPolicy
    is_first: bool

    def creates(self) -> list[Callable[[], Future]]: ...

    def refresh(self) -> None: ...


class Recovery:
    def __init__(self, opt: Recoverable, restartable: bool):
        self.opt = opt
        self.restartable = restartable
        self._last_checkpoint: str | None = None  # set by fleet.save_persistables / load_persistables
        self.server_restarts = 0  # server restarts this worker recovered from

    @property
    def last_checkpoint(self) -> str | None:
        """Where a sync job rolls back after a server restart: the last save written or loaded."""
        return self._last_checkpoint

    def remember_checkpoint(self, dirname: str) -> None:
        self._last_checkpoint = dirname

    def guard(self, fn: Callable[[], Any], lossy: bool = False) -> Any:
        """Run ``fn``; with restarts, a lost server is waited for and resynchronised with.

        ``lossy`` (a step, a flush): not retried, its pushes are lost and the next step goes on
        from the servers' values; anything else (a pull for a forward) runs again.
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
                if lossy:
                    return None

    def _say(self, text: str) -> None:
        print(f"fleet: worker {self.opt.client.worker_index}: {text}", flush=True)

    def _recover(self, exc: PSServerUnavailable) -> None:
        opt = self.opt
        timeout_s = opt.client.timeout_s
        self._say(f"{exc}; waiting up to {timeout_s:.0f} s for its restart")
        opt.update.drop_in_flight()
        opt.client.wait_for_servers(timeout_s, cause=exc)
        if opt.mode.rolls_back_on_restart:
            self._roll_back(exc)
            return
        for future in [create() for create in opt.creates()]:
            future.result()
        opt.refresh()
        self.server_restarts += 1
        self._say(
            f"parameter server {exc.server_index} is back; resynchronised (server restart {self.server_restarts})"
        )

    def _roll_back(self, exc: PSServerUnavailable) -> None:
        """Sync: every worker and every server go back to the last checkpoint together."""
        opt = self.opt
        if self._last_checkpoint is None:
            raise PSServerUnavailable(
                f"{exc} The server was restarted, but a sync job can only resume from a checkpoint that every "
                "server loads together, and none was saved yet: call fleet.save_persistables(dirname) periodically.",
                server_index=exc.server_index,
                endpoint=exc.endpoint,
                op=exc.op,
            ) from exc
        opt.client.barrier().result()  # nobody pushes while the servers reload
        if opt.is_first:
            opt.client.load(self._last_checkpoint).result()
        opt.client.barrier().result()
        opt.refresh()
        self.server_restarts += 1
        self._say(
            f"parameter server {exc.server_index} is back; every server rolled back to {self._last_checkpoint} "
            f"(server restart {self.server_restarts})"
        )
