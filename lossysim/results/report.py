"""``lossysim report``: plots, report.md and a merged summary.csv from a results folder (the run directories
of sweeps). What it reads (``load``), computes (``compare``, ``tables``), draws (``plots``) and writes
(``sections``) live in modules of their own; this one writes the files and is the command line."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Union

import pandas as pd
from matplotlib.figure import Figure

from ..io import atomic_write_text, check_writable, output_errors
from . import perplexity
from .collectives import collectives_table
from .compare import settings
from .load import dataset_title, load_metrics, load_runs, split_name
from .plots import (
    plot_accuracy_over_steps,
    plot_accuracy_vs_loss,
    plot_accuracy_vs_time,
    plot_disagreement,
    plot_fwd_vs_bwd,
    plot_observed_vs_configured,
)
from .sections import ReportInputs, sections
from .settings import to_markdown
from .table import write_summary_csv
from .tables import accuracy_pivot, summary_table


def _save(figure_or_axes, path: Path) -> None:
    fig = figure_or_axes if isinstance(figure_or_axes, Figure) else figure_or_axes.figure
    fig.savefig(path, dpi=120)


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
    text = "\n".join([f"# Sweep report: {results.name}\n", *(section(inputs) for section in sections())])
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
    if not Path(args.results).is_dir():
        why = "is not a folder" if Path(args.results).exists() else "does not exist"
        raise ValueError(f"results folder '{args.results}' {why} (a sweep's --out: its run directories)")
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
