"""``python -m fleet.plan``: the plan again from a saved calibration, and the calibration scripts' paths.

python -m fleet.plan predict --calibration calibration.json [--workers-per-host 8] [--servers-per-host 1]
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
    commands.add_parser("paths", help="print the paths of probe.py and measure.py")
    args = parser.parse_args(argv)
    if args.command == "paths":
        print(f"probe   {probe_path()}\nmeasure {measure_path()}")
        return 0
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


if __name__ == "__main__":
    sys.exit(main())
