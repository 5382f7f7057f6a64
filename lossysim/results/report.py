"""Reports: plots and a markdown table from a results folder (the run directories of sweeps).

The table is rebuilt from the run directories on disk (``lossysim.sweep.collect``), so
shards that wrote to one folder are reported together. The plotting functions take an
optional Matplotlib ``Axes`` (or ``Figure``) so ``notebooks/analysis.ipynb`` draws the same
plots inline; without one they draw on a pyplot-free ``Figure`` rendered by Agg, which leaves
the global backend (a notebook's inline one) alone.

Statistics treat seeds as samples: a setting (every varying config value but the seed) gets a
95% Student-t interval and Welch's t-test against the loss-free baseline (``settings``).
report.md is a list of sections (``SECTIONS``), each a function of ``ReportInputs``.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..config import NON_SEMANTIC, ExperimentConfig
from ..io import atomic_write_text, read_jsonl
from .stats import ALPHA, CONFIDENCE, mean_ci, time_to_target, welch_p
from .table import collect, write_summary_csv

# Settings that split runs into separate lines when a sweep varies them.
SERIES_KEYS = ("algorithm", "transport", "retransmit", "lossy_links", "ranks_per_node", "lossy", "recovery",
               "tp_size", "model", "dataset", "backend")
# A lossless run does not depend on these (the sweep normalises them), so baselines ignore them.
BASELINE_KEYS = ("tp_size", "model", "dataset", "backend")
FAMILY_NAMES = {"bernoulli": "Bernoulli", "ge": "Gilbert-Elliott", "none": "no loss"}
# A loss spec is compared by what it means, not how it is spelled.
LOSS_KEYS = ("loss_model", "loss_rate", "mean_burst")
# The sweep runs a lossless setting once whatever these say, so its baseline ignores them.
LOSSLESS_FREE = ("loss", *LOSS_KEYS, "lossy", "recovery", "eval_lossy", "lossy_links", "transport", "retransmit",
                 "deadline", "rto_s", "algorithm", "ranks_per_node", "link_intra", "link_inter", "compute")
# What sets a loss-free run's simulated time (its accuracy does not depend on them).
TIME_KEYS = ("algorithm", "ranks_per_node", "link_intra", "link_inter", "compute", "tp_size")
# The time-to-accuracy target, as a fraction of the loss-free baseline's final accuracy.
TIME_TARGET_FRACTION = 0.9
CONFIG_KEYS = tuple(f for f in ExperimentConfig.__dataclass_fields__)


# -- loading -------------------------------------------------------------------------------------------
def load_runs(results: Union[str, Path]) -> pd.DataFrame:
    """One row per finished run under ``results`` (summary.csv's table, rebuilt from disk)."""
    results = Path(results)
    runs = collect(results)
    if runs.empty and (results / "summary.csv").is_file():
        runs = pd.read_csv(results / "summary.csv")
    if runs.empty:
        raise ValueError(f"no finished runs (*/summary.json) under {results}")
    return runs


def load_metrics(results: Union[str, Path], runs: pd.DataFrame) -> pd.DataFrame:
    """Every run's metrics.jsonl rows, with the run's loss settings and seed attached."""
    frames = []
    attach = [c for c in ("run_dir", "status", "loss_model", "loss_rate", "mean_burst", "seed", "eval_split",
                          *SERIES_KEYS) if c in runs.columns]
    for _, run in runs.iterrows():
        path = Path(results) / str(run["run_dir"]) / "metrics.jsonl"
        if not path.is_file():
            continue
        rows = pd.DataFrame(read_jsonl(path))
        if rows.empty:
            continue
        for column in attach:
            rows[column] = run[column]
        frames.append(rows)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["step", "split", *attach])


def dataset_title(runs: pd.DataFrame) -> str:
    names = sorted({str(n) for n in runs.get("dataset_name", pd.Series(dtype=str)).dropna()})
    return ", ".join(names) if names else "unknown dataset"


def split_name(runs: pd.DataFrame) -> str:
    splits = sorted({str(s) for s in runs.get("eval_split", pd.Series(dtype=str)).dropna()})
    return "/".join(splits) if splits else "eval"


