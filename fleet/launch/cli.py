"""``fleetrun``: the command line.

Everything before the script name is fleetrun's; everything after it goes to
the script untouched (``--`` may separate them). Mistakes in the command line
print one paragraph naming the fault and the fix, and exit with status 2.
"""

from __future__ import annotations

import argparse
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from fleet.launch import config as cfg
from fleet.launch import orphans
from fleet.launch.config import LaunchConfig, LaunchError
from fleet.launch.multinode import check_multinode, run_multinode
from fleet.launch.output import OutputMux
from fleet.launch.plan import JobLayout
from fleet.launch.ports import PortAllocator, endpoint
from fleet.launch.supervisor import Supervisor
from fleet.runtime import env, job_files

DESCRIPTION = """\
Start a fleet training job on this machine (or on several): N worker processes
and S parameter-server processes, all running the same script. Each process
learns its role, rank and peers from FLEET_* environment variables. Output is
shown with a [role rank] prefix per line and kept per process under the log
directory. If a process fails, the others are stopped and fleetrun exits with
that process's status after showing its last lines.
"""

EPILOG = """\
examples:
  fleetrun --workers 4 train.py --epochs 3          collective data parallel
  fleetrun --servers 2 --workers 4 --strategy ps.toml train.py
  fleetrun --workers 2 --max-restarts 3 train.py     restart on failure
  fleetrun --nnodes 2 --node-rank 0 --master 10.0.0.1:6170 --workers 4 train.py   (on node 0; node 1 the same with --node-rank 1)
  fleetrun --nnodes 3 --node-rank 0 --master 10.0.0.1:6170 --servers 2 --workers 0 --strategy ps.toml train.py
      (servers only on node 0; nodes 1 and 2 with their --node-rank and --servers 0 --workers 4: workers only)

exit status: 0 when every worker exited 0; a failed process's own status
(128+N for signal N); 130/143 when fleetrun is interrupted/terminated;
2 for a mistake in the command line.
"""

# Options that take a value, so the first other non-option word is the script.
_VALUE_OPTIONS = {
    "--workers", "--worker_num", "--servers", "--server_num", "--strategy", "--log-dir", "--max-restarts",
    "--nnodes", "--node-rank", "--master", "--host", "--server-grace", "--stop-timeout", "--join-timeout",
    "--node-timeout",
    "--calibration", "--plan-workers",
}  # fmt: skip


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise LaunchError(_explain_argparse(message))


