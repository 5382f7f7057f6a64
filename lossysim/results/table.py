"""summary.csv: one row per finished run directory, read from disk.

Rows are rebuilt from the run directories under a results folder (``summary.json``, and
``metrics.jsonl`` where a summary lacks something), so shards that wrote to one folder merge by
themselves, and reports, notebooks and the sweep read runs one way. Nothing here trains.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional, Union

import pandas as pd
import yaml

from .. import axes
from ..config import NON_SEMANTIC
from ..traffic import KINDS as TRAFFIC_KINDS, parse_kinds as traffic_kinds
from ..io import atomic_write_text, load_summary, read_jsonl, read_summary, run_status  # noqa: F401 (re-exported)
from ..loss import parse_loss_model
from ..loss.spec import family
from .stats import DEFAULT_TARGET, time_to_target

# How a run ends (``run.summary``): finished (any but failed) or failed; and what its summary.json always holds
# then, by type. A summary without them (hand-edited, or half of one) is no run to report.
FINISHED = ("completed", "diverged", "gave_up")
STATUSES = (*FINISHED, "failed")
NEEDED = {"config": dict, "steps": int, "final": dict}
# Always in summary.csv (the report groups by them); other config keys only when they vary.
KEY_COLUMNS = ("loss", "lossy", "recovery", "tp_size", "pp_size", "seed", "model", "dataset", "backend")
PIPELINE_KEYS = ("pp_schedule", "microbatches")
# What each axis's summary.json section adds to a row (runs that use the axis only) is the axis's
# declaration's ``columns`` (``lossysim.axes``).


def _number(value: Any) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return math.nan
    return value


def _round(value: float, digits: int = 6) -> float:
    return float(f"{value:.{digits}g}") if math.isfinite(value) else value


def primary_split(splits) -> Optional[str]:
    """The split a single accuracy number refers to: MNLI's matched one, else the first."""
    splits = list(splits)
    if "validation_matched" in splits:
        return "validation_matched"
    return splits[0] if splits else None


def dataset_display(summary: dict, config: dict) -> str:
    name = summary.get("dataset") or str(config.get("dataset", ""))
    # Never let a synthetic task pass for a real benchmark in a table or a plot title.
    if str(config.get("dataset")) == "synthetic" and "synthetic" not in name:
        name = f"{name} (synthetic)"
    return name


