"""lossysim.results.stats: intervals, Welch's and the paired test, time to target, against closed forms and
by simulation."""
import math

import numpy as np
import pytest
from scipy import stats

from lossysim.results.stats import mean_ci, paired_difference, paired_p, time_to_target, welch_p


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


def test_paired_difference_and_p_match_their_closed_forms():
    baseline = np.array([0.80, 0.90, 0.97, 0.85])
    values = baseline - np.array([0.021, 0.018, 0.020, 0.025])
    d = values - baseline
    est = paired_difference(values, baseline)
    assert est.n == 4 and est.mean == pytest.approx(d.mean())
    assert est.half_width == pytest.approx(stats.t.ppf(0.975, 3) * d.std(ddof=1) / 2)   # sqrt(4) = 2
    t = d.mean() / (d.std(ddof=1) / 2)
    assert paired_p(values, baseline) == pytest.approx(2 * stats.t.sf(abs(t), 3), rel=1e-10)


def test_paired_test_finds_a_constant_shift_that_welch_misses():
    """Seeds move accuracy by +-10 points, the setting costs each seed 2 points: the unpaired view
    sees two overlapping groups, the paired one a shift with almost no spread."""
    seed_effect = np.array([-0.10, 0.0, 0.10])
    baseline = 0.9 + seed_effect
    values = baseline - 0.02 + np.array([0.001, -0.001, 0.0005])
    assert welch_p(values, baseline) > 0.5
    assert paired_p(values, baseline) < 0.01
    est = paired_difference(values, baseline)
    assert est.low < -0.02 < est.high and est.high < 0
    assert mean_ci(values).half_width > 10 * est.half_width
    # The same numbers in another order are no longer pairs: the test must pair by position.
    assert paired_p(values[::-1], baseline) > 0.5


def test_paired_needs_two_complete_pairs():
    assert math.isnan(paired_p([0.5], [0.6])) and math.isnan(paired_difference([0.5], [0.6]).half_width)
    assert paired_difference([0.5], [0.6]).mean == pytest.approx(-0.1)
    # a pair with a missing side is not a pair: one complete pair left
    assert math.isnan(paired_p([0.5, None, 0.7], [0.6, 0.6, float("nan")]))
    assert paired_difference([0.5, None, 0.7, 0.9], [0.6, 0.6, float("nan"), 0.95]).n == 2
    assert paired_difference([], []).n == 0
    with pytest.raises(ValueError, match="equal lengths"):
        paired_p([0.5, 0.6], [0.5])
    # differences without spread: equal (p = 1) or different (p = 0), as scipy would say nan
    assert paired_p([0.5, 0.7], [0.5, 0.7]) == 1.0 and paired_p([0.5, 0.75], [0.25, 0.5]) == 0.0


def test_paired_false_positive_rate_coverage_and_power():
    """Seed effects (sd 5) shared by both sides, run noise sd 1, 3 seeds: with no true difference
    p < 0.05 about 5% of the time and the interval covers 0 about 95% of the time; a shift of 3
    is found by the paired test far more often than by Welch's, which the seed spread swamps."""
    rng = np.random.default_rng(2)

    def draw(shift):
        seed = rng.normal(0, 5, 3)
        return seed + shift + rng.normal(0, 1, 3), seed + rng.normal(0, 1, 3)

    null = [draw(0.0) for _ in range(2000)]
    rate = np.mean([paired_p(a, b) < 0.05 for a, b in null])
    assert 0.035 < rate < 0.065, rate
    covered = np.mean([paired_difference(a, b).low <= 0 <= paired_difference(a, b).high for a, b in null])
    assert 0.935 < covered < 0.965, covered
    shifted = [draw(3.0) for _ in range(500)]
    paired_power = np.mean([paired_p(a, b) < 0.05 for a, b in shifted])
    welch_power = np.mean([welch_p(a, b) < 0.05 for a, b in shifted])
    assert paired_power > 0.25 and welch_power < 0.1 and paired_power > 3 * welch_power, (paired_power, welch_power)


def rows(values, split="validation_matched", sim=False):
    out = []
    for step, acc in values:
        out.append({"step": step, "split": "train", "accuracy": 0.99})        # training rows never count
        row = {"step": step, "split": split, "accuracy": acc}
        if sim:
            row["sim_time_s"] = step * 0.5
            row["sim_time_s_ideal_nic"] = step * 0.25
        out.append(row)
    return out


def test_time_to_target_first_evaluation_at_or_above_target():
    history = rows([(10, 0.5), (20, 0.79), (30, 0.8), (40, 0.95)], sim=True)
    assert time_to_target(history, 0.8) == {"target": 0.8, "split": "validation_matched", "step": 30,
                                            "sim_time_s": 15.0, "sim_time_s_ideal_nic": 7.5}
    assert time_to_target(list(reversed(history)), 0.9)["step"] == 40         # order of rows does not matter
    never = time_to_target(history, 0.96)
    assert never["step"] is None and never["sim_time_s"] is None and never["sim_time_s_ideal_nic"] is None
    assert time_to_target(rows([(5, 0.9)]), 0.8)["sim_time_s"] is None       # no simulated clock recorded


def test_time_to_target_uses_the_primary_split():
    mixed = rows([(10, 0.9)], split="validation_mismatched") + rows([(10, 0.5), (20, 0.85)])
    assert time_to_target(mixed, 0.8)["step"] == 20                           # matched, not mismatched
    assert time_to_target(mixed, 0.8, split="validation_mismatched")["step"] == 10
    assert time_to_target(rows([(3, 0.9)], split="test"), 0.8) == {
        "target": 0.8, "split": "test", "step": 3, "sim_time_s": None, "sim_time_s_ideal_nic": None}
    assert time_to_target([], 0.8)["split"] is None
