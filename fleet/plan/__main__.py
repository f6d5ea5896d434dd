"""``python -m fleet.plan``: the plan again from a saved calibration, and the calibration scripts' paths.

python -m fleet.plan predict --calibration calibration.json [--workers-per-host 8] [--servers-per-host 1]
python -m fleet.plan placement --calibration calibration.json --workers 8 [--servers 2] \
    [--tables ROWSxDIM:IDS,...] [--table-rows N,...] [--dense-bytes N] [--worker-memory 16GB] [--stale-ok]
python -m fleet.plan paths      # probe.py and measure.py, for fleetrun command lines on a cluster
"""

from __future__ import annotations

import argparse
import sys

from fleet.plan import measure_path, probe_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fleet.plan", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    predict = commands.add_parser("predict", help="print the plan from a calibration.json")
    predict.add_argument("--calibration", required=True, metavar="FILE")
    predict.add_argument("--workers-per-host", type=int, default=1)
    predict.add_argument("--servers-per-host", type=int, default=0)
    predict.add_argument("--plan-workers", metavar="N,N,...")
    place = commands.add_parser("placement", help="where the tables and dense layers should live (docs/modes.md)")
    place.add_argument("--calibration", required=True, metavar="FILE")
    place.add_argument("--workers", type=int, required=True, help="workers in all")
    place.add_argument("--workers-per-host", type=int, default=1)
    place.add_argument("--servers", type=int, default=0, help="parameter servers in all (0: no PS candidates)")
    place.add_argument(
        "--tables", metavar="ROWSxDIM:IDS,...", help="every table: rows x dim : unique ids per worker-step"
    )
    place.add_argument("--table-rows", metavar="N,N,...", help="the calibrated tables' real sizes, in their order")
    place.add_argument("--dense-bytes", type=int, help="dense parameter bytes (default: the calibration's)")
    place.add_argument("--optimizer", help="sgd, momentum, adagrad, rowwise_adagrad, adam (default: the calibration's)")
    place.add_argument(
        "--worker-memory", metavar="SIZE", help="memory per worker, e.g. 16GB (default: host / processes)"
    )
    place.add_argument("--server-memory", metavar="SIZE", help="memory per server (default: as a worker)")
    place.add_argument("--stale-ok", action="store_true", help="async and geo updates are acceptable")
    commands.add_parser("paths", help="print the paths of probe.py and measure.py")
    args = parser.parse_args(argv)
    if args.command == "paths":
        print(f"probe   {probe_path()}\nmeasure {measure_path()}")
        return 0
    if args.command == "placement":
        return _placement(args)
    from fleet.plan.calibration import Calibration
    from fleet.plan.model import DEFAULT_COUNTS
    from fleet.plan.planner import PlanArgumentError, predict_and_report, worker_counts

    try:
        cal = Calibration.load(args.calibration)
        counts = worker_counts(args.plan_workers) or DEFAULT_COUNTS
    except (ValueError, PlanArgumentError) as error:
        print(f"python -m fleet.plan: {error}", file=sys.stderr)
        return 2
    if args.workers_per_host < 1 or args.servers_per_host < 0:
        print("python -m fleet.plan: --workers-per-host must be >= 1 and --servers-per-host >= 0", file=sys.stderr)
        return 2
    predict_and_report(cal, counts, args.workers_per_host, args.servers_per_host)
    return 0


def _placement(args: argparse.Namespace) -> int:
    from rich.console import Console

    from fleet.plan.calibration import Calibration
    from fleet.plan.host import memory_bytes
    from fleet.plan.placement import (
        Cluster,
        PlacementError,
        Workload,
        parse_size,
        parse_tables,
        state_multiplier,
        workload_from,
    )
    from fleet.plan.planner import report_placement

    try:
        cal = Calibration.load(args.calibration)
        if args.tables:
            work = Workload(parse_tables(args.tables), cal.dense_bytes, state_multiplier(cal.optimizer))
        elif cal.tables:
            rows = [int(x) for x in args.table_rows.split(",")] if args.table_rows else None
            work = workload_from(cal, rows)
        else:
            raise PlacementError(
                f"{args.calibration} records no embedding tables: give them with --tables ROWSxDIM:IDS,..."
            )
        optimizer = args.optimizer or cal.optimizer
        work = Workload(
            work.tables,
            cal.dense_bytes if args.dense_bytes is None else args.dense_bytes,
            state_multiplier(optimizer),
            sync_required=not args.stale_ok,
        )
        per_host = args.workers_per_host + -(-args.servers // max(1, -(-args.workers // args.workers_per_host)))
        memory = parse_size(args.worker_memory) if args.worker_memory else (memory_bytes() or 8 * 2**30) / per_host
        cluster = Cluster(
            workers=args.workers,
            workers_per_host=min(args.workers, args.workers_per_host),
            servers=args.servers,
            worker_memory_bytes=memory,
            server_memory_bytes=parse_size(args.server_memory) if args.server_memory else None,
        )
        report_placement(cal, work, cluster, Console(highlight=False), sizes_given=bool(args.tables or args.table_rows))
    except (ValueError, PlacementError) as error:
        print(f"python -m fleet.plan placement: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