def summary_row(run_dir: Path, summary: dict, results: Path) -> dict:
    """One flat row of summary.csv: the run's config and its numbers."""
    config = dict(summary.get("config") or {})
    if not config and (run_dir / "config.yaml").is_file():
        config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    try:
        model = parse_loss_model(config.get("loss", "none"))
    except ValueError:
        model = None
    row: dict[str, Any] = {"run_dir": str(run_dir.relative_to(results)), "status": summary.get("status"),
                           "error": summary.get("error")}
    config.setdefault("pp_size", 1)   # a run from before pipelines had one stage
    row.update({f"config.{k}": v for k, v in config.items()})
    row["dataset_name"] = dataset_display(summary, config)
    if model is None:
        row.update(loss_model="unknown", loss_rate=math.nan, mean_burst=math.nan)
    else:
        row["loss_model"] = family(model)
        # Rounded: a Gilbert-Elliott rate comes back from its chain's probabilities as 0.0499999...,
        # and must group with Bernoulli's 0.05 in tables and plots.
        row["loss_rate"] = _round(model.loss_rate)
        row["mean_burst"] = _round(model.mean_burst)
    row["steps_done"] = summary.get("steps")
    row["wall_time_s"] = _number(summary.get("wall_time_s"))
    row["tokens_per_s"] = _number(summary.get("tokens_per_s"))
    row["diverged_at"] = (summary.get("diverged_at") or {}).get("step")
    final, best = summary.get("final") or {}, summary.get("best") or {}
    for split in final:
        row[f"final_accuracy_{split}"] = _number((final.get(split) or {}).get("accuracy"))
        row[f"final_loss_{split}"] = _number((final.get(split) or {}).get("loss"))
    for split in best:
        row[f"best_accuracy_{split}"] = _number((best.get(split) or {}).get("accuracy"))
    split = primary_split(final)
    row["eval_split"] = split
    row["accuracy"] = row.get(f"final_accuracy_{split}", math.nan)
    row["best_accuracy"] = row.get(f"best_accuracy_{split}", math.nan)
    if config.get("task") == "lm":   # the eval loss is the mean negative log-likelihood per token
        row["perplexity"] = math.exp(row.get(f"final_loss_{split}", math.nan))
    reached = _time_to_target(run_dir, summary, config, split)
    row["target_accuracy"] = _number(reached.get("target"))
    row["steps_to_target"] = _number(reached.get("step"))
    row["sim_time_to_target_s"] = _number(reached.get("sim_time_s"))
    row["sim_time_to_target_s_ideal_nic"] = _number(reached.get("sim_time_s_ideal_nic"))
    lossy = config.get("lossy", "both")
    lossy_dirs = ("fwd", "bwd") if lossy == "both" else (lossy,)
    kinds = _traffic_kinds(config)
    lossy_dirs = tuple(d for d in lossy_dirs if {"fwd": "tp_forward", "bwd": "tp_backward"}[d] in kinds)
    data_parallel = summary.get("data_parallel")
    sent = lost = 0
    if data_parallel and "dp" in kinds:   # gradient buckets between replicas lose packets too
        sent, lost = data_parallel.get("packets_sent_dp") or 0, data_parallel.get("packets_lost_dp") or 0
    pipeline = summary.get("pipeline")
    pp_dirs = tuple(d for d in ("fwd", "bwd") if {"fwd": "pp_forward", "bwd": "pp_backward"}[d] in kinds)
    for axis in axes.AXES:   # (a run before summary.json's ``traffic``) each axis's classes' lossy directions
        section = summary.get(axis.summary) if axis.summary and axis.name != "dp" else None
        for cls in axis.classes if isinstance(section, dict) else ():
            for d in cls.directions:
                if d.key in kinds:
                    sent += section.get(f"packets_sent_{cls.name}_{d.direction}") or 0
                    lost += section.get(f"packets_lost_{cls.name}_{d.direction}") or 0
    for entry in (summary.get("packets") or {}).get("train") or []:
        d = entry.get("direction")
        for name in ("configured_loss_rate", "observed_loss_rate",
                     "configured_mean_burst", "observed_mean_burst"):
            row[f"{name}_{d}"] = _number(entry.get(name))
        if d in lossy_dirs:
            sent += entry.get("sent") or 0
            lost += entry.get("lost") or 0
    classes = summary.get("traffic")
    if isinstance(classes, dict):   # every class's lossy directions, as the run declared them (lossysim.traffic)
        lossy = [d for per in classes.values() if isinstance(per, dict) for d in per.values()
                 if isinstance(d, dict) and d.get("lossy")]
        sent, lost = sum(d.get("sent") or 0 for d in lossy), sum(d.get("lost") or 0 for d in lossy)
    row["observed_loss_rate"] = lost / sent if sent else math.nan
    by_class: dict[str, list] = {}
    boundaries = [(entry, pp_dirs) for entries in ((pipeline or {}).get("packets_by_boundary") or [])
                  for entry in entries or []]
    stages = [(entry, lossy_dirs) for entry in (summary.get("packets_by_class") or {}).get("train") or []]
    for entry, dirs in stages + boundaries:
        if entry.get("direction") in dirs:
            counts = by_class.setdefault(entry.get("link_class"), [0, 0])
            counts[0] += entry.get("sent") or 0
            counts[1] += entry.get("lost") or 0
    for link_class, (class_sent, class_lost) in sorted(by_class.items()):
        row[f"observed_loss_rate_{link_class}"] = class_lost / class_sent if class_sent else math.nan
    sim_time = summary.get("sim_time") or {}
    row["sim_time_s"] = _number(sim_time.get("total_s"))
    row["sim_time_s_ideal_nic"] = _number(sim_time.get("total_s_ideal_nic"))
    for name in ("comm_s_per_step", "ideal_comm_s_per_step", "retransmit_s_per_step", "compute_s_per_step",
                 "retransmitted_packets", "missing_packets", "failures", "timeouts_intra", "timeouts_inter"):
        row[name] = _number(sim_time.get(name))
    # restart_s is also the setting (seconds per restart); the total the run was charged gets its own name,
    # or it would overwrite the setting and split every lossy group by its own outcome.
    row["restart_total_s"] = _number(sim_time.get("restart_s"))
    disagreement = summary.get("disagreement") or {}
    row["disagreement"] = _number(disagreement.get("final_eval"))
    row["disagreement_train"] = _number(disagreement.get("mean_train"))
    row["hidden_rel_diff"] = _number(disagreement.get("final_eval_hidden_rel_diff"))
    for axis in axes.AXES:   # only runs that use an axis have its columns
        section = summary.get(axis.summary) if axis.summary else None
        if section:
            row.update({c.name: _number(section.get(c.key)) if c.number else section.get(c.key)
                        for c in axis.columns})
    return row


def _traffic_kinds(config: dict) -> tuple[str, ...]:
    """The kinds of traffic (``lossy_traffic``) a run let lose packets; all for runs before the key."""
    try:
        return traffic_kinds(config.get("lossy_traffic", "all"))
    except ValueError:
        return TRAFFIC_KINDS


