"""The perplexity table of causal-LM sweeps (``task: lm``): what training under loss did to the model.

Per setting: the mean final eval perplexity over seeds; its change against the loss-free run of the
same mesh and seed, in percent (per seed ``100 (p / p_loss-free - 1)``; the mean, its 95% Student-t
interval over seeds and the two-sided p of the t-test that the mean change is zero, so the interval
leaves out 0 exactly when p < 0.05); the simulated time per step against the loss-free run's (the
run's own clock: repairs and retransmissions included); the observed loss rate. Beside it, for
settings that lose data-parallel gradients, the published claim they are usually compared with
(Weintraub et al. 2025) and what differs.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..traffic import parse_kinds as traffic_kinds
from ..io import atomic_write_text, read_summary
from ..loss.spec import FAMILIES
from .settings import add_series, loss_free_runs, p_cell, setting_columns, setting_groups, to_markdown
from .stats import ALPHA, CONFIDENCE, mean_ci, paired_p

CSV = "perplexity.csv"
PLOT = "perplexity_change.png"
# The published figure a data-parallel setting is set beside.
# Weintraub, Banner, Orda, "Distributed Training under Packet Loss" (arXiv 2507.07114).
WEINTRAUB = {"rate": 0.10, "change_pct": 0.8, "source": "Weintraub et al. 2025", "model": "LLaMA2-7B",
             "ranks": "64 GPUs (data parallel)", "training": "training runs of a 7B model",
             "aggregation": "unbiased (what arrived, rescaled), replica drift bounded"}


def is_lm(runs: pd.DataFrame) -> bool:
    """Whether the runs are causal-LM runs (their summary rows carry a perplexity)."""
    return "perplexity" in runs.columns and bool(runs["perplexity"].notna().any())


def paired_change(values, baseline) -> tuple[float, float, int, float]:
    """(mean, 95% half-width, n, p) of the per-pair percent change ``100 (v / b - 1)``; p is the
    one-sample t-test of the changes against 0 (nan for fewer than two pairs)."""
    v, b = np.asarray(values, dtype=float), np.asarray(baseline, dtype=float)
    both = np.isfinite(v) & np.isfinite(b) & (b > 0)
    change = 100.0 * (v[both] / b[both] - 1.0)
    est = mean_ci(change, CONFIDENCE)
    return est.mean, est.half_width, est.n, paired_p(change, np.zeros_like(change))


def table(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per setting, numbers unformatted (perplexity.csv); see the module's docstring."""
    runs = add_series(runs.assign(sim_s_per_step=runs["sim_time_s"] / runs["steps_done"]))
    columns = setting_columns(runs)
    rows = []
    for setting, group in setting_groups(runs):
        done = group[(group["status"] == "completed") & group["perplexity"].notna()]
        base = loss_free_runs(runs, setting, "perplexity")
        mine, theirs = done.groupby("seed")["perplexity"].mean(), base.groupby("seed")["perplexity"].mean()
        seeds = mine.index.intersection(theirs.index)
        lossless = setting["loss_model"] == "none"
        change, half, pairs, p = (paired_change(mine[seeds], theirs[seeds]) if not lossless
                                  else (math.nan, math.nan, 0, math.nan))
        ppl = mean_ci(done["perplexity"])
        step, base_step = done["sim_s_per_step"].mean(), base["sim_s_per_step"].mean()
        first = group.iloc[0]
        rows.append({
            "setting": first["series"],
            "loss_model": setting["loss_model"],
            "loss_rate": setting["loss_rate"],
            # loses data-parallel gradients: the settings the published claim is about
            "dp_loss": (not lossless and float(first.get("replicas", 1) or 1) > 1
                        and "dp" in traffic_kinds(str(first.get("lossy_traffic", "all")))),
            **{d.name: d.value(group.iloc[0]) for d in columns},
            "n": ppl.n, "perplexity": ppl.mean, "perplexity_ci": ppl.half_width,
            "loss_free_perplexity": float(theirs[seeds].mean()) if len(seeds) else math.nan,
            "change_pct": change, "change_pct_ci": half, "pairs": pairs, "p": p,
            "sim_s_per_step": step, "time_vs_loss_free": step / base_step if base_step > 0 else math.nan,
            "observed_loss_rate": group["observed_loss_rate"].mean() if "observed_loss_rate" in group else math.nan,
            "failed": int((group["status"] == "failed").sum()), "diverged": int((group["status"] == "diverged").sum()),
        })
    return pd.DataFrame(rows)


def _num(value: float, digits: int = 3) -> str:
    return f"{value:.{digits}g}" if math.isfinite(value) else "–"


def _change_cell(row) -> str:
    if not math.isfinite(row["change_pct"]):
        return "–"
    interval = f" ± {row['change_pct_ci']:.2g}" if math.isfinite(row["change_pct_ci"]) else ""
    return f"{row['change_pct']:+.3g}{interval}"


