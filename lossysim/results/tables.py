"""A report's tables: every setting (``summary_table``), accuracy against loss rate (``accuracy_pivot``),
the simulated time to a target accuracy (``time_to_accuracy_table``) and each parallelism's (``axis_table``),
as data frames with readable cells; settings are named by ``lossysim.results.labels``."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import pandas as pd

from .. import axes
from ..loss.spec import FAMILIES
from .compare import reached_target, settings
from .labels import CONFIG_DEFAULTS, LOSS_MODEL, LOSS_RATE, NO_LOSS, NOT_APPLICABLE, time_unit
from .settings import add_series, p_cell, same, setting_columns, setting_groups
from .stats import mean_ci

# What sets a loss-free run's simulated time (its accuracy does not depend on them).
TIME_KEYS = ("algorithm", "ranks_per_node", "link_intra", "link_inter", "compute", "tp_size", "dp_size", "pp_size",
             "pp_schedule", "microbatches")


# The time-to-accuracy target, as a fraction of the loss-free baseline's final accuracy.
TIME_TARGET_FRACTION = 0.9


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


def time_target(runs: pd.DataFrame, fraction: float = TIME_TARGET_FRACTION) -> float:
    """The accuracy the time table asks for: ``fraction`` of the loss-free baseline's mean final accuracy."""
    base = runs[(runs["loss_model"] == "none") & (runs["status"] == "completed")]["accuracy"].dropna()
    return fraction * float(base.mean()) if len(base) else math.nan


def baseline_runs(runs: pd.DataFrame, setting: dict) -> pd.DataFrame:
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


@dataclass
class TargetTimes:
    """A setting's seeds against the time target: the simulated seconds of those that reached it without a
    restart (and their ideal nic's), the steps of all that reached it, (seconds, restarts) of those whose
    time includes a restart, and the seconds of its loss-free runs that paid none."""
    known: int
    times: list
    ideal: list
    steps: list
    paid: list
    base: list


def _target_times(runs: pd.DataFrame, setting: dict, done: pd.DataFrame, reached: dict,
                  measured: set) -> TargetTimes:
    # A run without metrics rows may have reached the target or not: unknown, never "never".
    hits = [reached.get(d, {}) for d in done["run_dir"] if d in measured]
    timed = [h for h in hits if h.get("sim_time_s") is not None]
    clean = [h for h in timed if not h["restarts"]]
    base = [reached.get(d, {}) for d in baseline_runs(runs, setting)["run_dir"]]
    return TargetTimes(
        len(hits), [h["sim_time_s"] for h in clean],
        [h["sim_time_s_ideal_nic"] for h in clean if h.get("sim_time_s_ideal_nic") is not None],
        [h["step"] for h in hits if h.get("step") is not None],
        [(h["sim_time_s"], h["restarts"]) for h in timed if h["restarts"]],
        [h["sim_time_s"] for h in base if h.get("sim_time_s") is not None and not h["restarts"]])