def _explain_argparse(message: str) -> str:
    if message.startswith("unrecognized arguments:"):
        unknown = message.split(":", 1)[1].strip()
        return (
            f"fleetrun has no option {unknown}. fleetrun's own options go before the script "
            "(see fleetrun --help); everything after the script name is passed to the script."
        )
    if "expected one argument" in message:
        flag = message.split(":", 1)[0].replace("argument", "").strip().split("/")[0]
        return f"{flag} needs a value, for example {flag} 2. See fleetrun --help."
    if "invalid" in message and "value" in message:
        flag = message.split(":", 1)[0].replace("argument", "").strip().split("/")[0]
        value = message.rsplit(":", 1)[1].strip()
        return f"{flag} {value} is not a number. Give {flag} a number, for example {flag} 2 (see fleetrun --help)."
    return f"{message}. See fleetrun --help."


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="fleetrun",
        usage="fleetrun [options] script.py [script args ...]",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    job = parser.add_argument_group("job")
    job.add_argument(
        "--workers",
        "--worker_num",
        type=int,
        default=1,
        metavar="N",
        help="worker processes on this node; 0 on a node of servers only when --nnodes > 1 (default: 1)",
    )
    job.add_argument(
        "--servers",
        "--server_num",
        type=int,
        default=0,
        metavar="S",
        help="parameter-server processes on this node; > 0 on any node makes a parameter-server job. Nodes may "
        "differ: servers on some, workers on others (default: 0)",
    )
    job.add_argument(
        "--strategy",
        metavar="FILE",
        help="DistributedStrategy as TOML or JSON; passed as FLEET_STRATEGY_FILE (default: none, the script decides)",
    )
    job.add_argument(
        "--log-dir",
        metavar="DIR",
        help="where each process's output goes, one file per process (default: $XDG_STATE_HOME or ~/.local/state, then fleet/logs/<timestamp>)",
    )
    faults = parser.add_argument_group("failures")
    faults.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="restart on failure up to K times: the failed process alone in a parameter-server job, "
        "all workers in a collective job (default: 0)",
    )
    faults.add_argument(
        "--server-grace",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how long servers may keep running after every worker finished before they are stopped (default: 10)",
    )
    faults.add_argument(
        "--stop-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="after SIGTERM, how long a stopping process gets before SIGKILL (default: 5)",
    )
    nodes = parser.add_argument_group("several machines")
    nodes.add_argument("--nnodes", type=int, default=1, metavar="M", help="number of machines (default: 1)")
    nodes.add_argument(
        "--node-rank", type=int, default=0, metavar="R", help="this machine's index, 0..M-1 (default: 0)"
    )
    nodes.add_argument(
        "--master",
        metavar="HOST:PORT",
        help="address of node 0 where the nodes meet; required when M > 1 (default: 127.0.0.1 and a free port)",
    )
    nodes.add_argument(
        "--host", metavar="ADDR", help="this machine's address as the other nodes reach it (default: as node 0 sees it)"
    )
    nodes.add_argument(
        "--join-timeout",
        metavar="SECONDS",
        type=float,
        default=300.0,
        help="how long the nodes wait for each other (node 0 unreachable, a node not started) (default: 300)",
    )
    nodes.add_argument(
        "--node-timeout",
        metavar="SECONDS",
        type=float,
        default=10.0,
        help="once the job runs, a node silent this long (host gone, link cut, fleetrun stopped) is lost: the "
        "others stop and exit non-zero naming it, within --node-timeout + --stop-timeout + 5 s (default: 10)",
    )
    planning = parser.add_argument_group("planning (fleet.plan, docs/scaling.md)")
    planning.add_argument(
        "--plan",
        action="store_true",
        help="run nothing at scale: time the script briefly as one worker, measure the transports here, and "
        "print the predicted speed-up of every mode for 1..1,024 workers (--workers and --servers per host)",
    )
    planning.add_argument(
        "--calibration", metavar="FILE", help="--plan: transports measured between hosts (fleet/plan/measure.py)"
    )
    planning.add_argument(
        "--plan-workers", metavar="N,N,...", help="--plan: worker counts to predict (default: 1,2,4,...,1024)"
    )
    return parser


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """fleetrun's options, and [script, script args...]."""
    argv = list(argv)
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return argv[:i], argv[i + 1 :]
        if token.startswith("-") and token != "-":
            i += 2 if token in _VALUE_OPTIONS else 1
            continue
        return argv[:i], argv[i:]
    return argv, []


def parse_config(argv: Sequence[str]) -> LaunchConfig:
    """The checked configuration for ``argv``; raises LaunchError (or SystemExit for --help)."""
    options, rest = split_argv(argv)
    args = build_parser().parse_args(options)
    script = cfg.check_script(rest[0] if rest else None)
    cfg.check_node_counts(args.workers, args.servers, args.nnodes)
    cfg.check_count("--max-restarts", args.max_restarts, 0)
    for flag, value in (
        ("--server-grace", args.server_grace),
        ("--stop-timeout", args.stop_timeout),
        ("--join-timeout", args.join_timeout),
    ):
        if not value >= 0:
            raise LaunchError(f"{flag} {value:g} is negative. Give it a number of seconds, 0 or more.")
    if not args.node_timeout >= 1:
        raise LaunchError(
            f"--node-timeout {args.node_timeout:g} is too short: the nodes ping each other several times within it. "
            "Give it 1 second or more (default: 10)."
        )
    master = cfg.check_nodes(args.nnodes, args.node_rank, args.master)
    strategy = cfg.load_strategy_file(args.strategy) if args.strategy is not None else None
    cfg.check_strategy_against_servers(strategy, args.servers, args.nnodes)
    config = LaunchConfig(
        script=script,
        script_args=tuple(rest[1:]),
        workers=args.workers,
        servers=args.servers,
        strategy=strategy,
        log_dir=Path(args.log_dir) if args.log_dir is not None else None,
        max_restarts=args.max_restarts,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master=master,
        host=args.host,
        server_grace=args.server_grace,
        stop_timeout=args.stop_timeout,
        join_timeout=args.join_timeout,
        node_timeout=args.node_timeout,
    )
    check_multinode(config)
    return config


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def describe_job(config: LaunchConfig, log_dir: Path) -> str:
    parts = [_plural(config.workers, "worker"), _plural(config.servers, "server")]
    if config.nnodes > 1:  # the job's totals come with the rendezvous (fleet.launch.multinode says them)
        parts[-1] += " here"
        parts[0] = f"node {config.node_rank} of {config.nnodes}: {parts[0]}"
    if config.strategy is not None:
        parts.append(f"strategy {config.strategy.path.name} (mode {config.strategy.mode or 'default'})")
    else:
        parts.append("no strategy file")
    if config.is_ps or (config.strategy is not None and config.strategy.is_ps):
        parts.append("parameter-server job")
    elif config.strategy is not None and config.strategy.mode:
        parts.append(f"{config.strategy.mode} job")
    elif config.nnodes > 1:
        parts.append("no servers here (a parameter-server job if another node runs servers)")
    else:  # the script may still pass a strategy of its own to fleet.distributed_optimizer
        parts.append("no servers (collective or sharding: the script's strategy chooses)")
    if config.max_restarts:
        parts.append(f"up to {_plural(config.max_restarts, 'restart')}")
    return f"starting {config.script.name}: " + ", ".join(parts) + f"; logs in {log_dir}"


