"""Files written so that a reader (or a crash) never sees half of one: a temporary name, then a rename."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_atomic(path: str | Path, write: Callable[[str], None]) -> None:
    """``write(temporary path)``, then move it over ``path``; on failure the temporary file is removed."""
    path = str(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    write_atomic(path, lambda tmp: Path(tmp).write_text(text))


def save_atomic(obj: Any, path: str | Path) -> None:
    """``torch.save`` without ever leaving a torn file under ``path``."""
    import torch

    write_atomic(path, lambda tmp: torch.save(obj, tmp))
