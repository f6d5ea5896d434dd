"""What the nodes of a multi-node job agree on at the rendezvous: who runs what, and where everyone listens.

Nodes need not run the same processes: the parameter-server layout of a cluster puts the
servers on some nodes (CPU machines) and the workers on others (GPU machines), each node
started with its own ``--servers``/``--workers`` (``--workers 0`` on a node of servers only).
Every node says in its hello what it was asked for (:class:`NodeRequest`); node 0 checks the
requests together and computes the job (:func:`agree`):

- global indices in node order: node 0's workers are workers 0..W0-1, node 1's the next ones,
  and the same for servers (a node without workers or servers takes no index);
- every server's endpoint (its node's address, a port that node picked);
- the rendezvous store's address: worker 0 hosts it, so it is on the first node that runs
  workers, at a port that node picked.

Requests that cannot make one job (no worker anywhere; a parameter-server strategy file and
no server anywhere; a collective strategy file beside servers; restarts in a collective job)
fail on every node with one message naming the nodes at fault.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fleet.launch.config import LaunchConfig, LaunchError
from fleet.launch.ports import endpoint


@dataclass(frozen=True)
class NodeRequest:
    """What one node was started with, as it tells node 0."""

    node: int
    workers: int
    servers: int
    host: str  # the node's address as the other nodes reach it
    server_ports: tuple[int, ...]  # free ports on the node, one per server
    store_port: int | None  # a free port on the node for the rendezvous store; None without workers
    strategy_mode: str | None  # the mode its --strategy file names ("ps", "collective", ...), None without one
    strategy_digest: str | None = None  # of its --strategy file's settings, None without one
    strategy_name: str = ""  # the file's name, for messages
    max_restarts: int = 0

    def hello(self) -> dict:
        """The node's part of its hello message (JSON)."""
        return {
            "node": self.node,
            "workers": self.workers,
            "servers": self.servers,
            "server_ports": list(self.server_ports),
            "store_port": self.store_port,
            "strategy_mode": self.strategy_mode,
            "strategy_digest": self.strategy_digest,
            "strategy_name": self.strategy_name,
            "max_restarts": self.max_restarts,
        }

    @classmethod
    def from_hello(cls, hello: Mapping, host: str) -> NodeRequest:
        """The request in a hello that verified; raises ValueError when a field is missing or malformed."""
        node, workers, servers = hello["node"], hello["workers"], hello["servers"]
        ports, store = hello["server_ports"], hello.get("store_port")
        if not all(isinstance(v, int) and v >= 0 for v in (node, workers, servers, *ports)):
            raise ValueError(f"malformed counts or ports in a hello: {dict(hello)}")
        if len(ports) != servers or (workers and not isinstance(store, int)):
            raise ValueError(f"a hello's ports do not match its counts: {dict(hello)}")
        mode, digest = hello.get("strategy_mode"), hello.get("strategy_digest")
        return cls(
            node=node,
            workers=workers,
            servers=servers,
            host=host,
            server_ports=tuple(ports),
            store_port=store if workers else None,
            strategy_mode=mode if isinstance(mode, str) else None,
            strategy_digest=digest if isinstance(digest, str) else None,
            strategy_name=str(hello.get("strategy_name") or ""),
            max_restarts=int(hello.get("max_restarts") or 0),
        )


def request_of(config: LaunchConfig, host: str, server_ports: Sequence[int], store_port: int | None) -> NodeRequest:
    """This node's request from its command line."""
    strategy = config.strategy
    return NodeRequest(
        node=config.node_rank,
        workers=config.workers,
        servers=config.servers,
        host=host,
        server_ports=tuple(server_ports),
        store_port=store_port if config.workers else None,
        strategy_mode=strategy.mode if strategy is not None else None,
        strategy_digest=(strategy.digest or str(strategy.path)) if strategy is not None else None,
        strategy_name=strategy.path.name if strategy is not None else "",
        max_restarts=config.max_restarts,
    )


