"""report.md's sections, in order (``sections()``): each a function of ``ReportInputs`` returning markdown."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pandas as pd

from .. import axes
from . import perplexity
from .collectives import collectives_table
from .load import dataset_title, reference_note, split_name
from .settings import to_markdown
from .stats import ALPHA, CONFIDENCE
from .tables import (
    HIDDEN,
    TIME_TARGET_FRACTION,
    accuracy_pivot,
    axis_table,
    most_fragile,
    summary_table,
    time_to_accuracy_table,
    uses_axis,
)

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


def section_overview(inputs: ReportInputs) -> str:
    runs = inputs.runs
    counts = runs["status"].value_counts()
    unread = sum(1 for run_dir in inputs.problems if run_dir not in set(runs["run_dir"].astype(str)))
    return (f"Dataset: **{dataset_title(runs)}**. {len(runs)} runs: {int(counts.get('completed', 0))} completed, "
            f"{int(counts.get('diverged', 0))} diverged, {int(counts.get('failed', 0))} failed"
            + (f"; {unread} more could not be read (listed below)" if unread else "") + ". Accuracy is the "
            f"final `{split_name(runs)}` accuracy of completed runs. {STATISTICS_NOTE}\n")


# A restart costs minutes against a tiny model's milliseconds: a mean over seeds with and without one is a
# time no seed took, so those seeds are shown apart.
RESTART_NOTE = ("A seed whose time to the target includes a restart (the transport gave up on a collective: "
                "`restart_s` plus `restart_lost_steps` steps redone) is left out of the mean, the `ideal nic` and "
                "`x baseline` columns, and given with its own time under `restarted before target`. ")


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
            "mean ± 95% CI over the seeds that reached the target, in the unit the times call for. Lost packets "
            "are repaired as the run's NIC preset does (`nic`: its timers, go-back-N or selective repeat, retries, "
            "restarts after a failure); `ideal nic` is the same runs' time had every loss cost one resend and one "
            "round trip, so the gap between the two columns is what the preset's timers cost. "
            + (RESTART_NOTE if "restarted before target" in table.columns else "")
            + "`x baseline` divides by the time of the "
            "loss-free run timed like the setting (same topology, links and compute). The last two columns compare "
            "final accuracy with the loss-free run of the same seed (see the statistics note above).\n\n"
            + to_markdown(table))


def section_accuracy(inputs: ReportInputs) -> str:
    note = reference_note(inputs.runs)
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
    return ("## Runs that are incomplete or could not be read\n\n"
            "Left out of every table and plot when they never finished or never started, or their summary cannot "
            "be read or lacks what its status always records (summary.csv keeps the row it had for them, marked "
            "stale); otherwise reported without what is named.\n\n"
            + "".join(f"- `{run_dir}`: {why}\n" for run_dir, why in sorted(inputs.problems.items())))


_COMMON = ("Accuracy: mean ± 95% CI over seeds, and the paired difference from the loss-free run of the same "
           "seed. `time per step`: the simulated clock over the steps; `x no loss` divides it by the loss-free "
           "runs timed like the setting (same layout, links and compute). ")


def axis_section(name: str):
    """The report section of the axis ``name`` (its declaration's ``Section``, ``lossysim.axes``): sweeps that
    use the axis only: its text, its ``axis_table`` and, where it says so, the setting that lost the most."""
    def section(inputs: ReportInputs) -> str:
        axis = axes.get(name)
        spec = axis.section
        if not _any_uses(inputs.runs, name):
            return ""
        table = axis_table(inputs.runs, name)
        worst = most_fragile(table) if spec.fragile else None
        named = "" if worst is None else (
            f"\n\nMost fragile: {worst['_setting']}: {worst['vs no loss, paired (pp)']} points against the "
            f"loss-free runs of the same seeds, {worst['x no loss']}x their time per step.")
        return f"## {spec.title}\n\n{spec.lead}{_COMMON}{spec.text}\n\n" + to_markdown(table.drop(columns=HIDDEN)) \
            + named
    section.__name__ = f"section_{name}"
    return section


def _any_uses(runs: pd.DataFrame, axis: str) -> bool:
    return any(uses_axis(row, axis) for _, row in runs.iterrows())


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


def sections() -> list:
    """The report's sections, in order, each a function of ReportInputs returning markdown: every axis's
    with a report section (``lossysim.axes``) after the time to accuracy."""
    return [section_overview, section_problems, section_time_to_accuracy,
            *(axis_section(a.name) for a in axes.AXES if a.section is not None), section_collectives,
            section_perplexity, section_damage_map, section_accuracy, section_settings, section_plots]


SECTIONS = sections()   # (the built-in axes'; ``report`` reads ``sections()``, any declared axis's too)
