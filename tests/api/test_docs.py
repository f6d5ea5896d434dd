"""The docs site builds with warnings as errors, and the README's links and headline figures are current.

``mkdocs build --strict`` fails on a broken link or anchor, a page missing from the navigation, a
page the navigation names that does not exist, or a docstring mkdocstrings cannot read; it runs
in a few seconds (the API reference reads docstrings statically, without importing torch).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def _history():
    spec = importlib.util.spec_from_file_location("fleet_bench_history", ROOT / "benchmarks" / "history.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
def test_docs_site_builds_strict(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
        env={"NO_MKDOCS_2_WARNING": "1", **os.environ},
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    import fleet

    for name in fleet.__all__:  # every public name has its entry in the reference
        assert f'id="fleet.{name}"' in api, name
    results = (tmp_path / "site" / "benchmarks" / "results" / "index.html").read_text()
    assert 'id="w1-collective"' in results


def test_readme_is_a_front_door() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    # the second quick-start command is the one .ci/run runs (then the slow set, -m hosts)
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    command = next(line for line in ci if "python -m pytest -q" in line)
    assert command == 'pip install torch==2.13.0 -e ".[test]" && python -m pytest -q', command
    assert f"{command}\n" in text, command


def test_readme_links_resolve() -> None:
    text = README.read_text()
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (ROOT / target.split("#", 1)[0]).exists():
            missing.append(target)
    assert not missing, f"README links to files that do not exist: {missing}"


def test_readme_headline_figures_are_the_newest_results() -> None:
    history = _history()
    expected = history.readme_lines(history.load())
    assert history.readme_block(README.read_text()) == expected, (
        "README's headline figures differ from benchmarks/results/: run `python benchmarks/history.py --readme`"
    )


def test_a_recorded_result_reaches_the_results_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("fleet_bench_common", ROOT / "benchmarks" / "_common.py")
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    monkeypatch.setenv("FLEET_BENCH_RESULTS", str(tmp_path))
    path = common.record_result(
        "w1_collective",
        variant="shared memory",
        figure="median step time",
        units="ms",
        fleet=90.0,
        peer="DistributedDataParallel",
        peer_value=100.0,
        ratio=0.9,
        summary="0.900 x DDP's step time",
        argv=["--rounds", "3"],
    )
    assert path.parent == tmp_path / "w1_collective"
    history = _history()
    (record,) = history.load(tmp_path)
    for field in ("benchmark", "date", "command", "machine", "load", "fleet", "peer", "ratio", "units"):
        assert field in record, field
    assert record["command"].endswith("--rounds 3")
    assert {"cpu", "cores", "python", "torch"} <= set(record["machine"])
    assert set(record["load"]) == {"before", "after"}
    page = history.results_page([record])
    assert "0.900 x DDP's step time" in page and "{#w1-collective}" in page
