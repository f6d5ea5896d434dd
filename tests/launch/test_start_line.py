"""fleetrun's start line names the strategy the job runs: the strategy file's mode, or that the script chooses."""

from __future__ import annotations

from pathlib import Path

from fleet.launch.cli import describe_job, parse_config


def line(tmp_path: Path, *argv: str) -> str:
    script = tmp_path / "train.py"
    script.write_text("")
    return describe_job(parse_config([*argv, str(script)]), tmp_path)


def test_the_start_line_names_the_mode(tmp_path: Path) -> None:
    sharding = tmp_path / "sharding.toml"
    sharding.write_text('mode = "sharding"\n')
    assert "sharding job" in line(tmp_path, "--workers", "2", "--strategy", str(sharding))
    assert "collective job" not in line(tmp_path, "--workers", "2", "--strategy", str(sharding))
    assert "collective or sharding: the script's strategy chooses" in line(tmp_path, "--workers", "2")
    assert "parameter-server job" in line(tmp_path, "--workers", "2", "--servers", "1")
