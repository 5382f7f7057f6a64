"""Reports: plots and a markdown table from a results folder (the run directories of sweeps).

The table is rebuilt from the run directories on disk (``lossysim.results.table.collect``), so
shards that wrote to one folder are reported together. The plotting functions take an
optional Matplotlib ``Axes`` (or ``Figure``) so ``notebooks/analysis.ipynb`` draws the same
plots inline; without one they draw on a pyplot-free ``Figure`` rendered by Agg, which leaves
the global backend (a notebook's inline one) alone.

Statistics treat seeds as samples: a setting (every varying config value but the seed) gets a
95% Student-t interval and Welch's t-test against the loss-free baseline, and, since runs with the
same seed share data order and initialisation, the paired difference from the loss-free run of
each seed with its interval and paired t-test (``settings``). Settings are named by
``lossysim.results.labels``: only what differs among the settings a panel or table compares.
report.md is a list of sections (``SECTIONS``), each a function of ``ReportInputs``.
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..io import atomic_write_text, check_writable, output_errors, read_jsonl
from ..loss.spec import FAMILIES
from .labels import (DIRECTIONS, LOSS_MODEL, LOSS_RATE, NO_LOSS, NOT_APPLICABLE, Comparison, comparisons, describe,
                     values, varying)
from .stats import (ALPHA, CONFIDENCE, mean_ci, paired_difference, paired_p, time_to_target,
                    welch_p)
from .settings import (CONFIG_KEYS, add_series, loss_free_runs, p_cell, same, series_reference, setting_columns,
                       setting_groups, setting_keys, to_markdown)
from . import perplexity
from .collectives import collectives_table
from .table import collect, write_summary_csv

# What sets a loss-free run's simulated time (its accuracy does not depend on them).
TIME_KEYS = ("algorithm", "ranks_per_node", "link_intra", "link_inter", "compute", "tp_size", "dp_size", "pp_size",
             "pp_schedule", "microbatches")
# The time-to-accuracy target, as a fraction of the loss-free baseline's final accuracy.
TIME_TARGET_FRACTION = 0.9


# -- loading -------------------------------------------------------------------------------------------
def load_runs(results: Union[str, Path], problems: Optional[dict[str, str]] = None) -> pd.DataFrame:
    """One row per finished run under ``results`` (summary.csv's table, rebuilt from disk); ``problems``
    gets run directory -> why, for each run left out (``table.collect``)."""
    results = Path(results)
    runs = collect(results, problems)
    if runs.empty and (results / "summary.csv").is_file():
        runs = pd.read_csv(results / "summary.csv")
    if runs.empty:
        raise ValueError(f"no finished runs (*/summary.json) under {results}")
    return runs


def load_metrics(results: Union[str, Path], runs: pd.DataFrame,
                 problems: Optional[dict[str, str]] = None) -> pd.DataFrame:
    """Every run's metrics.jsonl rows, with the run's loss settings and seed attached; ``problems``
    gets run directory -> why, for each finished run whose metrics are missing or unreadable."""
    frames = []
    problems = {} if problems is None else problems
    attach = [c for c in ("run_dir", "status", "loss_model", "loss_rate", "mean_burst", "seed", "eval_split")
              if c in runs.columns] + [c for c in runs.columns if c in CONFIG_KEYS and c != "seed"]
    for _, run in runs.iterrows():
        path = Path(results) / str(run["run_dir"]) / "metrics.jsonl"
        finished = run.get("status") in ("completed", "diverged")   # a failed run may end before any step
        if not path.is_file():
            if finished:
                problems[str(run["run_dir"])] = ("no metrics.jsonl: its curves and time to target are unknown "
                                                 "(its final numbers come from summary.json)")
            continue
        try:
            rows = pd.DataFrame(read_jsonl(path))
        except (OSError, ValueError) as err:
            problems[str(run["run_dir"])] = (f"metrics.jsonl unreadable ({_one_line(err)}): its curves and time "
                                             "to target are unknown")
            continue
        if rows.empty:
            continue
        for column in attach:
            rows[column] = run[column]
        frames.append(rows)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["step", "split", *attach])


def _one_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def dataset_title(runs: pd.DataFrame) -> str:
    names = sorted({str(n) for n in runs.get("dataset_name", pd.Series(dtype=str)).dropna()})
    return ", ".join(names) if names else "unknown dataset"


def split_name(runs: pd.DataFrame) -> str:
    splits = sorted({str(s) for s in runs.get("eval_split", pd.Series(dtype=str)).dropna()})
    return "/".join(splits) if splits else "eval"


# -- series: which runs make one line ------------------------------------------------------------------




def _reference_note(runs: pd.DataFrame) -> str:
    """The values series labels leave out, for a caption: "ring, drop, 2 nodes x 1 rank"."""
    dims, ref = series_reference(runs)
    return ", ".join(ref[d.name] for d in dims if d is not LOSS_MODEL)




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


# -- settings and their statistics -------------------------------------------------------------------




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


# -- axes ---------------------------------------------------------------------------------------------
def _new_axes(ax: Optional[Axes], figsize=(10, 4.5)) -> Axes:
    if ax is not None:
        return ax
    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    return fig.add_subplot()


def _rate_axis(ax: Axes, rates, axis: str = "x") -> None:
    """Percent scale that is logarithmic above the smallest rate and linear down to 0."""
    positive = sorted({float(r) for r in rates if r > 0 and math.isfinite(r)})
    pct = [100 * r for r in positive]
    scale = getattr(ax, f"set_{axis}scale")
    if pct:
        scale("symlog", linthresh=pct[0], linscale=0.5)
    ticks = ([0.0] if any(r == 0 for r in rates) else []) + pct
    if ticks:
        getattr(ax, f"set_{axis}ticks")(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
    if axis == "y":
        ax.set_ylim(bottom=0.0)


def _legend_beside(ax: Axes, **kwargs) -> None:
    """The legend right of the axes, where it cannot cover a curve (constrained layout makes room)."""
    ax.legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=8, frameon=False, **kwargs)


# Loss-free baselines are drawn in black and greys, settings with loss in colours.
BASELINE_GREYS = ["black", "dimgray", "darkgray", "silver"]


def _colors(n: int):
    from matplotlib import colormaps
    cmap = colormaps["tab10"]
    return [cmap(i % 10) for i in range(n)]


def _draw_baselines(ax: Axes, runs: pd.DataFrame, value: str) -> None:
    runs = runs if "series" in runs.columns else add_series(runs)
    base = aggregate(runs[runs["loss_model"] == "none"], value, by=("series",))
    for (_, row), grey in zip(base.iterrows(), BASELINE_GREYS * len(base)):
        label = f"{row['series']} (n={row['n']})"
        ax.axhline(row["mean"], color=grey, linestyle="--", linewidth=1, label=label)
        ax.errorbar([0.0], [row["mean"]], yerr=[row["ci"]], color=grey, marker="s", capsize=3)
        if row["ci"] > 0:
            ax.axhspan(row["mean"] - row["ci"], row["mean"] + row["ci"], color=grey, alpha=0.08)


def _plot_vs_rate(runs: pd.DataFrame, value: str, ax: Optional[Axes], ylabel: str, title: str,
                  percent: bool) -> Axes:
    ax = _new_axes(ax)
    runs = add_series(runs)
    scale = 100.0 if percent else 1.0
    table = settings(runs, value)
    stats = table[(table["loss_model"] != "none") & (table["n"] > 0)].sort_values(["series", "loss_rate"])
    for color, (series, group) in zip(_colors(stats["series"].nunique()), stats.groupby("series", sort=True)):
        x = 100 * group["loss_rate"].to_numpy()
        mean, ci = scale * group["mean"].to_numpy(), scale * group["ci"].fillna(0.0).to_numpy()
        ax.errorbar(x, mean, yerr=ci, marker="o", capsize=3, color=color,
                    label=f"{series} (n={int(group['n'].max())} seeds)")
        ax.fill_between(x, mean - ci, mean + ci, color=color, alpha=0.12)
        # Settings that differ from the loss-free baseline (Welch, p < 0.05): a ring and a star.
        hit = group["significant"].to_numpy()
        if hit.any():
            ax.scatter(x[hit], mean[hit], s=120, facecolors="none", edgecolors=color, linewidths=1.5)
            for xi, yi in zip(x[hit], mean[hit]):
                ax.annotate("*", (xi, yi), textcoords="offset points", xytext=(6, 4), color=color)
    scaled = runs.assign(**{value: scale * runs[value]})
    _draw_baselines(ax, scaled, value)
    _rate_axis(ax, runs["loss_rate"].dropna().tolist())
    ax.set_xlabel("average packet loss rate (%)")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title}\n{_caption(runs)}", fontsize=10)
    ax.grid(True, alpha=0.3)
    _legend_beside(ax)
    return ax


def _caption(runs: pd.DataFrame) -> str:
    """The dataset, and the values that series labels leave out."""
    note = _reference_note(runs)
    return dataset_title(runs) + (f"; unless named: {note}" if note else "")


def plot_accuracy_vs_loss(runs: pd.DataFrame, ax: Optional[Axes] = None) -> Axes:
    """Final accuracy against average loss rate: a line per loss model, mean and 95% CI over seeds;
    ringed, starred points differ from the loss-free baseline (Welch's t-test, p < 0.05)."""
    return _plot_vs_rate(runs, "accuracy", ax, f"final {split_name(runs)} accuracy (%)",
                         "Accuracy against average packet loss rate", percent=True)


def plot_disagreement(runs: pd.DataFrame, ax: Optional[Axes] = None) -> Axes:
    """How often ranks' predictions differ (they saw different lost packets) against loss rate."""
    return _plot_vs_rate(runs, "disagreement", ax, "eval predictions differing from rank 0 (%)",
                         "Rank disagreement against average packet loss rate", percent=True)


def plot_observed_vs_configured(runs: pd.DataFrame, ax: Optional[Axes] = None) -> Axes:
    """Each run's observed training loss rate against its configured one (on y = x if all is well)."""
    ax = _new_axes(ax)
    runs = add_series(runs)
    runs = runs[runs["observed_loss_rate"].notna() & runs["loss_rate"].notna()]
    for color, (series, group) in zip(_colors(runs["series"].nunique()), runs.groupby("series", sort=True)):
        ax.scatter(100 * group["loss_rate"], 100 * group["observed_loss_rate"], color=color, label=series,
                   alpha=0.8, edgecolors="none")
    rates = runs["loss_rate"].tolist() + runs["observed_loss_rate"].tolist()
    top = 100 * max(rates, default=0.01) * 1.2 or 1.0
    # Many points: on symlog axes a two-point segment would not follow y = x.
    diagonal = np.concatenate([[0.0], np.geomspace(top / 1e4, top, 200)])
    ax.plot(diagonal, diagonal, color="gray", linestyle=":", label="y = x")
    _rate_axis(ax, runs["loss_rate"].tolist())
    _rate_axis(ax, runs["loss_rate"].tolist(), axis="y")
    ax.set_xlabel("configured average loss rate (%)")
    ax.set_ylabel("observed loss rate, training traffic (%)")
    ax.set_title(f"Observed against configured packet loss\n{_caption(runs)}", fontsize=10)
    ax.grid(True, alpha=0.3)
    _legend_beside(ax)
    return ax


def _panel_grid(fig: Figure, n: int, columns: int, **shared) -> list[Axes]:
    """``n`` axes, ``columns`` to a row; the unused cells of the last row are removed."""
    rows = -(-n // columns)
    axes = list(fig.subplots(rows, min(n, columns), squeeze=False, **shared).flat)
    for ax in axes[n:]:
        ax.remove()
    return axes[:n]


def plot_accuracy_over_steps(metrics: pd.DataFrame, runs: pd.DataFrame, fig: Optional[Figure] = None) -> Figure:
    """Eval accuracy during training: a panel per series (loss model and whatever else differs), a
    line per rate (mean over seeds), dashed: the loss-free baseline of the panel's settings."""
    runs = add_series(runs)
    table = settings(runs)
    panels = sorted(table.loc[table["loss_model"] != "none", "series"].unique()) or [NO_LOSS]
    if fig is None:
        fig = Figure(figsize=(13, 1 + 3.5 * -(-len(panels) // 3)), layout="constrained")
        FigureCanvasAgg(fig)
    series_of = dict(zip(runs["run_dir"], runs["series"]))
    split = runs["eval_split"].dropna().iloc[0] if runs["eval_split"].notna().any() else None
    evals = metrics[(metrics["split"] == split) & metrics["accuracy"].notna()].copy() if split else metrics[:0]
    evals = evals[evals["status"] == "completed"]
    evals["series"] = evals["run_dir"].map(series_of)
    axes = _panel_grid(fig, len(panels), 3, sharey=True)
    rates = sorted(r for r in evals["loss_rate"].unique() if r > 0)
    from matplotlib import colormaps
    cmap = colormaps["viridis"]
    for ax, panel in zip(axes, panels):
        for base in table.loc[table["series"] == panel, "baseline_series"].unique():
            rows = evals[evals["series"] == base] if base else evals[evals["loss_model"] == "none"]
            curve = rows.groupby("step")["accuracy"].mean()
            ax.plot(curve.index, 100 * curve.to_numpy(), color="black", linestyle="--", label=base or NO_LOSS)
        mine = evals[(evals["series"] == panel) & (evals["loss_model"] != "none")]
        for rate, group in mine.groupby("loss_rate"):
            curve = group.groupby("step")["accuracy"].mean()
            color = cmap(rates.index(rate) / max(len(rates) - 1, 1)) if rate in rates else "gray"
            ax.plot(curve.index, 100 * curve.to_numpy(), marker=".", color=color, label=f"{100 * rate:g}%")
        ax.set_title(panel, fontsize=9)
        ax.set_xlabel("optimizer step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")   # curves rise from the lower left to the upper right
    axes[0].set_ylabel(f"{split or 'eval'} accuracy (%)")
    fig.suptitle(f"Accuracy during training (mean over seeds)\n{_caption(runs)}", fontsize=10)
    return fig


def plot_fwd_vs_bwd(runs: pd.DataFrame, ax: Optional[Axes] = None) -> Optional[Axes]:
    """Accuracy when only activations (fwd), only gradients (bwd) or both are lossy; None if not varied."""
    lossy = runs[runs["loss_model"] != "none"]
    if "lossy" not in runs.columns or lossy["lossy"].nunique() < 2:
        return None
    ax = _new_axes(ax)
    runs = add_series(runs)
    runs = runs.assign(family=values(runs, LOSS_MODEL))
    stats = aggregate(runs[runs["loss_model"] != "none"], "accuracy", by=("lossy", "family", "loss_rate"))
    styles = ["-", "--", ":", "-."]
    families = sorted(stats["family"].unique())
    directions = sorted(stats["lossy"].unique())
    for (direction, fam), group in stats.groupby(["lossy", "family"]):
        color = _colors(len(directions))[directions.index(direction)]
        ax.errorbar(100 * group["loss_rate"], 100 * group["mean"], yerr=100 * group["ci"], marker="o",
                    capsize=3, color=color, linestyle=styles[families.index(fam) % len(styles)],
                    label=f"{DIRECTIONS.get(direction, direction)}, {fam}")
    _draw_baselines(ax, runs.assign(accuracy=100 * runs["accuracy"]), "accuracy")
    _rate_axis(ax, runs["loss_rate"].dropna().tolist())
    ax.set_xlabel("average packet loss rate (%)")
    ax.set_ylabel(f"final {split_name(runs)} accuracy (%)")
    ax.set_title(f"Forward (activations) against backward (gradients) loss\n{dataset_title(runs)}", fontsize=10)
    ax.grid(True, alpha=0.3)
    _legend_beside(ax)
    return ax


# -- tables -------------------------------------------------------------------------------------------
def _pm(mean: float, ci: float, n: int, scale: float = 100.0, digits: int = 1) -> str:
    """``mean ± CI half-width``; the mean alone for one seed (no interval to give)."""
    if n == 0 or not math.isfinite(mean):
        return "–"
    if n > 1 and math.isfinite(ci):
        return f"{scale * mean:.{digits}f} ± {scale * ci:.{digits}f}"
    return f"{scale * mean:.{digits}f}"




def _target_cell(group: pd.DataFrame) -> str:
    """Steps to the target accuracy: mean ± CI over the seeds that reached it, and how many did."""
    done = group[group["status"] == "completed"]
    if "steps_to_target" not in done or done.empty:
        return "–"
    steps = done["steps_to_target"].dropna()
    reached = f"{len(steps)}/{len(done)} reached"
    if steps.empty:
        return f"not reached ({reached})"
    est = mean_ci(steps)
    return f"{_pm(est.mean, est.half_width, est.n, scale=1.0, digits=0)} ({reached})"


def _delta_cell(delta: float, ci: float, n: int) -> str:
    """A difference in percentage points, signed, ``± CI`` when there is an interval."""
    if not math.isfinite(delta):
        return "–"
    return f"{100 * delta:+.1f}" + (f" ± {100 * ci:.1f}" if n > 1 and math.isfinite(ci) else "")


def _comparison_cells(st: pd.Series) -> dict:
    """A setting against its loss-free baseline, unpaired (difference of the means, Welch's p) and
    paired by seed (mean paired difference ± 95% CI, paired t-test's p)."""
    if st["loss_model"] == "none":
        return {"vs no loss (pp)": "baseline", "p (Welch)": "–", "vs no loss, paired (pp)": "baseline",
                "p (paired)": "–"}
    paired = _delta_cell(st["paired_delta"], st["paired_ci"], int(st["paired_n"]))
    if 0 < st["paired_n"] < st["n"]:
        paired += f" ({int(st['paired_n'])} pairs)"   # seeds without a loss-free run of their own
    return {"vs no loss (pp)": _delta_cell(st["delta"], math.nan, 1),
            "p (Welch)": p_cell(st["p"], st["significant"]),
            "vs no loss, paired (pp)": paired,
            "p (paired)": p_cell(st["paired_p"], st["paired_significant"])}




def summary_table(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per setting: accuracy mean ± 95% CI over seeds, its difference from the loss-free
    baseline with Welch's p and paired by seed with the paired t-test's p (``*``: p < 0.05),
    steps to the target accuracy, counts."""
    stats = settings(runs, "accuracy")
    columns = setting_columns(runs)
    rows = []
    for (setting, group), (_, st) in zip(setting_groups(runs), stats.iterrows()):
        done = group[group["status"] == "completed"]
        best = mean_ci(done["best_accuracy"]) if "best_accuracy" in done else mean_ci([])
        dis = done["disagreement"].dropna() if "disagreement" in done else pd.Series(dtype=float)
        obs = group["observed_loss_rate"].dropna() if "observed_loss_rate" in group else pd.Series(dtype=float)
        lossless = setting["loss_model"] == "none"
        row = {"loss model": FAMILIES.get(setting["loss_model"], setting["loss_model"]),
               "rate (%)": f"{100 * setting['loss_rate']:g}",
               "mean burst": "–" if lossless else f"{setting['mean_burst']:.3g}"}
        row.update({d.name: d.value(group.iloc[0]) for d in columns})
        row.update({"accuracy (%)": _pm(st["mean"], st["ci"], int(st["n"])), "n": int(st["n"]),
                    **_comparison_cells(st)})
        row.update({
            "best accuracy (%)": _pm(best.mean, best.half_width, best.n),
            "steps to target": _target_cell(group),
            "observed loss (%)": f"{100 * obs.mean():.3g}" if len(obs) else "–",
            "disagreement (%)": f"{100 * dis.mean():.2f}" if len(dis) else "–",
            **_drift_cell(runs, done),
            "runs": len(group),
            "failed": int(st["failed"]),
            "diverged": int(st["diverged"]),
        })
        rows.append(row)
    return pd.DataFrame(rows)


def _pivot_cell(st: pd.Series) -> str:
    """Mean ± CI; ``*``: differs from the loss-free baseline by Welch's test, ``†``: by the paired one."""
    marks = (" *" if st["significant"] else "") + (" †" if st.get("paired_significant", False) else "")
    return _pm(st["mean"], st["ci"], int(st["n"])) + marks


def accuracy_pivot(runs: pd.DataFrame) -> pd.DataFrame:
    """Accuracy (mean ± 95% CI over seeds; ``*``: differs from the loss-free baseline, Welch's
    test; ``†``: paired t-test) with loss rates down and series (loss model, burstiness and
    whatever else differs) across; the first row is each column's own loss-free baseline."""
    stats = settings(runs, "accuracy")
    stats = stats[stats["n"] > 0]
    if stats.empty:
        return pd.DataFrame()
    lossy = stats[stats["loss_model"] != "none"]
    columns = sorted(lossy["series"].unique()) or [NO_LOSS]
    base = stats[stats["loss_model"] == "none"]
    rows = []
    if not base.empty:
        rows.append({"loss rate (%)": "0 (no loss)", **{c: _pivot_baseline(c, lossy, base) for c in columns}})
    for rate in sorted(lossy["loss_rate"].unique()):
        row = {"loss rate (%)": f"{100 * rate:g}"}
        for column in columns:
            hit = lossy[(lossy["series"] == column) & (lossy["loss_rate"] == rate)]
            row[column] = _pivot_cell(hit.iloc[0]) if len(hit) == 1 else ("–" if hit.empty else "see table")
        rows.append(row)
    return pd.DataFrame(rows)


def _pivot_baseline(column: str, lossy: pd.DataFrame, base: pd.DataFrame) -> str:
    """The loss-free baseline a column's settings are compared with, when they share one."""
    names = lossy.loc[lossy["series"] == column, "baseline_series"].unique() if len(lossy) else [""]
    hit = base[base["series"] == names[0]] if len(names) == 1 and names[0] else base[:0]
    if len(hit) != 1 and len(base) == 1:
        hit = base
    if len(hit) != 1:
        return "see table"
    b = hit.iloc[0]
    return _pm(b["mean"], b["ci"], int(b["n"]))




# -- accuracy against simulated time ---------------------------------------------------------------------
def time_target(runs: pd.DataFrame, fraction: float = TIME_TARGET_FRACTION) -> float:
    """The accuracy the time table asks for: ``fraction`` of the loss-free baseline's mean final accuracy."""
    base = runs[(runs["loss_model"] == "none") & (runs["status"] == "completed")]["accuracy"].dropna()
    return fraction * float(base.mean()) if len(base) else math.nan


def _baseline_runs(runs: pd.DataFrame, setting: dict) -> pd.DataFrame:
    """The loss-free runs timed like this setting (same links, compute and topology; the same
    algorithm when one was run, else any)."""
    base = runs[(runs["loss_model"] == "none") & (runs["status"] == "completed")]
    for key in TIME_KEYS:
        if key in base.columns and key in setting and key != "algorithm":
            base = base[same(base[key], setting[key])]
    if "algorithm" in base.columns and "algorithm" in setting:
        like = base[same(base["algorithm"], setting["algorithm"])]
        base = like if len(like) else base
    return base


def time_to_accuracy_table(runs: pd.DataFrame, metrics: pd.DataFrame,
                           fraction: float = TIME_TARGET_FRACTION) -> tuple[pd.DataFrame, float]:
    """Per setting: simulated seconds and steps to ``fraction`` x the baseline's final accuracy
    (mean ± 95% CI over the seeds that reached it, and how many did), next to the baseline's."""
    runs = add_series(runs)
    target = time_target(runs, fraction)
    reached = {}
    measured = set(metrics["run_dir"]) if "run_dir" in metrics.columns else set()
    if math.isfinite(target) and "run_dir" in metrics.columns:
        for run_dir, rows in metrics.groupby("run_dir"):
            split = rows["eval_split"].iloc[0] if "eval_split" in rows.columns else None
            reached[run_dir] = time_to_target(rows.to_dict("records"), target,
                                              split if isinstance(split, str) else None)
    columns = setting_columns(runs)
    accuracy = settings(runs, "accuracy")
    rows = []
    for (setting, group), (_, st) in zip(setting_groups(runs), accuracy.iterrows()):
        done = group[group["status"] == "completed"]
        # A run without metrics rows may have reached the target or not: unknown, never "never".
        known = [d for d in done["run_dir"] if d in measured]
        hits = [reached.get(d, {}) for d in known]
        times = [h["sim_time_s"] for h in hits if h.get("sim_time_s") is not None]
        ideal = [h["sim_time_s_ideal_nic"] for h in hits if h.get("sim_time_s_ideal_nic") is not None]
        steps = [h["step"] for h in hits if h.get("step") is not None]
        base_hits = [reached.get(d, {}) for d in _baseline_runs(runs, setting)["run_dir"]]
        base_times = [h["sim_time_s"] for h in base_hits if h.get("sim_time_s") is not None]
        est, base = mean_ci(times), mean_ci(base_times)
        first = group.iloc[0]
        rows.append({
            "loss": _loss_cell(setting, first),
            **{d.name: d.value(first) for d in columns},
            "time to target (ms)": (_pm(est.mean, est.half_width, est.n, scale=1e3, digits=3) if times
                                    else "never" if known else "unknown" if len(done) else "-"),
            "ideal nic (ms)": _pm(*_mean_ci_tuple(ideal), scale=1e3, digits=3) if ideal else "-",
            "reached": f"{len(times)}/{len(known)}" + (f", {len(done) - len(known)} unknown"
                                                        if len(known) < len(done) else ""),
            "steps": f"{np.mean(steps):.0f}" if steps else "-",
            "x baseline": f"{est.mean / base.mean:.2f}" if times and base_times else "-",
            # A pipeline's traffic is summed over stages and boundaries, not all on its step's path: its own
            # columns say what the sends cost the step.
            "comm per step (ms)": NOT_APPLICABLE if _staged(first) else _ms_cell(done, "comm_s_per_step"),
            **({"DP per step (ms)": _ms_cell(done, "dp_s_per_step")} if "dp_s_per_step" in done.columns else {}),
            **_pipeline_cells(runs, done),
            "final accuracy (%)": _pm(*_mean_ci_tuple(done["accuracy"])),
            **_drift_cell(runs, done),
            "vs no loss, paired (pp)": _comparison_cells(st)["vs no loss, paired (pp)"],
            "p (paired)": _comparison_cells(st)["p (paired)"],
        })
    return pd.DataFrame(rows), target


def _loss_cell(setting: dict, first: pd.Series) -> str:
    """"no loss", or the rate and the loss model: "5% Bernoulli"."""
    return NO_LOSS if setting["loss_model"] == "none" else f"{LOSS_RATE.value(first)} {LOSS_MODEL.value(first)}"


def pipeline_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per setting, side by side: final accuracy (mean ± 95% CI over seeds) and its paired difference from
    the loss-free run of the same seed, the simulated time per step and its ratio to the loss-free runs
    timed like it, the stages' idle share (bubble), what the boundary sends add to a step, and the
    observed loss on the boundaries' lossy traffic; "–" where a run has no stages."""
    runs = add_series(runs)
    runs = runs.assign(step_s=runs["sim_time_s"] / pd.to_numeric(runs["steps_done"], errors="coerce"))
    columns = setting_columns(runs)
    rows = []
    for (setting, group), (_, st) in zip(setting_groups(runs), settings(runs, "accuracy").iterrows()):
        done = group[group["status"] == "completed"]
        base = runs.loc[_baseline_runs(runs, setting).index, "step_s"].dropna()
        step = done["step_s"].dropna()
        staged = _staged(group.iloc[0])
        rows.append({
            "loss": _loss_cell(setting, group.iloc[0]),
            **{d.name: d.value(group.iloc[0]) for d in columns},
            "accuracy (%)": _pm(st["mean"], st["ci"], int(st["n"])),
            "vs no loss, paired (pp)": _comparison_cells(st)["vs no loss, paired (pp)"],
            "p (paired)": _comparison_cells(st)["p (paired)"],
            "time per step (ms)": _ms_cell(done, "step_s"),
            "x no loss": f"{step.mean() / base.mean():.3f}" if len(step) and len(base) else NOT_APPLICABLE,
            "bubble (%)": _ms_cell(done, "pp_bubble", 100) if staged else NOT_APPLICABLE,
            "PP per step (ms)": _ms_cell(done, "pp_s_per_step") if staged else NOT_APPLICABLE,
            "observed PP loss (%)": _ms_cell(done, "observed_loss_rate_pp", 100) if staged else NOT_APPLICABLE,
            "n": int(st["n"]),
        })
    return pd.DataFrame(rows)


def _staged(row) -> bool:
    """Whether a run (or a setting's first run) has pipeline stages."""
    return bool(pd.to_numeric(row.get("pp_size", 1), errors="coerce") > 1)


def _ms_cell(done: pd.DataFrame, column: str, scale: float = 1e3) -> str:
    """A per-step figure's mean over seeds (ms by default); "–" where the runs have none (a column only
    another kind of run fills)."""
    values = done[column].dropna() if column in done.columns else pd.Series(dtype=float)
    return f"{scale * values.mean():.3g}" if len(values) else NOT_APPLICABLE


def _pipeline_cells(runs: pd.DataFrame, done: pd.DataFrame) -> dict:
    """Sweeps with pipeline stages: what the boundary sends add to a step and the stages' idle share,
    mean over seeds; "–" for a run without stages; nothing for sweeps without any."""
    if not (runs.get("pp_size", pd.Series(dtype=float)).fillna(1) > 1).any():
        return {}
    return {"PP per step (ms)": _ms_cell(done, "pp_s_per_step"), "bubble (%)": _ms_cell(done, "pp_bubble", 100)}


def _drift_cell(runs: pd.DataFrame, done: pd.DataFrame) -> dict:
    """Data-parallel sweeps: the replicas' final drift (||p_r - p_0|| / ||p_0||, worst replica), mean
    over seeds; nothing for sweeps without data parallelism."""
    if "drift" not in runs.columns:
        return {}
    drift = done["drift"].dropna()
    return {"drift (%)": f"{100 * drift.mean():.3g}" if len(drift) else "–"}


def _mean_ci_tuple(values) -> tuple[float, float, int]:
    est = mean_ci(values)
    return est.mean, est.half_width, est.n


def _eval_rows(metrics: pd.DataFrame) -> pd.DataFrame:
    """Each run's evaluations on its primary split that carry a simulated time."""
    if metrics.empty or "sim_time_s" not in metrics.columns:
        return metrics[:0]
    evals = metrics[metrics["split"] == metrics.get("eval_split", metrics["split"])]
    return evals[evals["split"] != "train"].dropna(subset=["sim_time_s", "accuracy"])


def _time_unit(seconds: float) -> tuple[float, str]:
    """A unit that keeps the time axis's numbers readable: ms for a tiny model's runs, hours for a
    real one's."""
    for limit, scale, name in ((1.0, 1e3, "ms"), (120.0, 1.0, "s"), (7200.0, 1 / 60, "min")):
        if seconds < limit:
            return scale, name
    return 1 / 3600, "h"


def _plain_log_ticks(ax: Axes) -> None:
    """Plain numbers on a log axis (2, 5, 10, 20 rather than 2x10^-3); minor ticks labelled at 2 and 5."""
    from matplotlib.ticker import FuncFormatter

    def minor(x, _):
        digit = round(x / 10 ** math.floor(math.log10(x))) if x > 0 else 0
        return f"{x:g}" if digit in (2, 5) else ""
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    ax.xaxis.set_minor_formatter(FuncFormatter(minor))


def _time_curve(evals: pd.DataFrame, run_dirs) -> pd.DataFrame:
    """Mean simulated time and mean accuracy over seeds at each evaluation step, and the accuracy's
    95% CI half-width (0 with one seed)."""
    rows = evals[evals["run_dir"].isin(list(run_dirs))]
    curve = rows.groupby("step").agg(t=("sim_time_s", "mean"), acc=("accuracy", list)).reset_index()
    est = [mean_ci(a) for a in curve["acc"]]
    return curve.assign(mean=[e.mean for e in est], half=[0.0 if e.n < 2 else e.half_width for e in est])


def _draw_time_curve(ax: Axes, curve: pd.DataFrame, label: str, **style) -> None:
    ax.plot(curve["t"], 100 * curve["mean"], marker=".", label=label, **style)
    low = np.clip(100 * (curve["mean"] - curve["half"]), 0, 100)
    high = np.clip(100 * (curve["mean"] + curve["half"]), 0, 100)
    ax.fill_between(curve["t"], low, high, color=style.get("color"), alpha=0.07, linewidth=0)


def _panel_baselines(panel: Comparison, groups: list, runs: pd.DataFrame) -> dict[int, pd.DataFrame]:
    """The loss-free settings timed like the panel's settings (same topology, links and compute):
    their index in ``groups`` and their completed runs."""
    setting_of = {d: i for i, (_, group) in enumerate(groups) for d in group["run_dir"]}
    found: dict[int, pd.DataFrame] = {}
    for i in panel.settings.index:
        for run_dir in _baseline_runs(runs, groups[i][0])["run_dir"]:
            found.setdefault(setting_of[run_dir], groups[setting_of[run_dir]][1])
    return {i: group[group["status"] == "completed"] for i, group in sorted(found.items())}


def _rate_styles(lossy: pd.DataFrame) -> dict[str, str]:
    """One line style per loss rate, the same in every panel."""
    rates = sorted(lossy["loss_rate"].unique()) if len(lossy) else []
    return {LOSS_RATE.value({"loss_rate": r}): ("-", "--", ":", "-.")[i % 4] for i, r in enumerate(rates)}


def _seeds_note(n: int, usual: int) -> str:
    """Say how many seeds a line averages only when it is not the usual number (runs failed)."""
    return "" if n == usual else f" (n={n})"


def _usual_seeds(runs: pd.DataFrame) -> int:
    done = runs[runs["status"] == "completed"]
    counts = done.groupby(setting_keys(done), dropna=False).size() if len(done) else pd.Series(dtype=int)
    return int(counts.mode().max()) if len(counts) else 0


def _draw_time_panel(ax: Axes, panel: Comparison, groups: list, runs: pd.DataFrame, evals: pd.DataFrame,
                     styles: dict[str, str], seeds: int) -> None:
    """One question: its settings coloured by their answer, dashed or dotted by loss rate, and the
    loss-free baselines they are timed against in black and greys."""
    shown = panel.settings
    dims = varying(shown)
    asked = [panel.question.name] if panel.question else []
    answers = values(shown, panel.question) if panel.question else pd.Series("", index=shown.index)
    # The reference answer first, so it is drawn in the first colour in every panel.
    order = sorted(dict.fromkeys(answers), key=lambda a: a != panel.reference)
    colors = dict(zip(order, _colors(len(order))))
    baselines = _panel_baselines(panel, groups, runs)
    base_rows = pd.DataFrame([groups[i][1].iloc[0] for i in baselines]) if baselines else pd.DataFrame()
    base_dims = varying(base_rows) if len(base_rows) > 1 else []
    for (i, group), grey in zip(baselines.items(), BASELINE_GREYS * len(baselines)):
        label = describe(groups[i][1].iloc[0], base_dims) + _seeds_note(len(group), seeds)
        _draw_time_curve(ax, _time_curve(evals, group["run_dir"]), label, color=grey, linewidth=2)
    ordered = sorted(shown.index, key=lambda i: (order.index(answers[i]), shown.loc[i, "loss_rate"]))
    for i in ordered:
        group = groups[i][1]
        done = group[group["status"] == "completed"]
        label = describe(group.iloc[0], dims, always=asked) + _seeds_note(len(done), seeds)
        rate = LOSS_RATE.value(shown.loc[i])
        _draw_time_curve(ax, _time_curve(evals, done["run_dir"]), label, color=colors[answers[i]],
                         linestyle=styles.get(rate, "-"))
    ax.set_title(panel.title + (f"\n{', '.join(panel.held)}" if panel.held else ""), fontsize=9)
    ax.set_xscale("log")
    _plain_log_ticks(ax)
    ax.grid(True, alpha=0.3)
    _legend_beside(ax)


def plot_accuracy_vs_time(metrics: pd.DataFrame, runs: pd.DataFrame, fig: Optional[Figure] = None) -> Optional[Figure]:
    """Eval accuracy against simulated time, a panel per question the sweep asks (which algorithm,
    transport, topology, burstiness: ``labels.comparisons``), each with the loss-free baselines
    timed like its settings: a line per setting (mean over seeds at each evaluation, band: 95% CI
    of accuracy). None when the runs carry no simulated clock."""
    evals = _eval_rows(metrics)
    if evals.empty:
        return None
    scale, unit = _time_unit(float(evals["sim_time_s"].max()))
    evals = evals.assign(sim_time_s=scale * evals["sim_time_s"])
    runs = add_series(runs)
    groups = setting_groups(runs)
    frame = pd.DataFrame([group.iloc[0] for _, group in groups]).reset_index(drop=True)   # row i: groups[i]
    lossy = frame[frame["loss_model"] != "none"]
    panels = comparisons(lossy) if len(lossy) else [Comparison(None, lossy, [])]
    if fig is None:
        fig = Figure(figsize=(15, 1.2 + 4 * -(-len(panels) // 2)), layout="constrained")
        FigureCanvasAgg(fig)
    # Accuracy on one scale everywhere; time per panel (retransmission can stretch one panel 100x).
    axes = _panel_grid(fig, len(panels), 2, sharey=True)
    seeds, styles = _usual_seeds(runs), _rate_styles(lossy)
    for ax, panel in zip(axes, panels):
        _draw_time_panel(ax, panel, groups, runs, evals, styles, seeds)
    for ax in axes:
        ax.set_xlabel(f"simulated time ({unit}, log scale)")
        ax.set_ylabel(f"{split_name(runs)} accuracy (%)")
    fig.suptitle("Accuracy against simulated time (modelled compute + simulated communication): mean over "
                 f"{seeds} seeds, band: 95% CI\n{dataset_title(runs)}", fontsize=10)
    return fig


# -- the report -----------------------------------------------------------------------------------------
PLOTS = {
    "accuracy_vs_time.png": "Accuracy against simulated time, a panel per question the sweep asks, a line per "
                            "setting (mean over seeds, band: 95% CI; black and grey: no loss)",
    "accuracy_vs_loss.png": "Final accuracy against average loss rate (mean and 95% CI over seeds; dashed: no "
                            "loss; ringed *: differs from no loss, Welch p < 0.05)",
    "observed_vs_configured.png": "Observed against configured loss rate, one point per run (dotted: y = x)",
    "accuracy_over_steps.png": "Eval accuracy during training, a panel per series, a line per loss rate",
    "disagreement_vs_loss.png": "How often ranks disagree on a prediction, against loss rate",
    "fwd_vs_bwd.png": "Loss on activations only (fwd), gradients only (bwd) or both",
}
TIME_PLOT_NOTE = (
    "A panel per question the sweep asks (which algorithm, transport, topology, how bursty the loss): the "
    "settings that answer it, everything else held at its most common value (under the panel's title), at the "
    "loss rates where two or more answers were run. Colour: the answer, the usual one in blue; line style: the "
    "loss rate; black and grey: the loss-free runs timed like the panel's settings.")
STATISTICS_NOTE = (
    f"Intervals are {100 * CONFIDENCE:g}% Student-t confidence intervals of the mean over seeds (none with one "
    "seed). Each setting is compared with the loss-free baseline that has the same other settings in two ways. "
    "Unpaired: `vs no loss (pp)` is the difference of the two means and `p (Welch)` Welch's two-sided t-test, "
    "which treat the two groups of seeds as unrelated, so the spread between seeds (different data order and "
    "initialisation) stays in and hides differences smaller than it. Paired: runs with the same seed share data "
    "order and initialisation, so `vs no loss, paired (pp)` is the mean over seeds of (setting - loss-free run of "
    f"the same seed) ± its {100 * CONFIDENCE:g}% Student-t interval and `p (paired)` the paired t-test on those "
    "differences; the shared spread cancels, and what is left is the loss's own effect and the noise it adds. "
    f"`*` after a p-value marks p < {ALPHA:g}; in the accuracy pivot `*` marks Welch's p < {ALPHA:g} and `†` the "
    "paired test's; neither is corrected for multiple comparisons.")


@dataclass
class ReportInputs:
    """What every report section reads."""
    results: Path
    runs: pd.DataFrame
    metrics: pd.DataFrame
    plots: list[Path] = field(default_factory=list)
    problems: dict[str, str] = field(default_factory=dict)   # run directory -> why it is left out or partial
    out: Optional[Path] = None                                # where report.md goes (default: results)
    collectives: Optional[pd.DataFrame] = None                # collectives_table's (None: read when needed)

    def __post_init__(self):
        self.out = self.out or self.results


def _save(figure_or_axes, path: Path) -> None:
    fig = figure_or_axes if isinstance(figure_or_axes, Figure) else figure_or_axes.figure
    fig.savefig(path, dpi=120)


def section_overview(inputs: ReportInputs) -> str:
    runs = inputs.runs
    counts = runs["status"].value_counts()
    unread = sum(1 for run_dir in inputs.problems if run_dir not in set(runs["run_dir"].astype(str)))
    return (f"Dataset: **{dataset_title(runs)}**. {len(runs)} runs: {int(counts.get('completed', 0))} completed, "
            f"{int(counts.get('diverged', 0))} diverged, {int(counts.get('failed', 0))} failed"
            + (f"; {unread} more could not be read (listed below)" if unread else "") + ". Accuracy is the "
            f"final `{split_name(runs)}` accuracy of completed runs. {STATISTICS_NOTE}\n")


def section_time_to_accuracy(inputs: ReportInputs) -> str:
    if "sim_time_s" not in inputs.metrics.columns:  # results written before the simulated clock
        return ""
    table, target = time_to_accuracy_table(inputs.runs, inputs.metrics)
    if table.empty or not math.isfinite(target):
        return ""
    plot = next((p for p in inputs.plots if p.name == "accuracy_vs_time.png"), None)
    return ("## Accuracy against simulated time\n\n"
            + (f"![accuracy against simulated time]({plot.name})\n\n{TIME_PLOT_NOTE}\n\n" if plot else "")
            + f"### Time to reach {100 * target:.1f}% accuracy\n\n"
            + f"The target is {100 * TIME_TARGET_FRACTION:g}% of the loss-free baseline's final "
            f"`{split_name(inputs.runs)}` accuracy. Time is the simulated cluster's (modelled compute plus "
            "simulated communication, retransmissions included; see docs/time_model.md), not this machine's: "
            "mean ± 95% CI over the seeds that reached the target. Lost packets are repaired as the run's NIC "
            "preset does (`nic`: its timers, go-back-N or selective repeat, retries, restarts after a failure); "
            "`ideal nic` is the same runs' time had every loss cost one resend and one round trip, so the gap "
            "between the two columns is what the preset's timers and failures cost. `x baseline` divides by the time of the "
            "loss-free run timed like the setting (same topology, links and compute). The last two columns compare "
            "final accuracy with the loss-free run of the same seed (see the statistics note above).\n\n"
            + to_markdown(table))


def section_accuracy(inputs: ReportInputs) -> str:
    note = _reference_note(inputs.runs)
    return ("## Accuracy against average loss rate and burstiness\n\n"
            "Mean ± 95% CI over seeds; * differs from the column's loss-free baseline (first row) by Welch's "
            "test, † by the paired one (p < 0.05)."
            + (f" A column names only what differs from the usual setting: {note}." if note else "")
            + "\n\n" + to_markdown(accuracy_pivot(inputs.runs)))


def section_settings(inputs: ReportInputs) -> str:
    runs = inputs.runs
    targets = sorted({float(t) for t in runs.get("target_accuracy", pd.Series(dtype=float)).dropna()})
    target = ("steps to target: first evaluation step reaching "
              + "/".join(f"{100 * t:g}%" for t in targets) + f" `{split_name(runs)}` accuracy, "
              "mean ± 95% CI over the seeds that reached it.\n\n") if targets else ""
    return "## Every setting\n\n" + target + to_markdown(summary_table(runs))


def section_problems(inputs: ReportInputs) -> str:
    if not inputs.problems:
        return ""
    return ("## Runs that could not be read\n\n"
            "Left out of every table and plot when their summary cannot be read or lacks what its status always "
            "records (summary.csv keeps the row it had for them, marked stale); otherwise reported without what "
            "is named.\n\n"
            + "".join(f"- `{run_dir}`: {why}\n" for run_dir, why in sorted(inputs.problems.items())))


def section_pipeline(inputs: ReportInputs) -> str:
    """Sweeps with pipeline stages only: accuracy, time per step, bubble and the boundaries' loss side by side."""
    if not (inputs.runs.get("pp_size", pd.Series(dtype=float)).fillna(1) > 1).any():
        return ""
    return ("## Pipeline parallelism\n\n"
            "Every setting, the runs with pipeline stages (`pp`) beside the others. Accuracy: mean ± 95% CI over "
            "seeds, and the paired difference from the loss-free run of the same seed. `time per step`: the "
            "simulated clock over the steps (for a pipeline, its schedule's critical path: compute, TP traffic "
            "and boundary sends, repairs included); `x no loss` divides it by the loss-free runs timed like the "
            "setting (same layout, links and compute). `bubble`: the stages' idle share of the step. `PP per "
            "step`: what the boundary sends add to a step (the schedule less the same schedule with free sends). "
            "`observed PP loss`: lost / sent packets on the boundaries' lossy traffic in training. \"–\": the "
            "setting has no stages.\n\n" + to_markdown(pipeline_table(inputs.runs)))


def section_collectives(inputs: ReportInputs) -> str:
    """Runs that recorded NCCL's choices (summary.json's ``collectives``): which algorithm each collective ran."""
    table = inputs.collectives if inputs.collectives is not None else collectives_table(inputs.results, inputs.runs)
    if table.empty:
        return ""
    return ("## Collectives: which algorithm each ran\n\n"
            "How NCCL ran each training collective, per group of runs timed alike (loss does not change the "
            "choice): `algorithm` is NCCL's algorithm and protocol (`algorithm: auto`: its tuner's pick; a named "
            "algorithm: the protocol NCCL's model gives it), `call sites` the sites with layer and bucket numbers "
            "as `*` and how many, `message` and `loss-free per call` their range over sizes (docs/time_model.md)."
            "\n\n" + to_markdown(table))


def section_perplexity(inputs: ReportInputs) -> str:
    """Causal-LM sweeps only: the perplexity table (lossysim.results.perplexity)."""
    return perplexity.section(inputs.results, inputs.out, inputs.runs) if perplexity.is_lm(inputs.runs) else ""


def section_damage_map(inputs: ReportInputs) -> str:
    return perplexity.damage_map_section(inputs.results, inputs.out)


def section_plots(inputs: ReportInputs) -> str:
    return "## Plots\n\n" + "".join(f"- {PLOTS[p.name]}: ![{p.stem}]({p.name})\n" for p in inputs.plots)


# The report's sections, in order, each a function of ReportInputs returning markdown.
SECTIONS = [section_overview, section_problems, section_time_to_accuracy, section_pipeline, section_collectives,
            section_perplexity, section_damage_map, section_accuracy, section_settings, section_plots]


def write_report(results: Union[str, Path], out: Optional[Union[str, Path]] = None) -> dict:
    """Write the plots, report.md and a merged summary.csv; return the tables, the written paths,
    ``problems`` (run directory -> why it is left out or partly reported) and ``stale`` (the runs whose
    earlier rows summary.csv keeps)."""
    results = Path(results)
    out = Path(out) if out else results
    check_writable(out, "--out" if out != results else "the results folder")
    problems: dict[str, str] = {}
    runs = load_runs(results, problems)
    metrics = load_metrics(results, runs, problems)
    collectives = collectives_table(results, runs, problems)   # before any file: what it finds is a problem too
    with output_errors(out, "--out" if out != results else "the results folder"):
        return _write(results, out, runs, metrics, problems, collectives)


def _write(results: Path, out: Path, runs: pd.DataFrame, metrics: pd.DataFrame, problems: dict,
           collectives: pd.DataFrame) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    drawn = {
        "accuracy_vs_time.png": plot_accuracy_vs_time(metrics, runs),
        "accuracy_vs_loss.png": plot_accuracy_vs_loss(runs),
        "observed_vs_configured.png": plot_observed_vs_configured(runs),
        "accuracy_over_steps.png": plot_accuracy_over_steps(metrics, runs),
        "disagreement_vs_loss.png": plot_disagreement(runs),
        "fwd_vs_bwd.png": plot_fwd_vs_bwd(runs),
    }
    for name, drawing in drawn.items():
        if drawing is not None:
            _save(drawing, out / name)
            written.append(out / name)
    extra = perplexity.write(out, runs) if perplexity.is_lm(runs) else []
    stale = []
    if out.resolve() == results.resolve():
        table = write_summary_csv(results)   # shards that shared this folder end up in one table
        stale = sorted(table.loc[table["stale"].astype(bool), "run_dir"].astype(str)) if "stale" in table else []
    inputs = ReportInputs(results, runs, metrics, written, problems, out, collectives)
    text = "\n".join([f"# Sweep report: {results.name}\n", *(section(inputs) for section in SECTIONS)])
    report_md = out / "report.md"
    atomic_write_text(report_md, text)
    return {"runs": runs, "pivot": accuracy_pivot(runs), "table": summary_table(runs),
            "settings": settings(runs), "files": [report_md, *written, *extra], "problems": problems,
            "stale": stale}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results", help="results folder of a sweep (its run directories)")
    parser.add_argument("--out", help="where to write the plots and report.md (default: the results folder)")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 when some run could not be read (the report of the rest is still written)")


def run(args: argparse.Namespace) -> int:
    report = write_report(args.results, args.out)
    print(f"Dataset: {dataset_title(report['runs'])}; accuracy = final {split_name(report['runs'])} "
          "accuracy (%), mean ± 95% CI over seeds; * differs from no loss (Welch's t-test, p < 0.05), "
          "† differs from the loss-free run of the same seed (paired t-test, p < 0.05)")
    print(to_markdown(report["pivot"]))
    if perplexity.is_lm(report["runs"]):
        print("\n" + perplexity.console(report["runs"]))
    for path in report["files"]:
        print(f"wrote {path}")
    for run_dir, why in sorted(report["problems"].items()):
        print(f"lossysim report: warning: {run_dir}: {why}", file=sys.stderr)
    if report["stale"]:
        print(f"lossysim report: summary.csv keeps the earlier rows of {', '.join(report['stale'])}, marked stale",
              file=sys.stderr)
    return 1 if args.strict and report["problems"] else 0
