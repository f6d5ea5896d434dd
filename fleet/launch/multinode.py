"""Several machines: the launchers meet at ``--master`` and then watch each other.

Node 0's fleetrun listens on the ``--master`` port. Every other node connects
and says hello (its rank, ``--workers``/``--servers`` and free ports for its servers and the
store); node 0 computes the job from every request (:mod:`fleet.launch.agree`; nodes may
differ: servers on some, workers on others) and answers every node with it, or with one
error every node prints. The connections then stay open as a control channel:

- a node whose job failed says so; node 0 tells every node to stop, and every
  fleetrun exits with the failed process's status;
- a node that loses its connection (node 0 died, or a node died) stops too, and
  so does one whose peer fell silent for ``--node-timeout`` seconds (a cut link,
  a host gone, a stopped fleetrun: see :mod:`fleet.launch.control`); the others
  then exit non-zero naming the node they lost;
- servers keep serving until the workers of *every* node have finished, then
  get their grace period as on one node.

Messages are JSON lines signed with HMAC-SHA256 under ``FLEET_SECRET``, which
the user exports with the same value on every node (fleetrun cannot ship a
secret over an unauthenticated connection). Restarting a collective job and
relaunching on a port clash are single-node features for now.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from fleet.launch.agree import Agreement, NodeRequest, agree, request_of
from fleet.launch.config import LaunchConfig, LaunchError
from fleet.launch.control import Peer
from fleet.launch.output import OutputMux
from fleet.launch.plan import JobLayout
from fleet.launch.ports import PortAllocator, endpoint
from fleet.launch.supervisor import Supervisor
from fleet.runtime import env

STILL_WAITING_EVERY_S = 10.0
_CONNECT_RETRY_S = 0.5


def shared_secret(nnodes: int, environ: Mapping[str, str] | None = None) -> str:
    """The FLEET_SECRET every node must have been given."""
    secret = (os.environ if environ is None else environ).get(env.FLEET_SECRET, "").strip()
    if not secret:
        raise LaunchError(
            f"--nnodes {nnodes} needs the same {env.FLEET_SECRET} on every node, so the nodes and their "
            "processes can trust each other. Run once: export "
            f'{env.FLEET_SECRET}=$(python -c "import secrets; print(secrets.token_hex(32))") and pass that value '
            "to every node's environment."
        )
    return secret


def check_multinode(config: LaunchConfig, environ: Mapping[str, str] | None = None) -> None:
    """What a multi-node launch needs beyond a single-node one; raises LaunchError."""
    if config.nnodes == 1:
        return
    ps_file = config.strategy is not None and config.strategy.is_ps
    if config.max_restarts and not config.is_ps and not ps_file:
        raise LaunchError(
            f"--max-restarts with --nnodes {config.nnodes} is supported for parameter-server jobs only (a failed "
            "process restarts on its own node); restarting a collective job across nodes is not implemented yet. "
            "Drop --max-restarts, or run the collective job on one node. (On a node of workers only in a "
            "parameter-server job, pass the job's --strategy file.)"
        )
    shared_secret(config.nnodes, environ)


class _Node:
    """What both ends share: the supervisor hooks driven by control messages."""

    def __init__(self, config: LaunchConfig, mux: OutputMux):
        self.config = config
        self.mux = mux
        self.all_workers_done = threading.Event()
        self.supervisor: Supervisor | None = None
        self.finished = False  # this node's job ended and was reported
        self._pending: tuple[str, int] | None = None  # a stop that came before the supervisor
        self._attach_lock = threading.Lock()

    def attach(self, supervisor: Supervisor) -> None:
        with self._attach_lock:
            self.supervisor = supervisor
            if self._pending is not None:
                supervisor.request_stop(*self._pending)

    def stop(self, reason: str, code: int) -> None:
        with self._attach_lock:
            if self.finished:
                return
            if self.supervisor is None:
                self._pending = (reason, code)
            else:
                self.supervisor.request_stop(reason, code)


# --- node 0 ----------------------------------------------------------------------------------


class Hub(_Node):
    def __init__(self, config: LaunchConfig, mux: OutputMux, secret: str):
        super().__init__(config, mux)
        self.secret = secret
        self.peers: dict[int, Peer] = {}
        self.workers_done: set[int] = set()
        self.ended_nodes: set[int] = set()  # reported their end, or closed the connection
        self.failure: tuple[int, str] | None = None  # (code, reason) of the first failed node
        self._lock = threading.Lock()

    def rendezvous(self, request: NodeRequest) -> Agreement:
        config = self.config
        assert config.master is not None
        master_host, master_port = config.master
        family = socket.AF_INET6 if ":" in master_host else socket.AF_INET
        try:
            # Only on the --master address: the control channel listens where configured, nowhere else.
            listener = socket.create_server((master_host, master_port), family=family, reuse_port=False)
        except OSError as exc:
            raise LaunchError(
                f"Node 0 cannot listen on --master port {master_port} ({exc.strerror}). "
                "Pick a free port on node 0 and pass the same --master to every node."
            ) from None
        self.mux.message(f"waiting for {config.nnodes - 1} other node(s) at {endpoint(master_host, master_port)}")
        requests = [replace(request, host=config.host or master_host)]
        listener.settimeout(1.0)
        deadline = time.monotonic() + self.config.join_timeout
        try:
            while len(self.peers) < config.nnodes - 1:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(1, config.nnodes)) - set(self.peers))
                    raise LaunchError(
                        f"Node(s) {missing} did not join within {self.config.join_timeout:g} s. Start fleetrun on every node "
                        f"with --nnodes {config.nnodes} --master {endpoint(master_host, master_port)} and its own "
                        "--node-rank, and check that node 0's port is reachable."
                    )
                try:
                    sock, address = listener.accept()
                except TimeoutError:
                    continue
                sock.settimeout(30)
                peer = Peer(sock, self.secret)
                hello = peer.recv()
                sock.settimeout(None)
                problem = self._check_hello(hello)
                if problem is None:
                    assert hello is not None
                    try:
                        joined = NodeRequest.from_hello(hello, str(hello.get("host") or address[0]))
                    except (KeyError, TypeError, ValueError) as error:
                        problem = f"Node {hello.get('node')} sent a hello fleetrun cannot read ({error})."
                if problem:
                    peer.send(type="error", message=problem)
                    peer.close()
                    if hello is None:
                        continue  # a stranger or a wrong secret: ignore it
                    raise LaunchError(problem)
                self.peers[joined.node] = peer
                requests.append(joined)
                self.mux.message(f"node {joined.node} joined from {address[0]}")
        finally:
            listener.close()
        try:
            agreed = agree(requests, master_host)
        except LaunchError as error:
            for peer in self.peers.values():  # every node fails with the same message
                peer.send(type="error", message=str(error))
                peer.close()
            raise
        for peer in self.peers.values():
            peer.send(type="plan", **agreed.message())
        for node, peer in self.peers.items():
            peer.keep_alive(config.node_timeout)
            threading.Thread(target=self._listen, args=(node, peer), name=f"fleetrun-node-{node}", daemon=True).start()
        return agreed

    def _check_hello(self, hello: dict | None) -> str | None:
        config = self.config
        if hello is None or hello.get("type") != "hello":
            return "no valid hello (is FLEET_SECRET the same on every node?)"
        node = hello.get("node")
        if not isinstance(node, int) or not 0 < node < config.nnodes or node in self.peers:
            return (
                f"A node joined with --node-rank {node}, which is not free: node 0 expects node ranks 1 to "
                f"{config.nnodes - 1}, each once. Give every node its own --node-rank."
            )
        if hello.get("nnodes") != config.nnodes:
            return (
                f"Node {node} was started with --nnodes {hello.get('nnodes')} but node 0 with --nnodes "
                f"{config.nnodes}. Start every node with the same --nnodes."
            )
        return None

    def _listen(self, node: int, peer: Peer) -> None:
        while True:
            message = peer.recv()
            if message is None:
                with self._lock:
                    ended = node in self.ended_nodes
                    self.ended_nodes.add(node)
                if not ended:
                    reason = _lost(node, peer)
                    self.mux.message(reason, style="bold red")
                    self.on_failed(node, 1, reason, named=True)
                return
            kind = message.get("type")
            if kind == "workers_done":
                self.on_workers_done(node)
            elif kind == "failed":
                with self._lock:
                    self.ended_nodes.add(node)
                self.on_failed(node, int(message.get("code", 1)), str(message.get("reason", "failed")))
            elif kind == "finished":
                with self._lock:
                    self.ended_nodes.add(node)

    def on_workers_done(self, node: int) -> None:
        with self._lock:
            self.workers_done.add(node)
            everyone = len(self.workers_done) == self.config.nnodes
        if everyone and not self.all_workers_done.is_set():
            self.all_workers_done.set()
            for peer in list(self.peers.values()):
                peer.send(type="all_workers_done")

    def on_failed(self, node: int, code: int, reason: str, named: bool = False) -> None:
        """``named``: ``reason`` names the node already ("lost contact with node 1")."""
        text = reason if named else f"node {node}: {reason}"
        with self._lock:
            if self.failure is not None:
                return
            self.failure = (code, text)
        for other, peer in list(self.peers.items()):
            if other != node:
                peer.send(type="stop", code=code, reason=text)
        if node != 0:
            self.stop(text, code)

    def finish(self, code: int) -> int:
        """After this node's job ended: report it, then wait for the other nodes to end."""
        if code != 0:
            reason = self.supervisor.failure if self.supervisor and self.supervisor.failure else "stopped"
            self.on_failed(0, code, reason)
        self.finished = True
        signalled = self.supervisor is not None and self.supervisor.signalled
        if len(self.ended_nodes) < len(self.peers) and not signalled:
            self.mux.message("waiting for the other nodes to end")
        # A healthy job waits for the others however long they train (a lost node ends that wait within
        # --node-timeout); a failed one only while they stop; one stopped by a signal not at all.
        limit = time.monotonic() + self.config.stop_timeout + 15 if code != 0 else float("inf")
        if signalled:
            limit = 0.0
        while len(self.ended_nodes) < len(self.peers) and time.monotonic() < limit:
            time.sleep(0.1)
        with self._lock:
            silent = sorted(set(self.peers) - self.ended_nodes)
            # Closing their connections below wakes their listeners: the line above has said why they end,
            # so a listener must not also report "lost contact" (a race with this process's exit).
            self.ended_nodes.update(silent)
        if silent and not signalled:
            self.mux.message(f"node(s) {silent} did not report their end in time; not waiting for them any longer")
        for peer in self.peers.values():
            peer.send(type="bye")
            peer.close()
        if code == 0 and self.failure is not None:
            self.mux.message(f"the job failed on another node ({self.failure[1]})", style="bold red")
            return self.failure[0] or 1
        return code