def markdown_table(frame: pd.DataFrame, dims: list[str]) -> pd.DataFrame:
    """The table as report.md prints it."""
    return pd.DataFrame([{
        "loss model": FAMILIES.get(row["loss_model"], row["loss_model"]),
        "rate (%)": f"{100 * row['loss_rate']:g}",
        **{d: row[d] for d in dims},
        "n": int(row["n"]),
        "eval perplexity": _num(row["perplexity"], 4) + (f" ± {row['perplexity_ci']:.2g}"
                                                         if math.isfinite(row["perplexity_ci"]) else ""),
        "vs loss-free, paired (%)": _change_cell(row),
        "p (paired)": p_cell(row["p"], bool(row["p"] < ALPHA)),
        "sim time / step (ms)": _num(1e3 * row["sim_s_per_step"]),
        "x loss-free": _num(row["time_vs_loss_free"]),
        "observed loss (%)": _num(100 * row["observed_loss_rate"]),
    } for _, row in frame.iterrows()])


def plot(frame: pd.DataFrame) -> Optional[Figure]:
    """Perplexity change against the loss-free run of the same seed, a line per lossy setting (mean
    and 95% interval), Weintraub's 0.8% bound dotted; None when nothing is lossy."""
    lossy = frame[frame["change_pct"].notna()].reset_index(drop=True)
    if lossy.empty:
        return None
    fig = Figure(figsize=(9, 1.8 + 0.45 * len(lossy)), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    y = np.arange(len(lossy))[::-1]
    ax.errorbar(lossy["change_pct"], y, xerr=lossy["change_pct_ci"].fillna(0.0), fmt="o", capsize=3)
    ax.set_yticks(y, [f"{100 * r:g}% {s}" for r, s in zip(lossy["loss_rate"], lossy["setting"])], fontsize=8)
    ax.axvline(0.0, color="black", linewidth=1)
    bound = WEINTRAUB["change_pct"]
    ax.axvline(bound, color="gray", linestyle=":",
               label=f"{WEINTRAUB['source']}: at most {bound:g}% at {100 * WEINTRAUB['rate']:g}% "
                     f"({WEINTRAUB['model']}, {WEINTRAUB['ranks']})")
    # Changes span from under 1% to thousands: linear near 0, logarithmic beyond.
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlabel("eval perplexity change against the loss-free run of the same seed (%, symlog)")
    ax.grid(True, axis="x", alpha=0.3)
    ax.margins(x=0.1)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.25), frameon=False)
    ax.set_title("What training under loss did to the model: mean and 95% interval over seeds (eval loss-free)",
                 fontsize=9)
    return fig


def _config(results: Path, runs: pd.DataFrame) -> dict:
    """A completed run's config (what every run of the sweep shares: model, sizes)."""
    for run_dir in runs.loc[runs["status"] == "completed", "run_dir"]:
        summary = read_summary(results / str(run_dir))
        if summary and summary.get("config"):
            return summary["config"]
    return {}


def _assumptions(config: dict, runs: pd.DataFrame) -> str:
    lossy = runs[runs["loss_model"] != "none"]
    eval_lossy = lossy["eval_lossy"] if "eval_lossy" in lossy else pd.Series([config.get("eval_lossy", True)])
    evaluated = ("evaluated loss-free (`eval_lossy: false`), so the perplexity measures what training under loss "
                 "did to the weights, not inference under loss (the damage map's question)"
                 if not eval_lossy.astype(str).str.lower().eq("true").any() else
                 "evaluated under the run's loss (`eval_lossy: true`): the perplexity mixes training damage and "
                 "inference under loss")
    model = str(config.get("model", "?"))
    weights = (" Its weights are dequantised from Q4_1 (they carry its 4-bit rounding)."
               if model == "smollm2-135m" else "")
    return (f"Assumptions: model `{model}`.{weights} Every run trains {config.get('steps', '?')} steps of "
            f"{config.get('batch_size', '?')} texts of at most {config.get('max_length', '?')} tokens at lr "
            f"{config.get('lr', '?')} (warmup: {config.get('warmup_steps', '?')} steps), and is {evaluated}, on "
            f"{config.get('max_eval_samples') or 'all'} held-out texts. Runs with the same seed see the same data "
            "in the same order, so each is paired with the loss-free run of its mesh and seed. Simulated time is "
            "the run's clock (modelled compute plus simulated communication, repairs included), per optimizer "
            f"step: compute `{config.get('compute', '?')}`, links `{config.get('link_intra', '?')}` inside a node "
            f"and `{config.get('link_inter', '?')}` between nodes, transport `{config.get('transport', '?')}` with "
            f"nic `{config.get('nic', '?')}` (presets and their sources: docs/time_model.md).")


