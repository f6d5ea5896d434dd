"""``python -m fleet.launch ...`` is ``fleetrun ...``."""

import sys

from fleet.launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