def time_to_accuracy_table(runs: pd.DataFrame, metrics: pd.DataFrame,
                           fraction: float = TIME_TARGET_FRACTION) -> tuple[pd.DataFrame, float]:
    """Per setting: simulated time and steps to ``fraction`` x the baseline's final accuracy
    (mean ± 95% CI over the seeds that reached it without a restart, and how many reached it), next to
    the baseline's; in a unit the times pick (``labels.time_unit``). A seed whose time includes a restart
    is never folded into that mean: the ``restarted before target`` column, there when some seed's is,
    gives those seeds' own times."""
    runs = add_series(runs)
    target = time_target(runs, fraction)
    reached = reached_target(runs, metrics, target) if math.isfinite(target) else {}
    measured = set(metrics["run_dir"]) if "run_dir" in metrics.columns else set()
    columns = setting_columns(runs)
    groups = setting_groups(runs)
    timed = [_target_times(runs, setting, group[group["status"] == "completed"], reached, measured)
             for setting, group in groups]
    scale, unit = time_unit([t for g in timed for t in g.times + g.ideal])
    restarted = any(g.paid for g in timed)
    rows = []
    for (setting, group), (_, st), g in zip(groups, settings(runs, "accuracy").iterrows(), timed):
        done = group[group["status"] == "completed"]
        est, base = mean_ci(g.times), mean_ci(g.base)
        first = group.iloc[0]
        rows.append({
            "loss": _loss_cell(setting, first),
            **{d.name: d.value(first) for d in columns},
            f"time to target ({unit})": (_pm(est.mean, est.half_width, est.n, scale=scale, digits=3) if g.times
                                         else "restarted" if g.paid else "never" if g.known
                                         else "unknown" if len(done) else "-"),
            f"ideal nic ({unit})": _pm(*_mean_ci_tuple(g.ideal), scale=scale, digits=3) if g.ideal else "-",
            "reached": f"{len(g.times) + len(g.paid)}/{g.known}" + (f", {len(done) - g.known} unknown"
                                                                   if g.known < len(done) else ""),
            **({"restarted before target": _restart_cell(g, first)} if restarted else {}),
            "steps": f"{np.mean(g.steps):.0f}" if g.steps else "-",
            "x baseline": f"{est.mean / base.mean:.2f}" if g.times and g.base else "-",
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


def _restart_cell(g: TargetTimes, first: pd.Series) -> str:
    """The seeds whose time to target includes a restart, each with its own time (in a unit those times
    pick) and its restarts beyond one, and what a restart costs: "1 of 3 seeds: 5.01 min; each restart +5 min"."""
    if not g.paid:
        return NOT_APPLICABLE
    scale, unit = time_unit([t for t, _ in g.paid])
    each = ", ".join(f"{scale * t:.4g} {unit}" + (f" ({n} restarts)" if n > 1 else "") for t, n in g.paid)
    cost = pd.to_numeric(first.get("restart_s", CONFIG_DEFAULTS["restart_s"]), errors="coerce")
    cost = cost if pd.notna(cost) else CONFIG_DEFAULTS["restart_s"]
    return f"{len(g.paid)} of {len(g.times) + len(g.paid)} seeds: {each}; each restart +{scale * cost:.4g} {unit}"


def _loss_cell(setting: dict, first: pd.Series) -> str:
    """"no loss", or the rate and the loss model: "5% Bernoulli"."""
    return NO_LOSS if setting["loss_model"] == "none" else f"{LOSS_RATE.value(first)} {LOSS_MODEL.value(first)}"


@dataclass(frozen=True)
class AxisTable:
    """What a parallelism's table shows beside accuracy and time: its size column, its label in the column
    names, and its own figures (column name -> (summary column, scale))."""
    size: str
    label: str
    extra: dict = field(default_factory=dict)


# An ``axis_table``'s columns for ``most_fragile``, not shown.
HIDDEN = ["_paired", "_setting"]


def axis_tables() -> dict[str, AxisTable]:
    """The parallelisms whose traffic a sweep may single out, each its own report table (``axis_table``):
    every axis with a report section (``lossysim.axes``)."""
    return {a.name: AxisTable(a.size, a.label, a.section.extra) for a in axes.AXES if a.section is not None}


def axis_table(runs: pd.DataFrame, axis: str = "pp") -> pd.DataFrame:
    """Per setting, side by side: final accuracy (mean ± 95% CI over seeds) and its paired difference from
    the loss-free run of the same seed, the simulated time per step and its ratio to the loss-free runs
    timed like it, the axis's own figures (the pipeline's idle share), what its traffic adds to a step
    (``{axis}_s_per_step``) and the observed loss on its lossy traffic; "–" where a run does not use the
    axis (size 1)."""
    spec = axis_tables()[axis]
    runs = add_series(runs)
    runs = runs.assign(step_s=runs["sim_time_s"] / pd.to_numeric(runs["steps_done"], errors="coerce"))
    columns = setting_columns(runs)
    rows = []
    for (setting, group), (_, st) in zip(setting_groups(runs), settings(runs, "accuracy").iterrows()):
        done = group[group["status"] == "completed"]
        base = runs.loc[baseline_runs(runs, setting).index, "step_s"].dropna()
        step = done["step_s"].dropna()
        used = uses_axis(group.iloc[0], axis)
        rows.append({
            "loss": _loss_cell(setting, group.iloc[0]),
            **{d.name: d.value(group.iloc[0]) for d in columns},
            "accuracy (%)": _pm(st["mean"], st["ci"], int(st["n"])),
            "vs no loss, paired (pp)": _comparison_cells(st)["vs no loss, paired (pp)"],
            "p (paired)": _comparison_cells(st)["p (paired)"],
            "time per step (ms)": _ms_cell(done, "step_s"),
            "x no loss": f"{step.mean() / base.mean():.3f}" if len(step) and len(base) else NOT_APPLICABLE,
            **{name: _ms_cell(done, column, scale) if used else NOT_APPLICABLE
               for name, (column, scale) in spec.extra.items()},
            f"{spec.label} per step (ms)": _ms_cell(done, f"{axis}_s_per_step") if used else NOT_APPLICABLE,
            f"observed {spec.label} loss (%)": _ms_cell(done, f"observed_loss_rate_{axis}", 100) if used
            else NOT_APPLICABLE,
            "n": int(st["n"]),
            "_paired": st["paired_delta"] if st["loss_model"] != "none" else math.nan,
            "_setting": ", ".join([_loss_cell(setting, group.iloc[0]),
                                   *(_named(d.name, d.value(group.iloc[0])) for d in columns)]),
        })
    return pd.DataFrame(rows)


def pipeline_table(runs: pd.DataFrame) -> pd.DataFrame:
    """``axis_table`` of the pipeline's stages."""
    return axis_table(runs, "pp").drop(columns=HIDDEN)


def most_fragile(table: pd.DataFrame) -> Optional[pd.Series]:
    """The row of an ``axis_table`` whose accuracy fell furthest below its loss-free runs' (paired by
    seed); None when no lossy setting has a paired difference."""
    paired = pd.to_numeric(table["_paired"], errors="coerce").dropna()
    return table.loc[paired.idxmin()] if len(paired) else None


def _named(name: str, value) -> str:
    """A setting's column and value for a sentence ("transport drop"), the value alone where it names
    itself ("pp_size=2")."""
    return str(value) if str(value).startswith(name) else f"{name} {value}"


def uses_axis(row, axis: str) -> bool:
    """Whether a run (or a setting's first run) uses a parallelism: its size above 1, or, where summary.csv
    left the size out (every run of the sweep shares it), its time per step recorded (runs with the axis
    only)."""
    size = pd.to_numeric(row.get(axes.get(axis).size), errors="coerce")
    if pd.notna(size):
        return bool(size > 1)
    return bool(pd.notna(pd.to_numeric(row.get(f"{axis}_s_per_step"), errors="coerce")))


def _staged(row) -> bool:
    """Whether a run (or a setting's first run) has pipeline stages."""
    return uses_axis(row, "pp")


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