# --- nodes 1..M-1 -----------------------------------------------------------------------------


class Spoke(_Node):
    def __init__(self, config: LaunchConfig, mux: OutputMux, secret: str):
        super().__init__(config, mux)
        self.secret = secret
        self.peer: Peer | None = None

    def rendezvous(self, request: NodeRequest) -> Agreement:
        config = self.config
        assert config.master is not None
        where = endpoint(*config.master)
        self.mux.message(f"joining node 0 at {where}")
        started = time.monotonic()
        deadline, next_note = started + config.join_timeout, started + STILL_WAITING_EVERY_S
        while True:
            try:
                sock = socket.create_connection(config.master, timeout=min(10.0, config.join_timeout))
                break
            except OSError as exc:
                now = time.monotonic()
                if now > deadline:
                    raise LaunchError(
                        f"Could not reach node 0 at --master {where} within {config.join_timeout:g} s ({exc}). "
                        "Start fleetrun with --node-rank 0 on the master node, and check the address and port."
                    ) from None
                if now > next_note:
                    self.mux.message(
                        f"still waiting for node 0 at {where} ({exc}); giving up in {deadline - now:.0f} s"
                    )
                    next_note = now + STILL_WAITING_EVERY_S
                time.sleep(_CONNECT_RETRY_S)
        sock.settimeout(config.join_timeout)
        self.peer = Peer(sock, self.secret)
        self.peer.send(type="hello", nnodes=config.nnodes, host=config.host, **request.hello())
        reply = self.peer.recv()
        sock.settimeout(None)
        if reply is None:
            raise LaunchError(
                f"Node 0 at {where} closed the connection without a plan. Check that {env.FLEET_SECRET} is the same "
                "on every node and read node 0's output."
            )
        if reply.get("type") == "error":
            self.peer.close()
            raise LaunchError(str(reply.get("message")))
        try:
            agreed = Agreement.from_message(reply)
        except (KeyError, TypeError, ValueError) as error:
            self.peer.close()
            raise LaunchError(
                f"Node 0 at {where} answered with a plan this fleetrun cannot read ({error!r}). Run the same fleet "
                "version on every node."
            ) from None
        self.peer.keep_alive(config.node_timeout)
        threading.Thread(target=self._listen, name="fleetrun-node-0", daemon=True).start()
        return agreed

    def _listen(self) -> None:
        assert self.peer is not None
        while True:
            message = self.peer.recv()
            if message is None:
                if not self.finished:
                    self.stop(_lost(0, self.peer), 1)
                return
            kind = message.get("type")
            if kind == "all_workers_done":
                self.all_workers_done.set()
            elif kind == "stop":
                self.stop(str(message.get("reason", "node 0 asked to stop")), int(message.get("code", 1)))
            elif kind == "bye":
                return

    def workers_done(self) -> None:
        if self.peer is not None:
            self.peer.send(type="workers_done", node=self.config.node_rank)

    def finish(self, code: int) -> int:
        self.finished = True
        if self.peer is not None:
            if code == 0:
                self.peer.send(type="finished", node=self.config.node_rank)
            elif self.supervisor is not None and not self.supervisor.stop_requested.is_set():
                reason = self.supervisor.failure or "stopped"
                self.peer.send(type="failed", node=self.config.node_rank, code=code, reason=reason)
            self.peer.close()
        return code