def _weintraub(frame: pd.DataFrame, config: dict) -> str:
    """The published claim beside our settings that lose data-parallel gradients, with what differs."""
    dp = frame[frame["dp_loss"] & frame["change_pct"].notna()]
    if dp.empty:
        return ""
    ours = "; ".join(f"{100 * r['loss_rate']:g}% loss, {r.get('recovery', '')}: {_change_cell(r)}%"
                     for _, r in dp.iterrows())
    w = WEINTRAUB
    weights = " (135M, weights dequantised from Q4_1)" if config.get("model") == "smollm2-135m" else ""
    rows = [("model", w["model"], f"`{config.get('model', '?')}`{weights}"),
            ("ranks", w["ranks"], f"dp {config.get('dp_size', '?')} x tp {config.get('tp_size', '?')} (simulated)"),
            ("training", w["training"], f"{config.get('steps', '?')} fine-tuning steps of "
             f"{config.get('batch_size', '?')} x {config.get('max_length', '?')} tokens"),
            ("aggregation", w["aggregation"], "`rescale` (unbiased) and `zero` (lost elements count as 0)"),
            ("perplexity change", f"at most {w['change_pct']:g}% at {100 * w['rate']:g}% loss", ours)]
    return ("Beside the published claim (theirs against ours):\n\n"
            + to_markdown(pd.DataFrame(rows, columns=["", w["source"], "this sweep"])))


def console(runs: pd.DataFrame) -> str:
    """The table as ``lossysim report`` prints it."""
    frame = table(runs)
    dims = [d.name for d in setting_columns(add_series(runs))]
    return ("Eval perplexity after training under loss (evaluated loss-free; change against the loss-free run of "
            "the same mesh and seed, mean ± 95% CI over seeds; * p < 0.05, paired):\n"
            + to_markdown(markdown_table(frame, dims)))


def write(out: Path, runs: pd.DataFrame) -> list[Path]:
    """perplexity.csv and the change plot into ``out``; the paths written."""
    frame = table(runs)
    atomic_write_text(out / CSV, frame.to_csv(index=False))
    written = [out / CSV]
    fig = plot(frame)
    if fig is not None:
        fig.savefig(out / PLOT, dpi=120, bbox_inches="tight")   # long setting names stay whole
        written.append(out / PLOT)
    return written


def section(results: Path, out: Path, runs: pd.DataFrame) -> str:
    """report.md's perplexity section (tables, plot, assumptions, the published claim beside)."""
    frame = table(runs)
    dims = [d.name for d in setting_columns(add_series(runs))]
    config = _config(results, runs)
    replicated = runs[runs["replicas"].notna()] if "replicas" in runs.columns else runs[:0]
    plot_line = f"![perplexity change]({PLOT})\n\n" if (out / PLOT).is_file() else ""
    return ("## Eval perplexity after training under loss\n\n"
            f"Mean ± {100 * CONFIDENCE:g}% Student-t interval over seeds. `vs loss-free, paired` is the mean over "
            "seeds of 100 (perplexity / that of the loss-free run of the same mesh and seed - 1) ± its interval; "
            "`p (paired)` the two-sided t-test that this mean is 0 (`*`: p < 0.05). `x loss-free` divides the "
            "simulated time per step by the loss-free run's. "
            + _assumptions(config, runs) + "\n\n" + to_markdown(markdown_table(frame, dims)) + "\n"
            + plot_line + _weintraub(frame, _config(results, replicated)))


def damage_map_section(results: Path, out: Path) -> str:
    """An embed of ``<results>/damage_map/damage_map.png`` when the profile wrote one."""
    image = results / "damage_map" / "damage_map.png"
    if not image.is_file():
        return ""
    return ("## Where loss hurts in inference: the damage map\n\n"
            "KL divergence per token of the loss-free model's next-token distribution when one TP site (layer x "
            "attention or MLP output, forward) loses packets, per rate and recovery, pretrained against random "
            "weights (`python -m lossysim.real.damage_map`; docs/sensitivity.md).\n\n"
            f"![damage map]({os.path.relpath(image, out)})\n" + _damage_means(image.with_suffix(".csv")))


def _damage_means(csv: Path) -> str:
    """The map's mean and worst KL per token over its sites, per model, rate and recovery."""
    try:
        cells = pd.read_csv(csv)
        cells = cells[cells["layer"] >= 0]
        summary = (cells.groupby(["model", "rate", "recovery"], sort=False)["kl_per_token"]
                   .agg(["mean", "max"]).reset_index())
    except (OSError, ValueError, KeyError, pd.errors.ParserError):
        return ""
    rows = pd.DataFrame({"model": summary["model"], "rate (%)": (100 * summary["rate"]).map("{:g}".format),
                         "recovery": summary["recovery"],
                         "mean KL over sites": summary["mean"].map("{:.3g}".format),
                         "worst site": summary["max"].map("{:.3g}".format)})
    return (f"\nOver the map's {cells.groupby(['layer', 'site']).ngroups} sites ({csv.name}):\n\n"
            + to_markdown(rows) + "\n")