# -- series: which runs make one line ------------------------------------------------------------------
def _varying(frame: pd.DataFrame, keys) -> list[str]:
    return [k for k in keys if k in frame.columns and frame[k].astype(str).nunique() > 1]


def add_series(runs: pd.DataFrame) -> pd.DataFrame:
    """Add ``series`` (a line's label) and ``baseline_group`` to each run."""
    runs = runs.copy()
    lossy = runs[runs["loss_model"] != "none"]
    extras = _varying(lossy, SERIES_KEYS)
    base_extras = _varying(runs, BASELINE_KEYS)

    def series(row) -> str:
        if row["loss_model"] == "none":
            label = "no loss"
        else:
            label = FAMILY_NAMES.get(row["loss_model"], str(row["loss_model"]))
            if row["loss_model"] != "bernoulli":   # Bernoulli's burst follows from its rate
                label += f" (burst {row['mean_burst']:.3g})"
        parts = [f"{k}={row[k]}" for k in extras if row["loss_model"] != "none" or k in BASELINE_KEYS]
        return label + (", " + ", ".join(parts) if parts else "")

    runs["series"] = runs.apply(series, axis=1) if len(runs) else pd.Series(dtype=str)
    runs["baseline_group"] = (runs.apply(lambda r: ", ".join(f"{k}={r[k]}" for k in base_extras), axis=1)
                              if len(runs) else pd.Series(dtype=str))
    return runs


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
def setting_keys(runs: pd.DataFrame) -> list[str]:
    """What tells settings apart: every config column that varies except the seed, the loss spec
    by its meaning (model, rate, burst)."""
    skip = {"seed", "loss", *NON_SEMANTIC}
    varying = [c for c in runs.columns if c in CONFIG_KEYS and c not in skip
               and runs[c].astype(str).nunique(dropna=False) > 1]
    return [k for k in LOSS_KEYS if k in runs.columns] + varying


def _setting_groups(runs: pd.DataFrame):
    """(setting, its runs), loss-free settings first, then by loss model, rate and burst."""
    if "series" not in runs.columns:
        runs = add_series(runs)
    keys = setting_keys(runs)
    groups = [(dict(zip(keys, key if isinstance(key, tuple) else (key,))), group)
              for key, group in runs.groupby(keys, dropna=False, sort=True)]
    return sorted(groups, key=lambda item: item[0]["loss_model"] != "none")   # stable: keeps the rest


def settings(runs: pd.DataFrame, value: str = "accuracy") -> pd.DataFrame:
    """One row per setting: ``value``'s mean, std, 95% CI half-width and n over completed seeds,
    the loss-free baseline of the same other settings, and Welch's two-sided p against it.

    Columns: the setting keys, ``series``, ``mean``, ``std``, ``ci``, ``n``, ``runs``, ``failed``,
    ``diverged``, ``baseline_mean``, ``delta``, ``p``, ``significant`` (p < 0.05). A baseline row
    has p = nan; so does a setting with fewer than two seeds on either side.
    """
    runs = add_series(runs)
    base_keys = [k for k in setting_keys(runs) if k not in LOSSLESS_FREE]
    done = runs[(runs["status"] == "completed") & runs[value].notna()]
    baselines = done[done["loss_model"] == "none"]
    rows = []
    for setting, group in _setting_groups(runs):
        values = done.loc[done.index.intersection(group.index), value]
        est = mean_ci(values)
        row = {**setting, "series": group["series"].iloc[0], "mean": est.mean,
               "std": est.std, "ci": est.half_width, "n": est.n, "runs": len(group),
               "failed": int((group["status"] == "failed").sum()),
               "diverged": int((group["status"] == "diverged").sum())}
        match = baselines
        for k in base_keys:
            match = match[match[k].astype(str) == str(setting[k])]
        is_baseline = setting.get("loss_model") == "none"
        row["baseline_mean"] = float(match[value].mean()) if len(match) else math.nan
        row["delta"] = row["mean"] - row["baseline_mean"]
        row["p"] = math.nan if is_baseline else welch_p(values, match[value])
        row["significant"] = bool(row["p"] < ALPHA)
        rows.append(row)
    return pd.DataFrame(rows)


