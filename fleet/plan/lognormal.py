"""Log-normal step times: fitting them, and the expected order statistics a synchronous step waits for.

A synchronous step of R workers ends when the slowest worker is done (the maximum of R step
times); with b backup workers, when the (R-b)-th fastest is (TensorFlow's
SyncReplicasOptimizer, fleet's ``backup_workers``). Worker step times on shared machines are
skewed to the right, and a log-normal fits them well (Dean and Barroso, "The tail at scale",
2013; fleet's own fan-out study, docs/modes.md F1), so the model needs E[X_(k:n)], the
expected k-th smallest of n independent log-normal samples. There is no closed form; it is
one integral over the standard normal variable z (x = exp(mu + sigma z)):

    E[X_(k:n)] = k C(n, k) integral exp(mu + sigma z) Phi(z)^(k-1) (1 - Phi(z))^(n-k) phi(z) dz

computed here with Simpson's rule in log space (no overflow at n = 1,024 and beyond). Pure
Python: the planner runs before torch is imported.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

Z95 = 1.6448536269514722  # the standard normal's 95th percentile
_Z_LO, _Z_HI, _Z_STEPS = -12.0, 12.0, 4800  # the integrand is negligible beyond |z| = 12 up to n ~ 1e30


def _log_phi_cdf(z: float) -> float:
    return math.log(0.5 * math.erfc(-z / math.sqrt(2.0)))


def _log_phi_sf(z: float) -> float:
    return math.log(0.5 * math.erfc(z / math.sqrt(2.0)))


_GRID = [_Z_LO + i * (_Z_HI - _Z_LO) / _Z_STEPS for i in range(_Z_STEPS + 1)]
_LOG_CDF = [_log_phi_cdf(z) for z in _GRID]
_LOG_SF = [_log_phi_sf(z) for z in _GRID]
_LOG_PDF = [-0.5 * z * z - 0.5 * math.log(2 * math.pi) for z in _GRID]
_SIMPSON = [1 if i in (0, _Z_STEPS) else (4 if i % 2 else 2) for i in range(_Z_STEPS + 1)]


@dataclass(frozen=True)
class LogNormal:
    """X = exp(mu + sigma Z), Z standard normal: the median is exp(mu), the spread sigma."""

    mu: float
    sigma: float

    def __post_init__(self) -> None:
        if not math.isfinite(self.mu) or not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise ValueError(f"LogNormal(mu={self.mu}, sigma={self.sigma}): mu must be finite and sigma >= 0")

    @property
    def median(self) -> float:
        return math.exp(self.mu)

    @property
    def mean(self) -> float:
        return math.exp(self.mu + self.sigma * self.sigma / 2)

    @classmethod
    def with_mean(cls, mean: float, sigma: float) -> LogNormal:
        """The log-normal with this mean and spread (the mean is what per-step totals measure)."""
        if not mean > 0:
            raise ValueError(f"a log-normal needs a positive mean, got {mean}")
        return cls(math.log(mean) - sigma * sigma / 2, sigma)

    @classmethod
    def fit(cls, samples: Iterable[float]) -> LogNormal:
        """Maximum-likelihood fit: mu and sigma are the mean and standard deviation of log x."""
        logs = [math.log(x) for x in samples if x > 0]
        if len(logs) < 2:
            raise ValueError(f"fitting a log-normal needs at least 2 positive samples, got {len(logs)}")
        mu = sum(logs) / len(logs)
        var = sum((v - mu) ** 2 for v in logs) / (len(logs) - 1)
        return cls(mu, math.sqrt(var))

    @classmethod
    def from_quantiles(cls, p50: float, p95: float) -> LogNormal:
        """The log-normal with this median and 95th percentile (what fleet's step histograms keep)."""
        if not (p50 > 0 and p95 > 0):
            raise ValueError(f"quantiles must be positive, got p50={p50}, p95={p95}")
        return cls(math.log(p50), max(0.0, math.log(p95 / p50) / Z95))

    def quantile(self, q: float) -> float:
        return math.exp(self.mu + self.sigma * _normal_ppf(q))

    def sample(self, rng: random.Random) -> float:
        return rng.lognormvariate(self.mu, self.sigma)

    def expected_order(self, k: int, n: int) -> float:
        """E[k-th smallest of n independent draws] (k = n: the maximum, k = 1: the minimum)."""
        if not 1 <= k <= n:
            raise ValueError(f"order statistic k={k} of n={n}: need 1 <= k <= n")
        if self.sigma == 0 or n == 1:
            return self.mean if n == 1 else self.median
        log_coef = math.log(k) + math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
        h = (_Z_HI - _Z_LO) / _Z_STEPS
        terms = [
            log_coef + self.mu + self.sigma * z + (k - 1) * lc + (n - k) * ls + lp
            for z, lc, ls, lp in zip(_GRID, _LOG_CDF, _LOG_SF, _LOG_PDF, strict=True)
        ]
        top = max(terms)
        total = sum(w * math.exp(t - top) for w, t in zip(_SIMPSON, terms, strict=True))
        return math.exp(top) * total * h / 3

    def expected_max(self, n: int) -> float:
        """E[max of n independent draws]: a synchronous step's wait for the slowest of n workers."""
        return self.expected_order(n, n)


def monte_carlo_order(dist: LogNormal, k: int, n: int, trials: int, seed: int = 0) -> float:
    """E[X_(k:n)] by sampling (the check on :meth:`LogNormal.expected_order`)."""
    rng = random.Random(seed)
    total = 0.0
    for _ in range(trials):
        draws = sorted(dist.sample(rng) for _ in range(n))
        total += draws[k - 1]
    return total / trials


def _normal_ppf(q: float) -> float:
    """The standard normal's quantile function by bisection on erfc (precise to 1e-12)."""
    if not 0 < q < 1:
        raise ValueError(f"quantile q={q} must be in (0, 1)")
    lo, hi = -40.0, 40.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if 0.5 * math.erfc(-mid / math.sqrt(2.0)) < q:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (q in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
