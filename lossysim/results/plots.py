"""A report's plots. Each takes an optional Matplotlib ``Axes`` (or ``Figure``) so
``notebooks/analysis.ipynb`` draws the same plots inline; without one it draws on a pyplot-free
``Figure`` rendered by Agg, which leaves the global backend (a notebook's inline one) alone."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .compare import aggregate, settings
from .labels import (
    DIRECTIONS,
    LOSS_MODEL,
    LOSS_RATE,
    NO_LOSS,
    Comparison,
    comparisons,
    describe,
    time_unit,
    values,
    varying,
)
from .load import dataset_title, reference_note, split_name
from .settings import add_series, setting_groups, setting_keys
from .stats import mean_ci
from .tables import baseline_runs


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
    note = reference_note(runs)
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


def _eval_rows(metrics: pd.DataFrame) -> pd.DataFrame:
    """Each run's evaluations on its primary split that carry a simulated time."""
    if metrics.empty or "sim_time_s" not in metrics.columns:
        return metrics[:0]
    evals = metrics[metrics["split"] == metrics.get("eval_split", metrics["split"])]
    return evals[evals["split"] != "train"].dropna(subset=["sim_time_s", "accuracy"])


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
        for run_dir in baseline_runs(runs, groups[i][0])["run_dir"]:
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
    loss-free baselines they are timed against in black and greys; time in the unit its curves pick
    (a panel's times may be milliseconds while another's retransmissions stretch to minutes)."""
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
    lines = []   # (curve, label, style): drawn once the panel's times have picked its unit
    for (i, group), grey in zip(baselines.items(), BASELINE_GREYS * len(baselines)):
        label = describe(groups[i][1].iloc[0], base_dims) + _seeds_note(len(group), seeds)
        lines.append((_time_curve(evals, group["run_dir"]), label, {"color": grey, "linewidth": 2}))
    ordered = sorted(shown.index, key=lambda i: (order.index(answers[i]), shown.loc[i, "loss_rate"]))
    for i in ordered:
        group = groups[i][1]
        done = group[group["status"] == "completed"]
        label = describe(group.iloc[0], dims, always=asked) + _seeds_note(len(done), seeds)
        rate = LOSS_RATE.value(shown.loc[i])
        lines.append((_time_curve(evals, done["run_dir"]), label,
                      {"color": colors[answers[i]], "linestyle": styles.get(rate, "-")}))
    scale, unit = time_unit([t for curve, _, _ in lines for t in curve["t"]])
    for curve, label, style in lines:
        _draw_time_curve(ax, curve.assign(t=scale * curve["t"]), label, **style)
    ax.set_xlabel(f"simulated time ({unit}, log scale)")
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
        ax.set_ylabel(f"{split_name(runs)} accuracy (%)")
    fig.suptitle("Accuracy against simulated time (modelled compute + simulated communication): mean over "
                 f"{seeds} seeds, band: 95% CI\n{dataset_title(runs)}", fontsize=10)
    return fig

