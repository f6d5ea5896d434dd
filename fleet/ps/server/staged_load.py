"""A LOAD that changes every table of a server, or none: read and check everything, then swap.

:func:`stage` reads every shard file of a save and the chain it builds on (checksums first,
:mod:`fleet.ps.server.shard_io`), checks each table's kind and config against the table this
server serves, and loads the states into new shards built aside: shapes, dtypes and optimizer
kinds are checked by the very code that loads them. Nothing the server serves is touched. Only
:meth:`StagedLoad.apply` changes the server's table map, and it cannot fail half-way: it puts
the new shards in place of the old ones.

Across servers the worker that loads asks every server to stage first, and tells them to apply
only when all of them staged (:data:`~fleet.ps.protocol.wire.LOAD_STAGE`, then ``LOAD_COMMIT``,
or ``LOAD_DISCARD``): a server that fails its checks leaves every table on every server as it
was. What remains: a server that dies (or stops answering) after another applied leaves a mix;
the worker then says which servers applied (``fleet.ps.worker.persistables``).
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

from fleet.ps.server import aggregator as agg
from fleet.ps.server import shard_io
from fleet.storage.layout import LayoutError
from fleet.storage.paths import absolute, join
from fleet.storage.store import StorageError

Shards = MutableMapping[int, "agg.DenseShard | agg.SparseShard"]


class StagedLoad:
    """The shards of one save, loaded aside: :meth:`apply` puts them in place of the server's."""

    def __init__(self, dirname: str, server_index: int, staged: dict[int, agg.Shard]):
        self.dirname = dirname
        self.server_index = server_index
        self.staged = staged

    @property
    def tables(self) -> list[int]:
        return sorted(self.staged)

    def apply(self, shards: Shards) -> list[int]:
        """Swap the staged shards in (each keeps the counters of the shard it replaces); their table ids."""
        for table, shard in sorted(self.staged.items()):
            before = shards.get(table)
            if before is not None:
                shard.carry_counts(before)
            shards[table] = shard  # type: ignore[assignment]
        return self.tables


def stage(
    dirname: str,
    server_index: int,
    shards: Shards,
    num_workers: int,
    check_same: Callable[[agg.Shard, str, dict[str, Any]], None],
) -> StagedLoad:
    """Every table of the save in ``dirname`` loaded into new shards, nothing the server serves changed.

    Raises :class:`~fleet.ps.server.aggregator.ShardError` naming this server and the file at fault,
    and saying that no table changed.
    """
    current = ""
    try:
        staged: dict[int, agg.Shard] = {}
        for table, kind, config, states in shard_io.load_shards(dirname, server_index):
            current = join(shard_io.shard_dir(dirname, server_index), f"table-{table}.pt")
            existing = shards.get(table)
            if existing is not None:
                if "name" not in config:  # saved before tables carried their names: matched by number alone
                    config = {**config, **{k: existing.config[k] for k in ("name", "names") if k in existing.config}}
                # what a non-finite push does is this job's choice, not the save's
                config = {k: v for k, v in config.items() if k != "nonfinite"}
                if "nonfinite" in existing.config:
                    config["nonfinite"] = existing.config["nonfinite"]
                check_same(existing, kind, config)
            fresh = (agg.DenseShard if kind == "dense" else agg.SparseShard)(table, config, num_workers)
            fresh.load(states)
            staged[table] = fresh
    except (agg.ShardError, ValueError, KeyError, TypeError, LayoutError, StorageError) as error:
        where = f" ({current})" if current and current not in str(error) else ""
        text = str(error) or type(error).__name__
        details = error.details if isinstance(error, agg.ShardError) else None
        raise agg.ShardError(
            f"parameter server {server_index} refused the save in {dirname}{where}: {text}. No table changed on "
            "this server.",
            details,
        ) from None
    return StagedLoad(absolute(dirname), server_index, staged)
