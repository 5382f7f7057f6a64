"""Statistics over runs: confidence intervals over seeds, Welch's and the paired t-test against a
baseline, and when a run first reached a target accuracy.

Small functions on plain numbers and metrics rows, so the report, summary.csv and notebooks
compute them one way. Seeds are the independent samples: a setting run with n seeds has n values.
Runs with the same seed share data order and initialisation, so a setting and its baseline can
also be compared seed by seed (``paired_difference``, ``paired_p``): the differences carry no
between-seed spread, which the unpaired view (``mean_ci`` of each side, ``welch_p``) does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np
from scipy import stats

CONFIDENCE = 0.95
ALPHA = 0.05
DEFAULT_TARGET = 0.8       # the target accuracy when a run's config names none


@dataclass(frozen=True)
class Estimate:
    """Mean of n values and the half-width of its two-sided Student-t confidence interval
    (nan for n < 2: one seed says nothing about the spread)."""
    mean: float
    half_width: float
    n: int
    std: float

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width


def _finite(values: Iterable) -> np.ndarray:
    array = np.asarray([float(v) for v in values if v is not None], dtype=float)
    return array[np.isfinite(array)]


def mean_ci(values: Iterable, confidence: float = CONFIDENCE) -> Estimate:
    """Mean and Student-t interval half-width t_{(1+c)/2, n-1} * s / sqrt(n) of the finite values."""
    x = _finite(values)
    n = len(x)
    if n == 0:
        return Estimate(math.nan, math.nan, 0, math.nan)
    if n == 1:
        return Estimate(float(x[0]), math.nan, 1, math.nan)
    std = float(x.std(ddof=1))
    half = float(stats.t.ppf((1 + confidence) / 2, n - 1) * std / math.sqrt(n))
    return Estimate(float(x.mean()), half, n, std)


def welch_p(values: Iterable, baseline: Iterable) -> float:
    """Two-sided p-value of Welch's t-test (unequal variances) that two means are equal.

    nan when either side has fewer than two values. Two groups without any spread are equal
    (p = 1) when their values agree, and differ (p = 0) when they do not.
    """
    a, b = _finite(values), _finite(baseline)
    if len(a) < 2 or len(b) < 2:
        return math.nan
    if a.std() == 0 and b.std() == 0:
        return 1.0 if a[0] == b[0] else 0.0
    return float(stats.ttest_ind(a, b, equal_var=False).pvalue)


def _pairs(values: Sequence, baseline: Sequence) -> tuple[np.ndarray, np.ndarray]:
    """The finite (value, baseline) pairs, in order; a pair with a missing side is dropped whole."""
    if len(values) != len(baseline):
        raise ValueError(f"paired samples need equal lengths, got {len(values)} and {len(baseline)}")
    a = np.asarray([math.nan if v is None else float(v) for v in values], dtype=float)
    b = np.asarray([math.nan if v is None else float(v) for v in baseline], dtype=float)
    both = np.isfinite(a) & np.isfinite(b)
    return a[both], b[both]


def paired_difference(values: Sequence, baseline: Sequence, confidence: float = CONFIDENCE) -> Estimate:
    """Mean of the paired differences ``values[i] - baseline[i]`` (the same seed at the same
    position) and its Student-t interval t_{(1+c)/2, n-1} * s_d / sqrt(n), n the number of pairs
    with both sides finite (half-width nan for fewer than two pairs)."""
    a, b = _pairs(values, baseline)
    return mean_ci(a - b, confidence)


def paired_p(values: Sequence, baseline: Sequence) -> float:
    """Two-sided p-value of the paired t-test (``scipy.stats.ttest_rel``) that the mean paired
    difference is zero.

    nan for fewer than two pairs. Differences without any spread say the two sides are equal
    (p = 1) when they are all zero, and differ (p = 0) otherwise.
    """
    a, b = _pairs(values, baseline)
    if len(a) < 2:
        return math.nan
    d = a - b
    if d.std() == 0:
        return 1.0 if d[0] == 0 else 0.0
    return float(stats.ttest_rel(a, b).pvalue)


def time_to_target(rows: Iterable[dict], target: float, split: Optional[str] = None) -> dict:
    """The first evaluation at which accuracy on ``split`` reached ``target``.

    ``rows`` are metrics.jsonl rows; ``split`` defaults to the primary eval split (MNLI's
    matched one, else the first eval split seen). Returns ``{"target", "split", "step",
    "sim_time_s", "sim_time_s_ideal_nic"}``, step and the times None when the target was never
    reached (the times also when the rows carry no simulated clock).
    """
    evals = [r for r in rows if r.get("split") not in (None, "train") and r.get("accuracy") is not None]
    if split is None:
        seen = list(dict.fromkeys(r["split"] for r in evals))
        split = "validation_matched" if "validation_matched" in seen else (seen[0] if seen else None)
    hit = next((r for r in sorted((r for r in evals if r["split"] == split), key=lambda r: r["step"])
                if float(r["accuracy"]) >= target), None)
    seconds = lambda key: None if hit is None or hit.get(key) is None else float(hit[key])  # noqa: E731
    return {"target": float(target), "split": split, "step": None if hit is None else int(hit["step"]),
            "sim_time_s": seconds("sim_time_s"), "sim_time_s_ideal_nic": seconds("sim_time_s_ideal_nic")}
