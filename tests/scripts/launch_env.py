"""Prints the fleet variables it was given, then a few lines on stderr."""

import os
import sys

NAMES = [
    "FLEET_ROLE",
    "FLEET_WORKER_INDEX",
    "FLEET_WORKER_NUM",
    "FLEET_SERVER_INDEX",
    "FLEET_SERVER_NUM",
    "FLEET_SERVER_ENDPOINTS",
    "FLEET_MASTER",
    "FLEET_SECRET",
    "FLEET_LOG_DIR",
    "FLEET_RESTART_COUNT",
    "FLEET_LOCAL_RANK",
    "FLEET_STRATEGY_FILE",
    "PYTHONUNBUFFERED",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
]
for name in NAMES:
    print(f"ENV {name}={os.environ.get(name, '<unset>')}")
print("ARGS " + " ".join(sys.argv[1:]))
print("to stderr", file=sys.stderr)
sys.stdout.write("partial line without newline")