def _time_to_target(run_dir: Path, summary: dict, config: dict, split: Optional[str]) -> dict:
    """The run's own record when it has one, else worked out from its metrics.jsonl."""
    if isinstance(summary.get("time_to_accuracy"), dict):
        return summary["time_to_accuracy"]
    target = _number(config.get("target_accuracy", DEFAULT_TARGET))
    try:
        rows = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    except (OSError, ValueError):
        rows = []
    return time_to_target(rows, target if math.isfinite(target) else DEFAULT_TARGET, split)


def incomplete(summary: dict) -> Optional[str]:
    """Why ``summary`` is no run to report (None when it is one): no known status, or something its
    status always records missing or of another type."""
    status = summary.get("status")
    if status not in STATUSES:
        return f"summary.json has no known status ({status!r}; {', '.join(STATUSES)})"
    for key, kind in (NEEDED if status in FINISHED else {"config": dict}).items():
        value = summary.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            what = "no" if value is None else f"a {type(value).__name__} as its"
            return f"summary.json of a {status} run has {what} {key}"
    return None


def collect(results: Union[str, Path], problems: Optional[dict] = None) -> pd.DataFrame:
    """summary.csv's table, built from every finished run directory under ``results``; ``problems`` gets
    run directory -> why, for each run left out: its summary.json cannot be read, is incomplete
    (``incomplete``) or holds something of an unexpected shape."""
    results = Path(results)
    problems = {} if problems is None else problems
    rows = []
    for path in sorted(results.glob("*/summary.json")):
        summary, why = load_summary(path.parent)
        why = why or incomplete(summary)
        if why is None:
            try:
                rows.append(summary_row(path.parent, summary, results))
            except (TypeError, AttributeError, KeyError, ValueError) as err:   # a field of another shape
                first = str(err).strip().splitlines()[0] if str(err).strip() else ""
                why = f"summary.json holds something of an unexpected shape ({type(err).__name__}: {first})"
        if why is not None:
            problems[path.parent.name] = why
    frame = pd.DataFrame(rows)
    if frame.empty:
        return pd.DataFrame(columns=["run_dir", "status", *KEY_COLUMNS])
    config_cols = [c for c in frame.columns if c.startswith("config.")]
    # A pipeline's schedule and micro-batches say what ran even when every run shares them.
    staged = set(PIPELINE_KEYS) if (pd.to_numeric(frame["config.pp_size"], errors="coerce") > 1).any() else set()
    keep = [c for c in config_cols if c[7:] in KEY_COLUMNS or c[7:] in staged
            or (c[7:] not in NON_SEMANTIC and frame[c].astype(str).nunique(dropna=False) > 1)]
    keep.sort(key=lambda c: (KEY_COLUMNS.index(c[7:]) if c[7:] in KEY_COLUMNS else len(KEY_COLUMNS), c))
    frame = frame.drop(columns=[c for c in config_cols if c not in keep])
    frame = frame.rename(columns={c: c[7:] for c in keep})
    head = ["run_dir", "status", "dataset_name", *[c[7:] for c in keep], "loss_model", "loss_rate",
            "mean_burst"]
    frame = frame[head + [c for c in frame.columns if c not in head]]
    order = [c for c in ("loss_model", "loss_rate", "mean_burst", "lossy", "recovery", "tp_size",
                         "seed", "run_dir") if c in frame.columns]
    return frame.sort_values(order, kind="stable").reset_index(drop=True)


def write_summary_csv(results: Union[str, Path]) -> pd.DataFrame:
    """summary.csv rebuilt from the run directories. A run still there that gives no row now (its summary
    damaged, incomplete, or being rewritten) keeps its row from the summary.csv replaced, marked ``stale``:
    that row may be the last readable copy of its results."""
    results = Path(results)
    frame = collect(results)
    stale = _stale_rows(results, set(frame["run_dir"].astype(str)))
    if len(stale):
        frame = pd.concat([frame.assign(stale=False), stale.assign(stale=True)], ignore_index=True)
    atomic_write_text(results / "summary.csv", frame.to_csv(index=False))
    return frame


def _stale_rows(results: Path, fresh: set) -> pd.DataFrame:
    """The rows of ``results``' summary.csv whose run directory is still there but not among ``fresh``."""
    try:
        old = pd.read_csv(results / "summary.csv")
    except (OSError, ValueError):   # none yet, or unreadable: nothing to keep
        return pd.DataFrame()
    if "run_dir" not in old.columns:
        return pd.DataFrame()
    kept = [str(d) not in fresh and (results / str(d)).is_dir() for d in old["run_dir"]]
    return old[kept]