def _lost(node: int, peer: Peer) -> str:
    return f"lost contact with node {node}" + (f" ({peer.lost})" if peer.lost else "")


def run_multinode(config: LaunchConfig, log_dir: Path, mux: OutputMux) -> int:
    check_multinode(config)
    secret = shared_secret(config.nnodes)
    allocator = PortAllocator("0.0.0.0")
    if config.master is not None:
        allocator.reserve(config.master[1])
    server_ports = allocator.take_many(config.servers)
    store_port = allocator.take() if config.workers else None  # used if worker 0 is here
    request = request_of(config, config.host or "", server_ports, store_port)
    node: Hub | Spoke
    if config.node_rank == 0:
        node = Hub(config, mux, secret)
        agreed = node.rendezvous(request)
        on_workers_done = lambda: node.on_workers_done(0)  # noqa: E731
    else:
        node = Spoke(config, mux, secret)
        agreed = node.rendezvous(request)
        on_workers_done = node.workers_done
    mux.message(f"the job: {agreed.describe()}; rendezvous store at {agreed.master}")
    config = replace(config, node_counts=agreed.node_counts)
    layout = JobLayout(master=agreed.master, server_endpoints=agreed.server_endpoints, secret=secret)
    supervisor = Supervisor(
        config,
        log_dir,
        mux,
        lambda: layout,
        port_relaunch=False,
        others_done=node.all_workers_done.is_set,
        on_workers_done=on_workers_done,
    )
    node.attach(supervisor)
    code = supervisor.run()
    return node.finish(code)
