"""``python -m fleet.launch ...`` is ``fleetrun ...``."""

import sys

from fleet.launch.cli import entry

if __name__ == "__main__":
    sys.exit(entry())
