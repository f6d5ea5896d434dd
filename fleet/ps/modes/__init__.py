"""Parameter-server update modes as objects: ``mode_for("sync" | "async" | "geo")``.

Each mode declares its name, its options, its worker policy, its row backend and its server
policy (:mod:`fleet.ps.modes.base`); one file per mode. This registry is the only place that
maps a name to a mode.
"""

from __future__ import annotations

from fleet.ps.modes.async_ import AsyncMode
from fleet.ps.modes.base import Admit, UpdateMode, WorkerPolicy
from fleet.ps.modes.geo import GeoMode
from fleet.ps.modes.sync import SyncMode

__all__ = ["Admit", "UpdateMode", "WorkerPolicy", "mode_for", "names", "of_config"]

_MODES: dict[str, UpdateMode] = {mode.name: mode for mode in (SyncMode(), AsyncMode(), GeoMode())}


def names() -> tuple[str, ...]:
    """Every mode's name, in the order they are documented."""
    return tuple(_MODES)


def mode_for(name: str) -> UpdateMode:
    """The mode called ``name``; ``KeyError`` naming the known ones otherwise."""
    mode = _MODES.get(name)
    if mode is None:
        raise KeyError(f"update={name!r}; expected one of {', '.join(_MODES)}")
    return mode


def of_config(config: dict) -> UpdateMode:
    """The mode of a create-table config (its ``"update"``; a table created without one is async)."""
    return mode_for(config.get("update", AsyncMode.name))