# -- axes ---------------------------------------------------------------------------------------------
def _new_axes(ax: Optional[Axes], figsize=(7, 4.5)) -> Axes:
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


def _colors(n: int):
    from matplotlib import colormaps
    cmap = colormaps["tab10"]
    return [cmap(i % 10) for i in range(n)]


def _draw_baselines(ax: Axes, runs: pd.DataFrame, value: str) -> None:
    base = aggregate(runs[runs["loss_model"] == "none"], value, by=("baseline_group",))
    for _, row in base.iterrows():
        label = "no loss" + (f" ({row['baseline_group']})" if row["baseline_group"] else "")
        label += f" (n={row['n']})"
        ax.axhline(row["mean"], color="black", linestyle="--", linewidth=1, label=label)
        ax.errorbar([0.0], [row["mean"]], yerr=[row["ci"]], color="black", marker="s", capsize=3)
        if row["ci"] > 0:
            ax.axhspan(row["mean"] - row["ci"], row["mean"] + row["ci"], color="black", alpha=0.08)


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
    ax.set_title(f"{title}\n{dataset_title(runs)}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return ax


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
    ax.set_title(f"Observed against configured packet loss\n{dataset_title(runs)}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def plot_accuracy_over_steps(metrics: pd.DataFrame, runs: pd.DataFrame, fig: Optional[Figure] = None) -> Figure:
    """Eval accuracy during training: a panel per loss model, a line per rate (mean over seeds)."""
    if fig is None:
        fig = Figure(figsize=(12, 4.5), layout="constrained")
        FigureCanvasAgg(fig)
    runs = add_series(runs)
    series_of = dict(zip(runs["run_dir"], runs["series"]))
    split = runs["eval_split"].dropna().iloc[0] if runs["eval_split"].notna().any() else None
    evals = metrics[(metrics["split"] == split) & metrics["accuracy"].notna()].copy() if split else metrics[:0]
    evals = evals[evals["status"] == "completed"]
    evals["series"] = evals["run_dir"].map(series_of)
    panels = sorted(s for s in runs["series"].unique() if not s.startswith("no loss")) or ["no loss"]
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    baseline = evals[evals["loss_model"] == "none"].groupby("step")["accuracy"].mean()
    rates = sorted(r for r in evals["loss_rate"].unique() if r > 0)
    from matplotlib import colormaps
    cmap = colormaps["viridis"]
    for ax, panel in zip(axes, panels):
        if not baseline.empty:
            ax.plot(baseline.index, 100 * baseline.to_numpy(), color="black", linestyle="--", label="no loss")
        mine = evals[evals["series"] == panel]
        for rate, group in mine.groupby("loss_rate"):
            curve = group.groupby("step")["accuracy"].mean()
            color = cmap(rates.index(rate) / max(len(rates) - 1, 1)) if rate in rates else "gray"
            ax.plot(curve.index, 100 * curve.to_numpy(), marker=".", color=color, label=f"{100 * rate:g}%")
        ax.set_title(panel, fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, title="loss rate", title_fontsize=7)
    axes[0].set_ylabel(f"{split or 'eval'} accuracy (%)")
    fig.suptitle(f"Accuracy during training (mean over seeds)\n{dataset_title(runs)}", fontsize=10)
    return fig


def plot_fwd_vs_bwd(runs: pd.DataFrame, ax: Optional[Axes] = None) -> Optional[Axes]:
    """Accuracy when only activations (fwd), only gradients (bwd) or both are lossy; None if not varied."""
    lossy = runs[runs["loss_model"] != "none"]
    if "lossy" not in runs.columns or lossy["lossy"].nunique() < 2:
        return None
    ax = _new_axes(ax)
    runs = add_series(runs)
    family = runs.apply(lambda r: FAMILY_NAMES.get(r["loss_model"], r["loss_model"])
                        + (f" (burst {r['mean_burst']:.3g})" if r["loss_model"] not in ("bernoulli", "none") else ""),
                        axis=1)
    runs = runs.assign(family=family)
    stats = aggregate(runs[runs["loss_model"] != "none"], "accuracy", by=("lossy", "family", "loss_rate"))
    styles = ["-", "--", ":", "-."]
    families = sorted(stats["family"].unique())
    directions = sorted(stats["lossy"].unique())
    for (direction, fam), group in stats.groupby(["lossy", "family"]):
        color = _colors(len(directions))[directions.index(direction)]
        ax.errorbar(100 * group["loss_rate"], 100 * group["mean"], yerr=100 * group["ci"], marker="o",
                    capsize=3, color=color, linestyle=styles[families.index(fam) % len(styles)],
                    label=f"lossy={direction}, {fam}")
    _draw_baselines(ax, runs.assign(accuracy=100 * runs["accuracy"]), "accuracy")
    _rate_axis(ax, runs["loss_rate"].dropna().tolist())
    ax.set_xlabel("average packet loss rate (%)")
    ax.set_ylabel(f"final {split_name(runs)} accuracy (%)")
    ax.set_title(f"Forward (activations) against backward (gradients) loss\n{dataset_title(runs)}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return ax


# -- tables -------------------------------------------------------------------------------------------
def _pm(mean: float, ci: float, n: int, scale: float = 100.0, digits: int = 1) -> str:
    """``mean ± CI half-width``; the mean alone for one seed (no interval to give)."""
    if n == 0 or not math.isfinite(mean):
        return "–"
    if n > 1 and math.isfinite(ci):
        return f"{scale * mean:.{digits}f} ± {scale * ci:.{digits}f}"
    return f"{scale * mean:.{digits}f}"


def _p_cell(p: float, significant: bool) -> str:
    if not math.isfinite(p):
        return "–"
    return (f"{p:.3f}" if p >= 0.001 else "<0.001") + (" *" if significant else "")


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


def summary_table(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per setting: accuracy mean ± 95% CI over seeds, its difference from the loss-free
    baseline with Welch's p (``*``: p < 0.05), steps to the target accuracy, counts."""
    stats = settings(runs, "accuracy")
    extras = [k for k in setting_keys(add_series(runs)) if k not in LOSS_KEYS]
    rows = []
    for (setting, group), (_, st) in zip(_setting_groups(runs), stats.iterrows()):
        done = group[group["status"] == "completed"]
        best = mean_ci(done["best_accuracy"]) if "best_accuracy" in done else mean_ci([])
        dis = done["disagreement"].dropna() if "disagreement" in done else pd.Series(dtype=float)
        obs = group["observed_loss_rate"].dropna() if "observed_loss_rate" in group else pd.Series(dtype=float)
        lossless = setting["loss_model"] == "none"
        row = {"loss model": FAMILY_NAMES.get(setting["loss_model"], setting["loss_model"]),
               "rate (%)": f"{100 * setting['loss_rate']:g}",
               "mean burst": "–" if lossless else f"{setting['mean_burst']:.3g}"}
        row.update({k: str(setting[k]) for k in extras})
        row.update({
            "accuracy (%)": _pm(st["mean"], st["ci"], int(st["n"])),
            "n": int(st["n"]),
            "vs no loss (pp)": "baseline" if lossless else
            (f"{100 * st['delta']:+.1f}" if math.isfinite(st["delta"]) else "–"),
            "p (Welch)": _p_cell(st["p"], st["significant"]),
            "best accuracy (%)": _pm(best.mean, best.half_width, best.n),
            "steps to target": _target_cell(group),
            "observed loss (%)": f"{100 * obs.mean():.3g}" if len(obs) else "–",
            "disagreement (%)": f"{100 * dis.mean():.2f}" if len(dis) else "–",
            "runs": len(group),
            "failed": int(st["failed"]),
            "diverged": int(st["diverged"]),
        })
        rows.append(row)
    return pd.DataFrame(rows)


def accuracy_pivot(runs: pd.DataFrame) -> pd.DataFrame:
    """Accuracy (mean ± 95% CI over seeds, ``*`` when it differs from the loss-free baseline) with
    loss rates down and loss models (burstiness) across."""
    stats = settings(runs, "accuracy")
    stats = stats[stats["n"] > 0]
    if stats.empty:
        return pd.DataFrame()
    lossy = stats[stats["loss_model"] != "none"]
    columns = sorted(lossy["series"].unique()) or ["no loss"]
    base = stats[stats["loss_model"] == "none"]
    rows = []
    if not base.empty:
        b = base.iloc[0] if len(base) == 1 else None
        cell = _pm(b["mean"], b["ci"], int(b["n"])) if b is not None else "see table"
        rows.append({"loss rate (%)": "0 (no loss)", **{c: cell for c in columns}})
    for rate in sorted(lossy["loss_rate"].unique()):
        row = {"loss rate (%)": f"{100 * rate:g}"}
        for column in columns:
            hit = lossy[(lossy["series"] == column) & (lossy["loss_rate"] == rate)]
            if len(hit) == 1:
                h = hit.iloc[0]
                row[column] = _pm(h["mean"], h["ci"], int(h["n"])) + (" *" if h["significant"] else "")
            else:
                row[column] = "–" if hit.empty else "see table"
        rows.append(row)
    return pd.DataFrame(rows)


def to_markdown(frame: pd.DataFrame) -> str:
    if frame.empty:
        return "_no completed runs_\n"
    cells = [[str(c) for c in frame.columns]] + [[str(v) for v in row] for row in frame.itertuples(index=False)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    line = lambda r: "| " + " | ".join(v.ljust(w) for v, w in zip(r, widths)) + " |"   # noqa: E731
    rule = "| " + " | ".join("-" * w for w in widths) + " |"
    return "\n".join([line(cells[0]), rule, *map(line, cells[1:])]) + "\n"


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
            base = base[base[key].astype(str) == str(setting[key])]
    if "algorithm" in base.columns and "algorithm" in setting:
        same = base[base["algorithm"].astype(str) == str(setting["algorithm"])]
        base = same if len(same) else base
    return base


def time_to_accuracy_table(runs: pd.DataFrame, metrics: pd.DataFrame,
                           fraction: float = TIME_TARGET_FRACTION) -> tuple[pd.DataFrame, float]:
    """Per setting: simulated seconds and steps to ``fraction`` x the baseline's final accuracy
    (mean ± 95% CI over the seeds that reached it, and how many did), next to the baseline's."""
    runs = add_series(runs)
    target = time_target(runs, fraction)
    reached = {}
    if math.isfinite(target) and "run_dir" in metrics.columns:
        for run_dir, rows in metrics.groupby("run_dir"):
            split = rows["eval_split"].iloc[0] if "eval_split" in rows.columns else None
            reached[run_dir] = time_to_target(rows.to_dict("records"), target,
                                              split if isinstance(split, str) else None)
    rows = []
    for setting, group in _setting_groups(runs):
        done = group[group["status"] == "completed"]
        hits = [reached.get(d, {}) for d in done["run_dir"]]
        times = [h["sim_time_s"] for h in hits if h.get("sim_time_s") is not None]
        steps = [h["step"] for h in hits if h.get("step") is not None]
        base_hits = [reached.get(d, {}) for d in _baseline_runs(runs, setting)["run_dir"]]
        base_times = [h["sim_time_s"] for h in base_hits if h.get("sim_time_s") is not None]
        est, base = mean_ci(times), mean_ci(base_times)
        rate = setting.get("loss_rate", math.nan)
        rows.append({
            "setting": group["series"].iloc[0] + ("" if setting.get("loss_model") == "none"
                                                  else f", {100 * float(rate):g}%"),
            "time to target (ms)": _pm(est.mean, est.half_width, est.n, scale=1e3, digits=3) if times else "never",
            "reached": f"{len(times)}/{len(done)}",
            "steps": f"{np.mean(steps):.0f}" if steps else "-",
            "x baseline": f"{est.mean / base.mean:.2f}" if times and base_times else "-",
            "comm per step (ms)": f"{1e3 * done['comm_s_per_step'].mean():.3g}"
            if "comm_s_per_step" in done.columns and len(done) else "-",
            "final accuracy (%)": _pm(*_mean_ci_tuple(done["accuracy"])),
        })
    return pd.DataFrame(rows), target


def _mean_ci_tuple(values) -> tuple[float, float, int]:
    est = mean_ci(values)
    return est.mean, est.half_width, est.n


def plot_accuracy_vs_time(metrics: pd.DataFrame, runs: pd.DataFrame, ax: Optional[Axes] = None) -> Optional[Axes]:
    """Eval accuracy against simulated time: a line per setting (mean over seeds at each evaluation,
    band: 95% CI of accuracy); None when the runs carry no simulated clock."""
    if metrics.empty or "sim_time_s" not in metrics.columns:
        return None
    runs = add_series(runs)
    evals = metrics[metrics["split"] == metrics.get("eval_split", metrics["split"])]
    evals = evals[evals["split"] != "train"].dropna(subset=["sim_time_s", "accuracy"])
    if evals.empty:
        return None
    ax = _new_axes(ax, figsize=(8, 5))
    groups = _setting_groups(runs)
    from matplotlib import colormaps
    colors = [colormaps["tab20"](i % 20) for i in range(len(groups))]   # more settings than tab10 holds
    greys = iter(["black", "dimgray", "darkgray", "silver"] * len(groups))
    styles = {"drop": "-", "retransmit": ":", "deadline": "-."}
    for (setting, group), color in zip(groups, colors):
        rows = evals[evals["run_dir"].isin(group["run_dir"])]
        if rows.empty:
            continue
        curve = rows.groupby("step").agg(t=("sim_time_s", "mean"), acc=("accuracy", list)).reset_index()
        est = [mean_ci(a) for a in curve["acc"]]
        mean = np.array([e.mean for e in est])
        half = np.array([0.0 if e.n < 2 else e.half_width for e in est])
        baseline = setting.get("loss_model") == "none"
        label = group["series"].iloc[0] + ("" if baseline else f", {100 * float(setting['loss_rate']):g}%")
        color = next(greys) if baseline else color
        style = "--" if baseline else styles.get(str(setting.get("transport", group.get("transport", pd.Series(
            ["drop"])).iloc[0])), "-")
        ax.plot(curve["t"], 100 * mean, color=color, linestyle=style, marker=".", label=label)
        ax.fill_between(curve["t"], np.clip(100 * (mean - half), 0, 100), np.clip(100 * (mean + half), 0, 100),
                        color=color, alpha=0.12, linewidth=0)
    ax.set_xscale("log")
    ax.set_xlabel("simulated time (s, log scale): modelled compute + simulated communication")
    ax.set_ylabel(f"{split_name(runs)} accuracy (%)")
    ax.set_title(f"Accuracy against simulated time ({dataset_title(runs)})")
    ax.legend(fontsize=7, loc="lower right")
    return ax


# -- the report -----------------------------------------------------------------------------------------
PLOTS = {
    "accuracy_vs_time.png": "Accuracy against simulated time, one line per setting (mean over seeds, band: 95% CI)",
    "accuracy_vs_loss.png": "Final accuracy against average loss rate (mean and 95% CI over seeds; dashed: no "
                            "loss; ringed *: differs from no loss, Welch p < 0.05)",
    "observed_vs_configured.png": "Observed against configured loss rate, one point per run (dotted: y = x)",
    "accuracy_over_steps.png": "Eval accuracy during training, per loss model and rate",
    "disagreement_vs_loss.png": "How often ranks disagree on a prediction, against loss rate",
    "fwd_vs_bwd.png": "Loss on activations only (fwd), gradients only (bwd) or both",
}
STATISTICS_NOTE = (f"Intervals are {100 * CONFIDENCE:g}% Student-t confidence intervals of the mean over seeds "
                   f"(none with one seed); p is the two-sided Welch's t-test of a setting's accuracy against the "
                   f"loss-free baseline with the same other settings, * marks p < {ALPHA:g} (not corrected for "
                   f"multiple comparisons).")


@dataclass
class ReportInputs:
    """What every report section reads."""
    results: Path
    runs: pd.DataFrame
    metrics: pd.DataFrame
    plots: list[Path] = field(default_factory=list)


def _save(figure_or_axes, path: Path) -> None:
    fig = figure_or_axes if isinstance(figure_or_axes, Figure) else figure_or_axes.figure
    fig.savefig(path, dpi=120)


def section_overview(inputs: ReportInputs) -> str:
    runs = inputs.runs
    counts = runs["status"].value_counts()
    return (f"Dataset: **{dataset_title(runs)}**. {len(runs)} runs: {int(counts.get('completed', 0))} completed, "
            f"{int(counts.get('diverged', 0))} diverged, {int(counts.get('failed', 0))} failed. Accuracy is the "
            f"final `{split_name(runs)}` accuracy of completed runs. {STATISTICS_NOTE}\n")


def section_time_to_accuracy(inputs: ReportInputs) -> str:
    if "sim_time_s" not in inputs.metrics.columns:  # results written before the simulated clock
        return ""
    table, target = time_to_accuracy_table(inputs.runs, inputs.metrics)
    if table.empty or not math.isfinite(target):
        return ""
    return (f"## Time to reach {100 * target:.1f}% accuracy\n\n"
            f"The target is {100 * TIME_TARGET_FRACTION:g}% of the loss-free baseline's final "
            f"`{split_name(inputs.runs)}` accuracy. Time is the simulated cluster's (modelled compute plus "
            "simulated communication, retransmissions included; see docs/time_model.md), not this machine's: "
            "mean ± 95% CI over the seeds that reached the target; `x baseline` divides by the reliable "
            "loss-free run's time.\n\n" + to_markdown(table))


def section_accuracy(inputs: ReportInputs) -> str:
    return ("## Accuracy against average loss rate and burstiness\n\n"
            "Mean ± 95% CI over seeds; * differs from no loss (Welch, p < 0.05).\n\n"
            + to_markdown(accuracy_pivot(inputs.runs)))


def section_settings(inputs: ReportInputs) -> str:
    runs = inputs.runs
    targets = sorted({float(t) for t in runs.get("target_accuracy", pd.Series(dtype=float)).dropna()})
    target = ("steps to target: first evaluation step reaching "
              + "/".join(f"{100 * t:g}%" for t in targets) + f" `{split_name(runs)}` accuracy, "
              "mean ± 95% CI over the seeds that reached it.\n\n") if targets else ""
    return "## Every setting\n\n" + target + to_markdown(summary_table(runs))


def section_plots(inputs: ReportInputs) -> str:
    return "## Plots\n\n" + "".join(f"- {PLOTS[p.name]}: ![{p.stem}]({p.name})\n" for p in inputs.plots)


# The report's sections, in order, each a function of ReportInputs returning markdown.
SECTIONS = [section_overview, section_time_to_accuracy, section_accuracy, section_settings, section_plots]


def write_report(results: Union[str, Path], out: Optional[Union[str, Path]] = None) -> dict:
    """Write the plots, report.md and a merged summary.csv; return the tables and written paths."""
    results = Path(results)
    out = Path(out) if out else results
    out.mkdir(parents=True, exist_ok=True)
    runs = load_runs(results)
    metrics = load_metrics(results, runs)
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
    if out.resolve() == results.resolve():
        write_summary_csv(results)   # shards that shared this folder end up in one table
    inputs = ReportInputs(results, runs, metrics, written)
    text = "\n".join([f"# Sweep report: {results.name}\n", *(section(inputs) for section in SECTIONS)])
    report_md = out / "report.md"
    atomic_write_text(report_md, text)
    return {"runs": runs, "pivot": accuracy_pivot(runs), "table": summary_table(runs),
            "settings": settings(runs), "files": [report_md, *written]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results", help="results folder of a sweep (its run directories)")
    parser.add_argument("--out", help="where to write the plots and report.md (default: the results folder)")


def run(args: argparse.Namespace) -> int:
    report = write_report(args.results, args.out)
    print(f"Dataset: {dataset_title(report['runs'])}; accuracy = final {split_name(report['runs'])} "
          "accuracy (%), mean ± 95% CI over seeds; * differs from no loss (Welch's t-test, p < 0.05)")
    print(to_markdown(report["pivot"]))
    for path in report["files"]:
        print(f"wrote {path}")
    return 0
