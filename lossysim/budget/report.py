"""What ``lossysim budget`` writes for people to read: ``budget.png`` (what the loss left behind: the eval
perplexity change against loss rate, a line per family and policy), ``training.png`` (what it did while
training: the training-loss gap to the loss-free run, step by step, a line per rate) and ``budgets.md``
(the table, each budget beside what retransmitting at it costs, then every point measured)."""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from .families import FAMILIES
from .search import TOLERANCE_PCT
from .trade import HARDWARE, SEQ, STEPS, job


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def plot(points: pd.DataFrame, path: Path) -> None:
    """Perplexity change against loss rate, a line per family and policy (log x, 95% intervals shaded and
    barred), the 1% tolerance dashed; one panel per length."""
    from matplotlib.ticker import NullFormatter
    lengths = sorted(points["steps"].unique())
    fig = _figure(6.5 * len(lengths), 4.5)
    for i, steps in enumerate(lengths):
        ax = fig.add_subplot(1, len(lengths), i + 1)
        for (family, policy), group in points[points["steps"] == steps].groupby(["family", "policy"], sort=False):
            group = group.sort_values("rate")
            x, y, h = 100 * group["rate"], group["change_pct"], group["change_pct_ci"].fillna(0)
            line, = ax.plot(x, y, marker="o", label=f"{family} ({policy})")
            ax.fill_between(x, y - h, y + h, color=line.get_color(), alpha=0.15)
            # each point's interval as a bar too: a family measured at one rate has no band to shade
            ax.errorbar(x, y, yerr=h, fmt="none", ecolor=line.get_color(), capsize=3, linewidth=1)
        ax.axhline(TOLERANCE_PCT, color="k", linestyle="--", linewidth=1)
        ax.set_xscale("log")
        # the rates measured as the ticks, as printed in the table: a narrow log range's own ticks read
        # "1.1x10^1" or go missing
        rates = sorted(100 * points[points["steps"] == steps]["rate"].unique())
        ax.set_xticks(rates, [f"{r:.3g}" for r in rates], fontsize=7, rotation=45 if len(rates) > 6 else 0)
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("loss rate (%)")
        ax.set_ylabel("eval perplexity vs loss-free, paired (%)")
        ax.set_title(f"{steps} optimizer steps")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def markdown(table: pd.DataFrame, points: pd.DataFrame, base: dict, seeds: int, nics,
             settings: dict | None = None) -> str:
    """The budgets, then every point the searches measured (as ``points.csv`` holds them); ``settings``:
    what ``--set`` gave every run, which the priced jobs do not take."""
    cost = [f"retransmitting at it, {nic} (% of a step)" for nic in nics]
    lines = [f"# Loss budgets: {base['model']}", "",
             f"The largest loss rate (Bernoulli) at which fine-tuning keeps the eval perplexity within "
             f"{TOLERANCE_PCT:g}% of the paired loss-free run (the 95% interval's upper end over {seeds} seeds); "
             "evaluated loss-free. Beside it, what retransmitting that traffic at that rate adds to a real job's "
             f"step (`lossysim estimate`, the family's axis at 2 across nodes, on {HARDWARE['compute']} over "
             f"{HARDWARE['link_inter']} ({HARDWARE['link_intra']} inside a node), `transport: retransmit` on each "
             f"NIC preset, {SEQ}-token sequences; the mean of {STEPS} steps and its 95% interval: "
             + ", ".join(f"{family.name} {job(family)[0]}" for family in FAMILIES) + ").", "",
             *([f"Every run took {', '.join(f'`{k}={v}`' for k, v in settings.items())} (`--set`); the priced "
                "jobs did not: each keeps its family's own layout and the network's defaults.", ""]
               if settings and nics else []),
             "| " + " | ".join(["traffic", "policy", "steps", "budget", *cost]) + " |",
             "| " + " | ".join(["---"] * (4 + len(cost))) + " |"]
    for row in table.to_dict("records"):
        cells = [row["traffic"], row["policy"], str(row["steps"]), row["budget"]]
        cells += [cost_text(row[f"retransmit_{nic}_pct"], row[f"retransmit_{nic}_pct_ci"],
                            row[f"retransmit_{nic}_failures_per_1000_steps"]) for nic in nics]
        lines.append("| " + " | ".join(cells) + " |")
    if not points.empty:
        lines += ["", f"Every rate measured: the paired eval-perplexity change (mean over {seeds} seeds and its 95% "
                  "interval), and the training-loss gap, lossy minus loss-free (nats, mean over steps and seeds).",
                  "", "| family | policy | steps | loss | change | 95% interval | upper end | passes | "
                  "training-loss gap |", "| " + " | ".join(["---"] * 9) + " |"]
        for p in points.itertuples():
            lines.append(f"| {p.family} | {p.policy} | {p.steps} | {100 * p.rate:.3g}% | {p.change_pct:+.2f}% | "
                         f"+-{p.change_pct_ci:.2f} | {p.upper_pct:.2f}% | {'yes' if p.passes else 'no'} | "
                         f"{p.train_loss_gap:.3g} |")
    return "\n".join(lines) + "\n"


def cost_text(pct: float, half_width: float, failures_per_1000_steps: float = 0.0) -> str:
    """A step cost as the table prints it: the mean to its interval's first digit, then the interval; and
    where the transport gives collectives up, how often (the step time leaves the stopped job out)."""
    if not math.isfinite(pct):
        return "–"
    if not (math.isfinite(half_width) and half_width > 0):
        text = _plain(pct)
    else:
        decimals = max(0, -math.floor(math.log10(half_width)))
        text = f"{pct:,.{decimals}f} +-{half_width:.{decimals}f}"
    if failures_per_1000_steps > 0:
        text += f", gives up {_plain(failures_per_1000_steps)} times per 1,000 steps"
    return text


def _plain(x: float) -> str:
    """Three significant digits, whole numbers from 100 up (1,779, not 1.78e+03)."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def plot_training(steps: pd.DataFrame, path: Path) -> None:
    """The training-loss gap (lossy minus loss-free, nats, mean over seeds) at every step, one panel per
    family, policy and length, a line per loss rate: whether the damage shows at once, grows or heals."""
    from matplotlib import colormaps
    from matplotlib.ticker import MaxNLocator
    searches = list(steps.groupby(["family", "policy", "steps"], sort=False))
    cols = min(3, len(searches))
    rows = math.ceil(len(searches) / cols)
    fig = _figure(4.5 * cols, 3.2 * rows)
    for i, ((family, policy, length), group) in enumerate(searches):
        ax = fig.add_subplot(rows, cols, i + 1)
        rates = sorted(group["rate"].unique())
        for j, rate in enumerate(rates):
            mean = group[group["rate"] == rate].groupby("step")["gap"].mean()
            colour = colormaps["viridis"](j / max(1, len(rates) - 1))
            ax.plot(mean.index, mean.values, marker=".", color=colour, label=f"{100 * rate:.3g}%")
        ax.axhline(0.0, color="k", linewidth=0.8)
        ax.set_title(f"{family} ({policy}), {length} steps", fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("training loss, lossy - loss-free (nats)", fontsize=8)
        ax.legend(fontsize=6, title="loss rate", title_fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
