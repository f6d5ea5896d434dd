"""The repository stands on its own: nothing in it points at files outside it."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_nothing_refers_to_files_outside_the_repository():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    offenders = []
    for name in tracked:
        if not name.endswith((".py", ".md", ".toml", ".json", ".txt", ".yml", ".yaml", ".cfg")) and name != ".ci/run":
            continue
        if name == "tests/api/test_repository.py":  # this file spells the paths it looks for
            continue
        text = (ROOT / name).read_text(errors="replace")
        if "../shared" in text or "/work/shared" in text:
            offenders.append(name)
    assert not offenders, f"these files refer to ../shared, outside the repository: {offenders}"
