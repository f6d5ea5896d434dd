"""fleetrun's count of log lines it could not write says what is really missing (issue 26, finding 8)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINES = 3001

# Under a 256 KiB file-size limit, fleetrun's reader writes a child's 3001 lines of 122 bytes into a log
# file, twice (a --log-dir used again is appended to); prints what it says was lost each time.
CHILD = f"""
import json, os, resource, subprocess, sys
from rich.console import Console
from fleet.launch.output import LostWrites, OutputMux, ProcessOutput
resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))
said = []
for run in range(2):
    printer = subprocess.Popen(
        [sys.executable, "-c", "for i in range({LINES}): print(f'line {{i + 1:5d}} ' + 'x' * 110)"],
        stdout=subprocess.PIPE,
    )
    lost = LostWrites()
    out = ProcessOutput(OutputMux(Console(file=open(os.devnull, "w"))), "worker.0", "", sys.argv[1], printer.stdout, lost=lost)
    out.start()
    printer.wait()
    assert out.join(30)
    said.append(lost.describe())
print(json.dumps(said))
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_lost_lines_under_a_file_size_limit_count_what_the_file_lacks(tmp_path):
    log = tmp_path / "worker.0.log"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", CHILD, str(log)], capture_output=True, text=True, timeout=50, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = json.loads(done.stdout.strip().splitlines()[-1])
    data = log.read_bytes()
    assert len(data) == 256 << 10
    whole = data.count(b"\n")  # lines of the first run in the file whole; the next one is cut short
    assert data.split(b"\n")[-1] and whole < LINES
    assert first == [
        f"{LINES - whole} of {LINES} lines of {log}, from line {whole + 1} on; "
        f"line {whole + 1} is in the file only in part (File too large)"
    ]
    # The second run's lines all went missing, while the file still holds the first run's.
    assert second == [
        f"{LINES} of {LINES} lines of {log}, every line; the file already held {256 << 10} bytes from an earlier "
        "run when this one began (File too large)"
    ]