def local_layouts(config: LaunchConfig, secret: str):
    """Fresh addresses on 127.0.0.1 for every (re)launch of a single-node job."""
    ports = PortAllocator("127.0.0.1")
    if config.master is not None:
        ports.reserve(config.master[1])

    def make() -> JobLayout:
        master = endpoint(*config.master) if config.master is not None else endpoint("127.0.0.1", ports.take())
        servers = tuple(endpoint("127.0.0.1", port) for port in ports.take_many(config.servers))
        return JobLayout(master=master, server_endpoints=servers, secret=secret)

    return make


def run(config: LaunchConfig, console: Console | None = None) -> int:
    """Run a checked job to its end; fleetrun's exit status."""
    log_dir = cfg.make_log_dir(str(config.log_dir) if config.log_dir is not None else None)
    mux = OutputMux(console)
    try:
        mux.message(describe_job(config, log_dir))
        if config.nnodes > 1:
            return run_multinode(config, log_dir, mux)
        secret = secrets.token_hex(32)
        job_files.remove_orphaned_files()  # what a kill -9 of an earlier job on this host left
        supervisor = Supervisor(config, log_dir, mux, local_layouts(config, secret))
        return supervisor.run()
    finally:
        mux.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``fleetrun`` and ``python -m fleet.launch``; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        config = parse_config(argv)
        options = build_parser().parse_args(split_argv(argv)[0])
        if not options.plan and (options.calibration or options.plan_workers):
            raise LaunchError("--calibration and --plan-workers belong to --plan; add --plan (see fleetrun --help).")
        if options.plan:
            from fleet.launch.config import make_log_dir
            from fleet.plan.planner import PlanArgumentError, plan, worker_counts

            try:
                counts = worker_counts(options.plan_workers)
            except PlanArgumentError as error:
                raise LaunchError(str(error)) from None
            log_dir = make_log_dir(str(config.log_dir) if config.log_dir is not None else None)
            return plan(config, log_dir, options.calibration, counts)
        return run(config)
    except LaunchError as error:
        print(f"fleetrun: error: {error}", file=sys.stderr)
        return env.EXIT_USER_ERROR
    except KeyboardInterrupt:
        return 130


def entry() -> int:
    """``fleetrun`` and ``python -m fleet.launch`` from the command line: :func:`main`, and afterwards an end
    to whatever the job left behind outside its process groups (:mod:`fleet.launch.orphans`)."""
    with orphans.adopted() as ended:
        code = main()
    if ended:
        pids = ", ".join(map(str, ended[:10])) + (", ..." if len(ended) > 10 else "")
        print(
            f"fleetrun: ended {len(ended)} process(es) the job left running outside its process groups "
            f"(started with setsid by a worker or server): pid {pids}",
            file=sys.stderr,
        )
    return code
