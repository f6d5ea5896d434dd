"""A ratio counts only a configuration that trains (issue 38): the check printed beside every ``ratio vs`` line.

A configuration's samples/s say nothing about training when its loss does not fall like the
model's (W6's PS async once ended at 0.63-0.70 against 0.525 for one process). So every
configuration that enters a ratio (numerator or denominator) must end within :data:`TOLERANCE`
of the reference loss at the same (last) step: W6's reference is fleet in one process on the
union of the workers' batches; W2's is fleet's PS sync with 1 server, which is exactly that
(``benchmarks/w2_ctr.py``). The loss compared is the mean over the workers at the last step (the
loss on the union of their batches), in every round: the round farthest from the reference
decides. A configuration with no reference to compare with is *unchecked* and counts nowhere.

Pure functions, shared by ``w6_dlrm.py`` and ``w2_ctr.py``; ``tests/benchmarks/test_gate.py``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

TOLERANCE = 0.01
"""Largest difference from the reference loss at the last step for a configuration that trains."""


@dataclass(frozen=True)
class Check:
    """One configuration's last-step loss against the reference's."""

    name: str
    loss: float
    reference: float | None
    reference_label: str = "one process"
    tolerance: float = TOLERANCE

    @property
    def trains(self) -> bool | None:
        """True within the tolerance, False outside it (or NaN), None without a reference."""
        if self.reference is None or math.isnan(self.reference):
            return None
        return not math.isnan(self.loss) and abs(self.loss - self.reference) <= self.tolerance

    def note(self) -> str:
        """``NAME, loss 0.5251 vs one process 0.5252: trains`` (or ``does not train``, or ``unchecked``)."""
        if self.trains is None:
            return f"{self.name}, loss {self.loss:.4f}: unchecked (no {self.reference_label} to compare with)"
        verdict = "trains" if self.trains else f"does not train (off by more than {self.tolerance})"
        return f"{self.name}, loss {self.loss:.4f} vs {self.reference_label} {self.reference:.4f}: {verdict}"


def check(
    name: str, last_losses: Sequence[float], reference: float | None, reference_label: str = "one process"
) -> Check:
    """The check of a configuration from its last-step loss in each round: the round farthest from the reference."""
    if not last_losses:
        return Check(name, math.nan, reference, reference_label)
    if reference is None or math.isnan(reference):
        return Check(name, last_losses[0], reference, reference_label)
    worst = max(last_losses, key=lambda loss: math.inf if math.isnan(loss) else abs(loss - reference))
    return Check(name, worst, reference, reference_label)


def best(rates: Mapping[str, float], checks: Mapping[str, Check], names: Iterable[str] | None = None) -> str | None:
    """The fastest of ``names`` (default: all of ``rates``) whose check says it trains; None when none does."""
    found = [n for n in (rates if names is None else names) if n in rates and checks.get(n) and checks[n].trains]
    return max(found, key=lambda n: rates[n]) if found else None


def excluded(checks: Mapping[str, Check], names: Iterable[str]) -> list[Check]:
    """The checks of ``names`` that do not train (or are unchecked): left out of every "best"."""
    return [checks[n] for n in names if n in checks and not checks[n].trains]


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None when either is missing, NaN or ``b`` is not positive."""
    if a is None or b is None or math.isnan(a) or math.isnan(b) or b <= 0:
        return None
    return a / b


def ratio_line(
    label: str,
    num: str | None,
    den: str | None,
    values: Mapping[str, float],
    checks: Mapping[str, Check],
    target: str,
    missing: str = "",
) -> tuple[str, float | None]:
    """``LABEL: 0.58 (NUM's check; DEN's check; target ...)`` and the ratio (None: n/a, and why).

    A name without a check (W2's no-distribution limit) is shown as a bound: it is the rate of a
    process that trains nothing comparable, so no loss applies to it.
    """
    if num is None or den is None:
        why = missing or "no configuration of " + ("either side" if num is None and den is None else "one side")
        return f"{label}: n/a ({why}; target {target})", None
    r = ratio(values.get(num), values.get(den))
    shown = "n/a" if r is None else f"{r:.2f}"
    notes = [checks[n].note() if n in checks else f"{n}: a bound, not a trainer (not checked)" for n in (num, den)]
    return f"{label}: {shown} ({notes[0]}; {notes[1]}; target {target})", r


def cpu_line(cpus: Mapping[str, float], fleet_best: str | None, torchrec: str | None) -> tuple[str, float | None]:
    """The line comparing fleet's best configuration's CPU per 1,000 samples with TorchRec's best, and the ratio."""
    if not (fleet_best and torchrec):
        return "CPU per 1,000 samples, fleet best vs TorchRec best: n/a (no pair that trains; target <= 1.0)", None
    value = ratio(cpus.get(fleet_best), cpus.get(torchrec))
    shown = "n/a" if value is None else f"{value:.2f}"
    return (
        f"CPU per 1,000 samples, fleet best vs TorchRec best: {cpus[fleet_best]:.3f} s ({fleet_best}) vs "
        f"{cpus[torchrec]:.3f} s ({torchrec}): ratio {shown} (target <= 1.0)",
        value,
    )
