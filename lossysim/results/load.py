"""Loading a results folder for a report: its runs (summary.csv's table, rebuilt from the run directories,
so shards that wrote to one folder are reported together) and their metrics, and how a report names the
dataset and the eval split."""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import pandas as pd

from ..io import expected_runs, read_jsonl
from .labels import LOSS_MODEL
from .settings import CONFIG_KEYS, series_reference
from .table import collect


# What a run directory holds before its summary.json (the sweep writes config.yaml first).
RUN_FILES = ("config.yaml", "metrics.jsonl", "checkpoints")


def load_runs(results: Union[str, Path], problems: Optional[dict[str, str]] = None) -> pd.DataFrame:
    """One row per finished run under ``results`` (summary.csv's table, rebuilt from disk); ``problems``
    gets run directory -> why, for each run left out (``table.collect``) or not complete (``unfinished``)."""
    results = Path(results)
    runs = collect(results, problems)
    if problems is not None:
        problems.update(unfinished(results))
    if runs.empty and (results / "summary.csv").is_file():
        runs = pd.read_csv(results / "summary.csv")
    if runs.empty:
        raise ValueError(f"no finished runs (*/summary.json) under {results}")
    return runs


def unfinished(results: Path) -> dict[str, str]:
    """Run directory -> why, for each run that is not complete: a run directory without summary.json
    (interrupted, or still running), and each run sweep.yaml expects that has no directory."""
    found = {}
    for path in sorted(p for p in results.iterdir() if p.is_dir()):
        if not (path / "summary.json").exists() and any((path / name).exists() for name in RUN_FILES):
            resumes = " from its last checkpoint" if (path / "checkpoints").is_dir() else ""
            found[path.name] = (f"no summary.json: the run did not finish (interrupted, or still running); "
                                f"the same sweep command finishes it{resumes}")
    for name in expected_runs(results):
        if not (results / name).exists():
            found[name] = "never started: sweep.yaml expects it; the same sweep command runs it"
    return found


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


def reference_note(runs: pd.DataFrame) -> str:
    """The values series labels leave out, for a caption: "ring, drop, 2 nodes x 1 rank"."""
    dims, ref = series_reference(runs)
    return ", ".join(ref[d.name] for d in dims if d is not LOSS_MODEL)
