"""Reading a strategy file (TOML or JSON): one reader for ``DistributedStrategy.from_file`` and fleetrun.

No torch and no pydantic here: fleetrun reads the file only to catch a launch that contradicts
it (``--servers`` with a collective strategy); the script validates it in full.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any


class StrategyFileError(ValueError):
    """The file is missing, unreadable, not TOML/JSON, or not a table of settings: the message says which."""


def read(path: str | Path, given: str = "") -> dict[str, Any]:
    """The settings in ``path``: fields at top level, or under a lone ``[strategy]`` table.

    ``given``: how the path came (e.g. "given to --strategy"), for the messages.
    """
    shown = f"{str(path)!r} {given}".rstrip()
    path = Path(path).expanduser()
    if not path.is_file():
        raise StrategyFileError(f"The strategy file {shown} does not exist.")
    if path.suffix not in (".toml", ".json"):
        raise StrategyFileError(
            f"The strategy file {shown} must end in .toml or .json, which says how to read it. "
            "Rename it, for example to strategy.toml."
        )
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StrategyFileError(
            f"The strategy file {shown} does not parse ({exc}). "
            'Write it as TOML (.toml) or JSON (.json), for example: mode = "collective".'
        ) from None
    except OSError as exc:
        raise StrategyFileError(f"The strategy file {shown} cannot be read ({exc.strerror}).") from None
    if isinstance(data, dict) and isinstance(data.get("strategy"), dict) and len(data) == 1:
        data = data["strategy"]
    if not isinstance(data, dict):
        raise StrategyFileError(
            f"The strategy file {shown} holds a {type(data).__name__}, not a table of settings. "
            'Write it as a TOML table or a JSON object, for example {"mode": "ps"}.'
        )
    return data


def mode_of(data: dict[str, Any]) -> str | None:
    """The ``mode`` the settings ask for, as DistributedStrategy reads them (None: the default).

    Paddle's spellings: ``a_sync`` (true or false) means "ps", ``sharding = true`` "sharding".
    """
    mode = data.get("mode")
    if isinstance(mode, str):
        return mode.strip()
    if "a_sync" in data:
        return "ps"
    if data.get("sharding") is True:
        return "sharding"
    return None
