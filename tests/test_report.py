"""Reports: plots and tables from a sweep's run directories (fake trainer: known accuracies)."""
from __future__ import annotations

import shutil

import numpy as np
import pandas as pd
import pytest
from matplotlib.image import imread

from lossysim import cli, report, sweep
from lossysim.config import from_dict
from test_sweep import Recorder, fake_accuracy, write_spec

LOSSES = ["none", "bernoulli:0.01", "bernoulli:0.05", "ge:rate=0.01,burst=8", "ge:rate=0.05,burst=8"]


def failing_at_20_percent(config):
    return "failed" if config.loss == "bernoulli:0.2" and config.seed == 1 else "completed"


@pytest.fixture
def results(tmp_path, monkeypatch):
    """A fake sweep: two loss models, two seeds, lossy directions varied, one failed run."""
    rec = Recorder(failing_at_20_percent)
    monkeypatch.setattr(sweep, "_default_train", lambda: rec)
    spec_path = write_spec(tmp_path / "s.yaml", [
        {"loss": LOSSES + ["bernoulli:0.2"], "seed": [0, 1]},
        {"loss": ["bernoulli:0.05"], "lossy": ["fwd", "bwd"], "seed": [0, 1]},
    ])
    out = tmp_path / "results"
    assert cli.main(["sweep", str(spec_path), "--out", str(out), "--no-progress"]) == 1
    return out


def expected(loss: str, seeds=(0, 1)) -> tuple[float, float]:
    values = [100 * fake_accuracy(from_dict({"loss": loss, "seed": s})) for s in seeds]
    return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def test_report_writes_plots_and_tables(results, capsys):
    (results / "summary.csv").unlink()   # the report must rebuild it from the run directories
    assert cli.main(["report", str(results)]) == 0
    printed = capsys.readouterr().out
    for name in report.PLOTS:
        path = results / name
        assert path.is_file() and path.stat().st_size > 10_000, name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        pixels = imread(path)
        assert pixels.shape[0] > 200 and pixels.shape[1] > 300 and pixels.std() > 0.01, f"{name} is blank"
    md = (results / "report.md").read_text()
    assert "synthetic" in md and "synthetic" in printed
    for name in report.PLOTS:
        assert f"({name})" in md
    # The pivot: rates down, loss models across, accuracy mean ± std over the seeds.
    mean, std = expected("none")
    assert f"| 0 (no loss)" in md and f"{mean:.1f} ± {std:.1f}" in md
    for loss, column in (("bernoulli:0.05", "Bernoulli"), ("ge:rate=0.05,burst=8", "Gilbert-Elliott (burst 8)")):
        mean, std = expected(loss)
        assert f"{mean:.1f} ± {std:.1f}" in md, loss
    pivot_lines = [l for l in md.splitlines() if l.startswith("| 5 ")]
    assert len(pivot_lines) == 1, "Bernoulli and Gilbert-Elliott at 5% belong to one row"
    frame = pd.read_csv(results / "summary.csv")
    assert len(frame) == len(list(results.glob("*/summary.json"))) == 16


def test_summary_table_rows_and_counts(results):
    runs = report.load_runs(results)
    table = report.summary_table(runs)
    # One row per (loss model, rate, burst, lossy): 6 settings with lossy=both, 2 with fwd/bwd.
    assert len(table) == 6 + 2
    row = table[(table["loss model"] == "Gilbert-Elliott") & (table["rate (%)"] == "5")].iloc[0]
    mean, std = expected("ge:rate=0.05,burst=8")
    assert row["accuracy (%)"] == f"{mean:.1f} ± {std:.1f}"
    assert row["mean burst"] == "8" and row["runs"] == 2 and row["failed"] == 0
    failed = table[(table["loss model"] == "Bernoulli") & (table["rate (%)"] == "20")].iloc[0]
    assert failed["runs"] == 2 and failed["failed"] == 1
    # Only the completed seed counts towards the mean: no "±" with a single run.
    assert failed["accuracy (%)"] == f"{expected('bernoulli:0.2', seeds=(0,))[0]:.1f}"
    assert float(row["observed loss (%)"]) == pytest.approx(5.0, rel=0.01)


def test_fwd_vs_bwd_plot_only_when_the_sweep_varies_it(results, tmp_path):
    runs = report.load_runs(results)
    assert report.plot_fwd_vs_bwd(runs) is not None
    only_both = results.parent / "only_both"
    only_both.mkdir()
    for _, run in runs[runs["lossy"] == "both"].iterrows():
        shutil.copytree(results / run["run_dir"], only_both / run["run_dir"])
    written = report.write_report(only_both, tmp_path / "elsewhere")
    names = {p.name for p in written["files"]}
    assert "fwd_vs_bwd.png" not in names and "accuracy_vs_loss.png" in names
    assert not (only_both / "summary.csv").exists(), "--out elsewhere leaves the results folder alone"


def test_shards_merge_in_the_report(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "_default_train", lambda: Recorder())
    spec = write_spec(tmp_path / "s.yaml", {"loss": LOSSES, "seed": [0, 1]})
    out = tmp_path / "merged"
    for k in (1, 2):
        assert cli.main(["sweep", str(spec), "--out", str(out), "--shard", f"{k}/2", "--no-progress"]) == 0
    written = report.write_report(out)
    assert len(written["runs"]) == 10 and set(written["runs"]["status"]) == {"completed"}
    assert len(pd.read_csv(out / "summary.csv")) == 10


def test_report_of_an_empty_folder_fails_cleanly(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "no finished runs" in capsys.readouterr().err


def test_synthetic_data_is_labelled_synthetic():
    assert "synthetic" in sweep.dataset_display({"dataset": "nli-toy"}, {"dataset": "synthetic"})
    assert sweep.dataset_display({"dataset": "MNLI (GLUE)"}, {"dataset": "mnli"}) == "MNLI (GLUE)"
