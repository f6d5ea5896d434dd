"""The pure math of the straggler / scaling study (benchmarks/_common.py)."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import _common as c  # noqa: E402

from fleet.telemetry.step_report import speedup_condition  # noqa: E402


@pytest.mark.timeout(30)
def test_expected_max_lognormal_matches_closed_forms():
    mu, sigma = math.log(0.05), 0.5
    assert c.expected_max_lognormal(1, mu, sigma) == pytest.approx(c.lognormal_mean(mu, sigma), rel=0.01)
    assert c.expected_max_lognormal(2, mu, sigma) == pytest.approx(c.expected_max2_lognormal(mu, sigma), rel=0.01)
    growing = [c.expected_max_lognormal(n, mu, sigma, samples=50_000) for n in (2, 4, 8)]
    assert growing == sorted(growing) and growing[-1] > 1.5 * c.lognormal_mean(mu, sigma)


@pytest.mark.timeout(10)
def test_predicted_speedup_exceeds_one_exactly_when_the_condition_holds():
    t_comp_1 = 0.1
    for workers in (2, 4, 8):
        total = workers * t_comp_1  # one process doing the R workers' step
        for t_sync in (f * (workers - 1) * t_comp_1 for f in (0.0, 0.5, 0.99, 1.01, 2.0)):
            holds = speedup_condition(t_sync, total, workers)["holds"]
            assert (c.predicted_speedup(t_comp_1, t_sync, workers) > 1) == holds
    assert c.predicted_speedup(0.1, 0.0, 4) == pytest.approx(4.0)
