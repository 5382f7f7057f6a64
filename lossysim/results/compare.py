"""Statistics of a report: seeds are samples. A setting (every varying config value but the seed) gets a
95% Student-t interval and Welch's t-test against the loss-free baseline, and, since runs with the same
seed share data order and initialisation, the paired difference from the loss-free run of each seed with
its interval and paired t-test (``settings``)."""
from __future__ import annotations

import math

import pandas as pd

from .settings import add_series, loss_free_runs, setting_groups
from .stats import ALPHA, mean_ci, paired_difference, paired_p, time_to_target, welch_p


def aggregate(runs: pd.DataFrame, value: str, by=("series", "loss_rate")) -> pd.DataFrame:
    """Mean, std, count and 95% Student-t CI half-width (``ci``) of ``value`` over seeds, for
    completed runs (``ci`` is 0 with one seed: nothing to draw)."""
    done = runs[(runs["status"] == "completed") & runs[value].notna()]
    if done.empty:
        return pd.DataFrame(columns=[*by, "mean", "std", "n", "ci"])
    rows = []
    for key, group in done.groupby(list(by), dropna=False, sort=True):
        est = mean_ci(group[value])
        rows.append({**dict(zip(by, key if isinstance(key, tuple) else (key,))), "mean": est.mean,
                     "std": 0.0 if est.n < 2 else est.std, "n": est.n,
                     "ci": 0.0 if est.n < 2 else est.half_width})
    return pd.DataFrame(rows).sort_values(list(by))


def _by_seed(runs: pd.DataFrame, value: str) -> pd.Series:
    """``value`` per seed (runs that share a seed averaged), for pairing with a baseline."""
    if "seed" not in runs.columns or runs.empty:
        return pd.Series(dtype=float)
    return runs.groupby("seed")[value].mean()


def _paired_columns(mine: pd.DataFrame, baseline: pd.DataFrame, value: str) -> dict:
    """The setting against the loss-free run of the same seed: the mean paired difference, its
    95% interval, the number of pairs and the paired t-test's p."""
    a, b = _by_seed(mine, value), _by_seed(baseline, value)
    seeds = a.index.intersection(b.index)
    est = paired_difference(a[seeds].to_numpy(), b[seeds].to_numpy())
    p = paired_p(a[seeds].to_numpy(), b[seeds].to_numpy())
    return {"paired_delta": est.mean, "paired_ci": est.half_width, "paired_n": est.n, "paired_p": p,
            "paired_significant": bool(p < ALPHA)}


def settings(runs: pd.DataFrame, value: str = "accuracy") -> pd.DataFrame:
    """One row per setting: ``value``'s mean, std, 95% CI half-width and n over completed seeds,
    the loss-free baseline of the same other settings, Welch's two-sided p against it, and the
    paired comparison with the baseline run of the same seed.

    Columns: the setting keys, ``series``, ``mean``, ``std``, ``ci``, ``n``, ``runs``, ``failed``,
    ``diverged``, ``baseline_series``, ``baseline_mean``, ``delta``, ``p``, ``significant``
    (p < 0.05), ``paired_delta``, ``paired_ci``, ``paired_n`` (seeds run by both),
    ``paired_p``, ``paired_significant``. A baseline row has p = nan; so does a setting with fewer
    than two seeds (pairs) on either side.
    """
    runs = add_series(runs)
    done = runs[(runs["status"] == "completed") & runs[value].notna()]
    rows = []
    for setting, group in setting_groups(runs):
        mine = done.loc[done.index.intersection(group.index)]
        est = mean_ci(mine[value])
        row = {**setting, "series": group["series"].iloc[0], "mean": est.mean,
               "std": est.std, "ci": est.half_width, "n": est.n, "runs": len(group),
               "failed": int((group["status"] == "failed").sum()),
               "diverged": int((group["status"] == "diverged").sum())}
        match = loss_free_runs(runs, setting, value)
        is_baseline = setting.get("loss_model") == "none"
        row["baseline_series"] = match["series"].iloc[0] if match["series"].nunique() == 1 else ""
        row["baseline_mean"] = float(match[value].mean()) if len(match) else math.nan
        row["delta"] = row["mean"] - row["baseline_mean"]
        row["p"] = math.nan if is_baseline else welch_p(mine[value], match[value])
        row["significant"] = bool(row["p"] < ALPHA)
        row.update(_paired_columns(mine if not is_baseline else mine[:0], match, value))
        rows.append(row)
    return pd.DataFrame(rows)


def reached_target(runs: pd.DataFrame, metrics: pd.DataFrame, target: float) -> dict[str, dict]:
    """Run directory -> ``stats.time_to_target``'s record for each run with metrics rows, with
    ``restarts``: how many restarts its time to the target includes (``restarts_by``)."""
    final = runs.set_index("run_dir")["failures"] if {"run_dir", "failures"} <= set(runs.columns) else {}
    reached = {}
    for run_dir, rows in metrics.groupby("run_dir") if "run_dir" in metrics.columns else ():
        split = rows["eval_split"].iloc[0] if "eval_split" in rows.columns else None
        hit = time_to_target(rows.to_dict("records"), target, split if isinstance(split, str) else None)
        restarts = restarts_by(rows, hit["step"], final.get(run_dir, math.nan)) if hit["step"] is not None else 0
        reached[run_dir] = {**hit, "restarts": restarts}
    return reached


def restarts_by(rows: pd.DataFrame, step: int, final: float = math.nan) -> int:
    """Collectives the transport had given up on (each charged as a restart) by evaluation ``step``: the
    count of the run's first train row at or after it (never fewer than the evaluation's clock holds,
    so a restart is never missed), else the run's final count ``final`` (none when unknown: a run from
    before restarts were charged)."""
    if "failures" in rows.columns:
        logged = rows[(rows["split"] == "train") & (rows["step"] >= step)].dropna(subset=["failures"])
        if len(logged):
            return int(logged.sort_values("step")["failures"].iloc[0])
    final = pd.to_numeric(final, errors="coerce")
    return int(final) if pd.notna(final) else 0
