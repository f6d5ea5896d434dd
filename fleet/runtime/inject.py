"""Fault and straggler injection for tests and demos.

Given by the strategy (``DistributedStrategy(inject={...})``) or by the environment
variable ``FLEET_INJECT`` holding the same fields as JSON; the variable wins when both
are set. Examples::

    FLEET_INJECT='{"ranks": [3], "delay": {"mu": -1.0, "sigma": 0.5}}'   # worker 3 straggles
    FLEET_INJECT='{"ranks": [1], "crash_at_step": 5}'                    # worker 1 dies at step 5

On the chosen worker ranks, at every optimizer step boundary (``WrappedOptimizer._end_step``,
so every strategy gets it):

- ``delay``: sleep an extra ``lognormvariate(mu, sigma)`` seconds (median ``exp(mu)``), drawn
  from a generator seeded with ``(seed, rank)`` so a run repeats exactly.
- ``crash_at_step``: after the update of step k (counted from 1 in this process), print a line
  naming the injection and exit with ``exit_code`` at once (``os._exit``: no clean-up, like a
  real crash). Only in the first incarnation (``FLEET_RESTART_COUNT`` = 0), so a job run with
  ``--max-restarts`` recovers instead of crashing again.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fleet.runtime import env


class InjectionError(ValueError):
    """An injection spec fleet cannot apply."""


class DelaySpec(BaseModel):
    """A per-step extra delay in seconds drawn from log-normal(mu, sigma)."""

    model_config = ConfigDict(extra="forbid")

    mu: float = Field(ge=-20, le=5)
    """Mean of the delay's logarithm: the median delay is exp(mu) seconds (mu=-1: 0.37 s)."""

    sigma: float = Field(0.0, ge=0, le=5)
    """Standard deviation of the delay's logarithm (0: always exp(mu))."""


class InjectionSpec(BaseModel):
    """Which workers misbehave and how."""

    model_config = ConfigDict(extra="forbid")

    ranks: list[int] = Field(min_length=1)
    """Worker indices the injection applies to."""

    delay: DelaySpec | None = None
    """Straggler: extra sleep at every step boundary."""

    crash_at_step: int | None = Field(None, ge=1)
    """Crash: exit at the end of this optimizer step (1 = the first)."""

    exit_code: int = Field(1, ge=1, le=125)
    """Exit status of an injected crash."""

    seed: int = 0
    """Seed of the delay generator (combined with the rank)."""

    @model_validator(mode="after")
    def _something_to_do(self) -> InjectionSpec:
        if self.delay is None and self.crash_at_step is None:
            raise ValueError("give delay (e.g. {'mu': -1.0, 'sigma': 0.5}) or crash_at_step (e.g. 5), or both")
        bad = [r for r in self.ranks if r < 0]
        if bad:
            raise ValueError(f"ranks must be worker indices >= 0, got {bad}")
        return self


def _explain(name: str, text: str, error: ValidationError) -> str:
    problems = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        value = item.get("input")
        shown = f" = {value!r}" if where and not isinstance(value, dict) else ""
        problems.append(f"{where}{shown}: {message}" if where else message)
    allowed = "ranks (list of worker indices), delay {mu, sigma}, crash_at_step, exit_code, seed"
    return f"{name}={text!r} is not a valid injection: {'; '.join(problems)}. Fields: {allowed}."


def parse(text: str, name: str = env.FLEET_INJECT) -> InjectionSpec:
    """An :class:`InjectionSpec` from JSON text; errors name the variable and the value."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise InjectionError(
            f'{name}={text!r} is not JSON ({error}); e.g. \'{{"ranks": [1], "crash_at_step": 5}}\'.'
        ) from None
    try:
        return InjectionSpec.model_validate(data)
    except ValidationError as error:
        raise InjectionError(_explain(name, text, error)) from None


class Injector:
    """Applies a spec at this worker's step boundaries; does nothing when the rank is not chosen."""

    def __init__(
        self,
        spec: InjectionSpec | None,
        rank: int,
        *,
        restarts: int = 0,
        source: str = env.FLEET_INJECT,
        sleep=time.sleep,
    ):
        self.spec = spec
        self.rank = rank
        self.source = source
        self.active = spec is not None and rank in spec.ranks
        self.crash_at = spec.crash_at_step if self.active and restarts == 0 else None  # type: ignore[union-attr]
        self.delay = spec.delay if self.active else None  # type: ignore[union-attr]
        self._rng = random.Random(f"{spec.seed}:{rank}") if self.active else None  # type: ignore[union-attr]
        self._sleep = sleep

    def next_delay(self) -> float:
        if self.delay is None or self._rng is None:
            return 0.0
        return self._rng.lognormvariate(self.delay.mu, self.delay.sigma)

    def before_boundary(self) -> float:
        """Sleep the injected delay (if any); return it."""
        seconds = self.next_delay()
        if seconds > 0:
            self._sleep(seconds)
        return seconds

    def after_step(self, step: int) -> None:
        """Crash if this is the chosen step."""
        if self.crash_at is not None and step == self.crash_at:
            assert self.spec is not None
            print(
                f"fleet.runtime.inject: worker {self.rank} crashes at step {step} (exit status {self.spec.exit_code}) "
                f"as injected by {self.source}",
                file=sys.stderr,
                flush=True,
            )
            sys.stdout.flush()
            os._exit(self.spec.exit_code)


def for_process(strategy: object | None, rank: int, reader: env.EnvReader | None = None) -> Injector:
    """The injector for this worker: FLEET_INJECT if set, else the strategy's ``inject`` field."""
    reader = reader or env.current()
    restarts = reader.int(env.FLEET_RESTART_COUNT, 0) or 0
    text = reader.str(env.FLEET_INJECT)
    if text is not None:
        return Injector(parse(text), rank, restarts=restarts, source=env.FLEET_INJECT)
    spec = getattr(strategy, "inject", None)
    return Injector(spec, rank, restarts=restarts, source="DistributedStrategy.inject")
