"""lossysim.stats: intervals, Welch's test and time to target, against closed forms and by simulation."""
import math

import numpy as np
import pytest
from scipy import stats

from lossysim.results.stats import mean_ci, time_to_target, welch_p


def test_interval_is_the_student_t_closed_form():
    est = mean_ci([1.0, 2.0, 3.0, None, float("nan")])       # missing values are not samples
    assert est.n == 3 and est.mean == 2.0 and est.std == 1.0
    assert est.half_width == pytest.approx(stats.t.ppf(0.975, 2) / math.sqrt(3))
    assert (est.low, est.high) == pytest.approx((2 - est.half_width, 2 + est.half_width))
    one = mean_ci([0.7])
    assert one.n == 1 and one.mean == 0.7 and math.isnan(one.half_width)
    assert mean_ci([]).n == 0 and math.isnan(mean_ci([]).mean)


def test_interval_covers_the_true_mean_95_percent_of_the_time():
    """3 seeds, as the quick profile runs: coverage of the t interval is exactly 95% for normal data."""
    rng = np.random.default_rng(0)
    trials = 2000
    covered = sum(abs(e.mean - 0.8) <= e.half_width
                  for e in (mean_ci(rng.normal(0.8, 0.02, 3)) for _ in range(trials)))
    # a binomial(2000, 0.95) lands in [0.93, 0.97] with probability > 0.9999
    assert 0.93 < covered / trials < 0.97
    assert stats.binomtest(covered, trials, 0.95).pvalue > 1e-4


def test_welch_matches_its_closed_form():
    a, b = np.array([0.81, 0.84, 0.80]), np.array([0.90, 0.91, 0.93, 0.92])
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    t = (a.mean() - b.mean()) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))   # Welch-Satterthwaite
    assert welch_p(a, b) == pytest.approx(2 * stats.t.sf(abs(t), df), rel=1e-10)
    assert math.isnan(welch_p([0.8], b)) and math.isnan(welch_p(a, [0.9]))
    assert welch_p([0.5, 0.5], [0.5, 0.5]) == 1.0 and welch_p([0.5, 0.5], [0.6, 0.6]) == 0.0


def test_welch_false_positive_rate_and_power():
    """Same distribution: p < 0.05 about 5% of the time (Welch is slightly conservative with 3
    seeds); a shift of 5 standard deviations is found nearly always."""
    rng = np.random.default_rng(1)
    trials = 1500
    null = np.array([welch_p(rng.normal(0, 1, 3), rng.normal(0, 1, 3)) for _ in range(trials)])
    rate = (null < 0.05).mean()
    assert 0.02 < rate < 0.07, rate
    shifted = np.array([welch_p(rng.normal(5, 1, 3), rng.normal(0, 1, 3)) for _ in range(300)])
    assert (shifted < 0.05).mean() > 0.8


def rows(values, split="validation_matched", sim=False):
    out = []
    for step, acc in values:
        out.append({"step": step, "split": "train", "accuracy": 0.99})        # training rows never count
        row = {"step": step, "split": split, "accuracy": acc}
        if sim:
            row["sim_time_s"] = step * 0.5
        out.append(row)
    return out


def test_time_to_target_first_evaluation_at_or_above_target():
    history = rows([(10, 0.5), (20, 0.79), (30, 0.8), (40, 0.95)], sim=True)
    assert time_to_target(history, 0.8) == {"target": 0.8, "split": "validation_matched", "step": 30,
                                            "sim_time_s": 15.0}
    assert time_to_target(list(reversed(history)), 0.9)["step"] == 40         # order of rows does not matter
    never = time_to_target(history, 0.96)
    assert never["step"] is None and never["sim_time_s"] is None
    assert time_to_target(rows([(5, 0.9)]), 0.8)["sim_time_s"] is None       # no simulated clock recorded


def test_time_to_target_uses_the_primary_split():
    mixed = rows([(10, 0.9)], split="validation_mismatched") + rows([(10, 0.5), (20, 0.85)])
    assert time_to_target(mixed, 0.8)["step"] == 20                           # matched, not mismatched
    assert time_to_target(mixed, 0.8, split="validation_mismatched")["step"] == 10
    assert time_to_target(rows([(3, 0.9)], split="test"), 0.8) == {
        "target": 0.8, "split": "test", "step": 3, "sim_time_s": None}
    assert time_to_target([], 0.8)["split"] is None
