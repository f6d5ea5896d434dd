"""The life cycle of a sparse table's rows: which new ids get a row, what each row remembers, which rows go.

A CTR job trained for weeks sees an open-ended stream of ids, most of them a few times
only. Without a life cycle every id ever seen keeps a row, and a server runs out of
memory. Three mechanisms bound it, configured per table (Paddle's names where Paddle
has them):

- **Admission** (``entry``): :class:`CountFilterEntry` gives an id a row once it was seen
  in ``min_count`` updates; its counts live in a :class:`CountSketch` (a count-min sketch
  of fixed size, so ids not yet admitted cost no memory of their own). Counts fade: they
  halve every ``sketch_width / 2`` sightings of ids not yet admitted, so an id is admitted
  when it reaches ``min_count`` within about that window (a sketch that never forgot would
  fill up and admit everything).
  :class:`ProbabilityEntry` admits an id at each update with probability ``p``, decided
  by a hash of (id, step, seed) so every replica of a table decides alike. Until admitted
  an id's lookup returns zeros and its gradient is dropped (counted).
- **Statistics** per row: the step it was last updated, and a show and a click count
  that decay by ``decay`` per step (applied lazily, at the row's next touch). A row's
  score is Paddle's CTR-accessor score ``nonclk_coeff * (show - click) + click_coeff * click``.
- **Eviction**: rows not updated for ``ttl_steps`` steps, the lowest-scoring rows when a
  table would pass ``max_rows`` (down to ``(1 - EVICT_SLACK) * max_rows``, so the O(rows)
  pass is amortised), and on demand (``fleet.shrink``).

"Step" is the table's clock: one per optimizer step in a single process, in collective mode
and in PS sync; the largest step a worker reported in async and geo mode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from fleet.sparse.native import kernels

EVICT_SLACK = 0.05  # a max_rows eviction frees this share of the table, so it runs once per that many new rows
SKETCH_DEPTH = 4
DEFAULT_SKETCH_WIDTH = 1 << 22  # 4 x 4 Mi uint8 counters: 16 MiB per table (per server shard)
_MULTIPLIERS = (
    0x9E3779B97F4A7C15 - (1 << 64),
    0xBF58476D1CE4E5B9 - (1 << 64),
    0x94D049BB133111EB - (1 << 64),
    0xD6E8FEB86659FD93 - (1 << 64),
    0x2545F4914F6CDD1D,
)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _wrap(value: int) -> int:
    """``value`` as a signed 64-bit integer (two's complement wrap-around)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _mix(x: torch.Tensor, multiplier: int) -> torch.Tensor:
    """splitmix64's finaliser over ``x * multiplier`` (wrapping int64 arithmetic)."""
    h = x * multiplier
    h = (h ^ _shr(h, 30)) * _MULTIPLIERS[1]
    h = (h ^ _shr(h, 27)) * _MULTIPLIERS[2]
    return h ^ _shr(h, 31)


class CountFilterEntry:
    """Admit an id once it was seen in ``min_count`` updates (Paddle's ``CountFilterEntry``).

    ``sketch_width`` (a power of two) sizes the counters: 4 bytes of memory per unit, and the
    window of sightings within which an id must reach ``min_count`` is about half of it.
    """

    kind = "count"

    def __init__(self, min_count: int, sketch_width: int = DEFAULT_SKETCH_WIDTH):
        if isinstance(min_count, bool) or not isinstance(min_count, int) or not 1 <= min_count <= 255:
            raise ValueError(f"CountFilterEntry(min_count): an int in [1, 255], got {min_count!r}")
        _check_width(sketch_width)
        self.min_count = min_count
        self.sketch_width = sketch_width

    def to_config(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "min_count": self.min_count}
        if self.sketch_width != DEFAULT_SKETCH_WIDTH:
            out["sketch_width"] = self.sketch_width
        return out

    def __repr__(self) -> str:
        return f"CountFilterEntry({self.min_count})"


def _check_width(width: Any) -> None:
    if isinstance(width, bool) or not isinstance(width, int) or width < 64 or width & (width - 1):
        raise ValueError(f"sketch_width must be a power of two >= 64, got {width!r}")


class ProbabilityEntry:
    """Admit an id at each update with probability ``probability`` (Paddle's ``ProbabilityEntry``)."""

    kind = "probability"

    def __init__(self, probability: float):
        if isinstance(probability, bool) or not isinstance(probability, int | float) or not 0 < probability <= 1:
            raise ValueError(f"ProbabilityEntry(probability): a number in (0, 1], got {probability!r}")
        self.probability = float(probability)

    def to_config(self) -> dict[str, Any]:
        return {"kind": self.kind, "probability": self.probability}

    def __repr__(self) -> str:
        return f"ProbabilityEntry({self.probability})"


Entry = CountFilterEntry | ProbabilityEntry


def entry_from_config(config: Any) -> Entry | None:
    if config is None or isinstance(config, CountFilterEntry | ProbabilityEntry):
        return config
    if not isinstance(config, dict):
        raise ValueError(
            f"entry must be fleet.CountFilterEntry(n), fleet.ProbabilityEntry(p) or None, got {type(config).__name__}"
        )
    kind = config.get("kind")
    if kind == "count" and set(config) in ({"kind", "min_count"}, {"kind", "min_count", "sketch_width"}):
        return CountFilterEntry(config["min_count"], config.get("sketch_width", DEFAULT_SKETCH_WIDTH))
    if kind == "probability" and set(config) == {"kind", "probability"}:
        return ProbabilityEntry(config["probability"])
    raise ValueError(
        f"entry config {config!r}: expected {{'kind': 'count', 'min_count': n}} "
        "or {'kind': 'probability', 'probability': p}"
    )


def _positive_int(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be an int > 0 or None, got {value!r}")
    return value


@dataclass(frozen=True)
class LifeCycle:
    """A table's life-cycle settings; ``max_rows`` is this table's (or shard's) own cap."""

    entry: Entry | None = None
    max_rows: int | None = None
    ttl_steps: int | None = None
    decay: float = 0.999
    nonclk_coeff: float = 0.1
    click_coeff: float = 1.0

    CONFIG_KEYS = ("entry", "max_rows", "ttl_steps", "decay", "nonclk_coeff", "click_coeff")

    def __post_init__(self) -> None:
        _positive_int("max_rows", self.max_rows)
        _positive_int("ttl_steps", self.ttl_steps)
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay (per step) must be in (0, 1], got {self.decay!r}")

    @property
    def sketch_width(self) -> int:
        entry = self.entry
        return entry.sketch_width if isinstance(entry, CountFilterEntry) else DEFAULT_SKETCH_WIDTH

    @property
    def active(self) -> bool:
        """Whether rows are created by updates only (a pull of a missing id stores nothing)."""
        return self.entry is not None or self.max_rows is not None or self.ttl_steps is not None

    @classmethod
    def from_config(cls, config: dict[str, Any], shards: int = 1) -> LifeCycle:
        """From a table config; a job-wide ``max_rows`` is split evenly over ``shards`` servers."""
        max_rows = _positive_int("max_rows", config.get("max_rows"))
        if max_rows is not None:
            if max_rows < shards:
                raise ValueError(f"max_rows={max_rows} is less than the number of servers ({shards})")
            max_rows //= shards
        keys = {k: config[k] for k in ("decay", "nonclk_coeff", "click_coeff") if k in config}
        return cls(
            entry=entry_from_config(config.get("entry")),
            max_rows=max_rows,
            ttl_steps=_positive_int("ttl_steps", config.get("ttl_steps")),
            **keys,
        )

    def to_config(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.entry is not None:
            out["entry"] = self.entry.to_config()
        if self.max_rows is not None:
            out["max_rows"] = self.max_rows
        if self.ttl_steps is not None:
            out["ttl_steps"] = self.ttl_steps
        defaults = LifeCycle()
        for key in ("decay", "nonclk_coeff", "click_coeff"):
            if getattr(self, key) != getattr(defaults, key):
                out[key] = getattr(self, key)
        return out

    def score(self, show: torch.Tensor, click: torch.Tensor) -> torch.Tensor:
        return self.nonclk_coeff * (show - click) + self.click_coeff * click

    def decayed(self, values: torch.Tensor, age: torch.Tensor) -> torch.Tensor:
        """``values`` after ``age`` steps of decay."""
        if self.decay == 1.0:
            return values
        return values * torch.exp(age.to(torch.float32) * math.log(self.decay))


class CountSketch:
    """Approximate counts of ids not yet admitted: a count-min sketch of uint8 counters.

    ``SKETCH_DEPTH`` rows of ``width`` counters; an id's count is the minimum of its counters,
    which never undercounts. Conservative update (raise only the counters at the minimum)
    keeps the overcount small; counters saturate at 255 and all halve once ``width / 2``
    counts went in, so ids seen long ago fade and a full sketch does not admit everything.
    Admitted ids stop being counted here.
    """

    @staticmethod
    def window(width: int) -> int:
        """Sightings between two halvings: half the width keeps the counters' load under one."""
        return width // 2

    def __init__(self, width: int = DEFAULT_SKETCH_WIDTH, seed: int = 0):
        self.width = width
        self.seed = seed
        self.counters = torch.zeros(SKETCH_DEPTH, width, dtype=torch.uint8)
        self.added = 0

    def _salt(self) -> int:
        """The seed's salt as a signed 64-bit value (wrapped: any seed; was OverflowError from 2 on)."""
        salt = (self.seed * _MULTIPLIERS[4]) & ((1 << 64) - 1)
        return salt - (1 << 64) if salt >= 1 << 63 else salt

    def add(self, ids: torch.Tensor, undo: Any = None) -> torch.Tensor:
        """Count each (unique) id once more; return every id's count after this.

        ``undo``: a :class:`fleet.sparse.undo.UndoLog` to record how to take the counts back.
        """
        if ids.numel() == 0:
            return torch.zeros(0, dtype=torch.int64)
        ids = ids.contiguous()
        n = ids.numel()
        counts = torch.empty(n, dtype=torch.int64)
        pos = torch.empty(SKETCH_DEPTH * n, dtype=torch.int64)
        old = torch.empty(SKETCH_DEPTH * n, dtype=torch.uint8)
        bits = self.width.bit_length() - 1
        # One native pass (fleet.sparse.native): the counters' positions, their old values and the new counts.
        kernels.sketch_add(
            self.counters.view(-1).numpy(),
            ids.numpy(),
            self._salt(),
            SKETCH_DEPTH,
            bits,
            counts.numpy(),
            pos.numpy(),
            old.numpy(),
        )
        if undo is not None:  # after the kernel, which checks everything before it writes, and fills pos and old
            undo.rows(lambda: self.counters.view(-1), pos, old)
            undo.attrs(self, "counters", "added")  # undone first: the rows go back into the old counters
        self.added += n
        if self.added >= self.window(self.width):
            self.counters = self.counters >> 1  # new counters, so that an undo can keep the old ones
            self.added //= 2
        return counts

    def state_dict(self) -> dict[str, Any]:
        return {"counters": self.counters.clone(), "added": self.added}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        counters = state["counters"]
        if tuple(counters.shape) != (SKETCH_DEPTH, self.width) or counters.dtype != torch.uint8:
            raise ValueError(
                f"admission sketch of shape {tuple(counters.shape)} ({counters.dtype}); this table's is "
                f"({SKETCH_DEPTH}, {self.width}) uint8"
            )
        self.counters = counters.clone()
        self.added = int(state["added"])


class Admission:
    """Decides which new ids get a row, per the table's entry."""

    def __init__(self, entry: Entry | None, sketch_width: int, seed: int):
        self.entry = entry
        self.seed = seed
        self.sketch = CountSketch(sketch_width, seed) if isinstance(entry, CountFilterEntry) else None

    def admit(self, new_ids: torch.Tensor, clock: int, undo: Any = None) -> torch.Tensor:
        """A bool mask over unique, absent ``new_ids``: which get a row now (``undo``: see CountSketch.add)."""
        if self.entry is None:
            return torch.ones(new_ids.numel(), dtype=torch.bool)
        if self.sketch is not None:
            return self.sketch.add(new_ids, undo) >= self.entry.min_count
        # the products wrapped to int64 as the hash's other steps are (a Python int past 64 bits cannot meet a tensor)
        draw = _mix(new_ids ^ _wrap(clock * _MULTIPLIERS[3]) ^ _wrap(self.seed * _MULTIPLIERS[4]), _MULTIPLIERS[0])
        uniform = _shr(draw, 11).to(torch.float64) / float(1 << 53)
        return uniform < self.entry.probability

    def state_dict(self) -> dict[str, Any]:
        return self.sketch.state_dict() if self.sketch is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.sketch is not None and state:
            self.sketch.load_state_dict(state)