@dataclass(frozen=True)
class Agreement:
    """The job every node runs its share of."""

    master: str  # host:port of the rendezvous store (worker 0's node)
    server_endpoints: tuple[str, ...]  # every server in global index order
    node_counts: tuple[tuple[int, int], ...]  # (workers, servers) of every node, node order

    def message(self) -> dict:
        return {
            "master": self.master,
            "server_endpoints": list(self.server_endpoints),
            "node_counts": [list(c) for c in self.node_counts],
        }

    @classmethod
    def from_message(cls, message: Mapping) -> Agreement:
        return cls(
            master=str(message["master"]),
            server_endpoints=tuple(str(e) for e in message["server_endpoints"]),
            node_counts=tuple((int(w), int(s)) for w, s in message["node_counts"]),
        )

    def describe(self) -> str:
        """'4 workers (node 1: 2, node 2: 2), 2 servers (node 0: 2)'."""

        def part(index: int, word: str) -> str:
            total = sum(c[index] for c in self.node_counts)
            where = ", ".join(f"node {n}: {c[index]}" for n, c in enumerate(self.node_counts) if c[index])
            return f"{total} {word}{'' if total == 1 else 's'}" + (f" ({where})" if where else "")

        return f"{part(0, 'worker')}, {part(1, 'server')}"


def _nodes(nodes: list[int]) -> str:
    return ("node " if len(nodes) == 1 else "nodes ") + ", ".join(map(str, nodes))


def agree(requests: Sequence[NodeRequest], store_host: str) -> Agreement:
    """The job from every node's request (one per node, any order); LaunchError when they make no job.

    ``store_host``: node 0's address for the store when node 0 runs worker 0 (the ``--master`` host).
    """
    by_node = sorted(requests, key=lambda r: r.node)
    assert [r.node for r in by_node] == list(range(len(by_node))), [r.node for r in by_node]
    counts = tuple((r.workers, r.servers) for r in by_node)
    asked = ", ".join(f"node {r.node} --workers {r.workers} --servers {r.servers}" for r in by_node)
    server_nodes = [r.node for r in by_node if r.servers]
    if not any(r.workers for r in by_node):
        raise LaunchError(
            f"No node runs a worker ({asked}): the job would have nobody to train. Give at least one node "
            "--workers N (N >= 1); --workers 0 is for the nodes of servers only."
        )
    if len({r.strategy_digest for r in by_node}) > 1:
        given = ", ".join(
            f"node {r.node}: " + (f"--strategy {r.strategy_name}" if r.strategy_digest else "no --strategy")
            for r in by_node
        )
        raise LaunchError(
            f"The nodes were started with different strategies ({given}; files compared by their settings). "
            "Servers and workers must run one strategy: give every node the same --strategy file "
            "(or none to all of them)."
        )
    ps_files = [r.node for r in by_node if r.strategy_mode == "ps"]
    if ps_files and not server_nodes:
        raise LaunchError(
            f"The strategy file of {_nodes(ps_files)} describes a parameter-server job, but no node runs "
            f"servers ({asked}). Give the nodes that should serve --servers S (for example --servers 2 "
            '--workers 0 on a node of servers only), or set mode = "collective" in the strategy file.'
        )
    collective_files = [r.node for r in by_node if r.strategy_mode == "collective"]
    if collective_files and server_nodes:
        raise LaunchError(
            f'The strategy file of {_nodes(collective_files)} says mode = "collective", but {_nodes(server_nodes)} '
            f"run servers ({asked}). Start every node with --servers 0 for a collective job, or give every "
            'node a strategy file with mode = "ps".'
        )
    restarting = [r.node for r in by_node if r.max_restarts]
    if restarting and not server_nodes:
        raise LaunchError(
            f"--max-restarts on {_nodes(restarting)} is supported for parameter-server jobs only across nodes (a "
            "failed process restarts on its own node); no node runs servers here. Drop --max-restarts, or run "
            "the collective job on one node."
        )
    first = next(r for r in by_node if r.workers)
    assert first.store_port is not None
    master = endpoint(store_host if first.node == 0 else first.host, first.store_port)
    servers = tuple(endpoint(r.host, port) for r in by_node for port in r.server_ports)
    return Agreement(master=master, server_endpoints=servers, node_counts=counts)
