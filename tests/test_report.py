"""Reports: plots and tables from a sweep's run directories (fake trainer: known accuracies)."""
from __future__ import annotations

import math
import shutil

import numpy as np
import pandas as pd
import pytest
from matplotlib.image import imread
from scipy import stats

from lossysim import cli
from lossysim.results import report, table
from lossysim.run import sweep
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


def accuracies(loss: str, seeds=(0, 1)) -> list[float]:
    return [100 * fake_accuracy(from_dict({"loss": loss, "seed": s})) for s in seeds]


def expected(loss: str, seeds=(0, 1)) -> tuple[float, float]:
    """Mean and 95% Student-t half-width t_{0.975, n-1} s / sqrt(n), from the closed form."""
    values = accuracies(loss, seeds)
    if len(values) < 2:
        return float(np.mean(values)), 0.0
    half = stats.t.ppf(0.975, len(values) - 1) * np.std(values, ddof=1) / np.sqrt(len(values))
    return float(np.mean(values)), float(half)


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
    # The pivot: rates down, loss models across, accuracy mean ± 95% CI over the seeds.
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
    mean, half = expected("ge:rate=0.05,burst=8")
    assert row["accuracy (%)"] == f"{mean:.1f} ± {half:.1f}" and row["n"] == 2
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
    assert "synthetic" in table.dataset_display({"dataset": "nli-toy"}, {"dataset": "synthetic"})
    assert table.dataset_display({"dataset": "MNLI (GLUE)"}, {"dataset": "mnli"}) == "MNLI (GLUE)"


def test_settings_compare_each_with_its_loss_free_baseline(results):
    """Welch's p against the no-loss runs, as scipy computes it; * where p < 0.05, in table and pivot."""
    runs = report.load_runs(results)
    table = report.settings(runs)
    base = accuracies("none")
    for loss, lossy in (("bernoulli:0.01", "both"), ("bernoulli:0.05", "both"), ("ge:rate=0.05,burst=8", "both"),
                        ("bernoulli:0.05", "fwd")):
        model = sweep.parse_loss_model(loss)
        row = table[(table["loss_rate"].round(6) == round(model.loss_rate, 6)) & (table["lossy"] == lossy)
                    & (table["mean_burst"].round(3) == round(model.mean_burst, 3))].iloc[0]
        want = stats.ttest_ind(accuracies(loss), base, equal_var=False).pvalue
        assert row["p"] == pytest.approx(want, rel=1e-9), loss
        assert row["significant"] == (want < 0.05)
        assert row["delta"] == pytest.approx((np.mean(accuracies(loss)) - np.mean(base)) / 100)
    # 5% Bernoulli loses 5 points on a spread of 0.7: significant; 1% loses 1 point: not.
    significant = dict(zip(table["loss_rate"].round(4).astype(str) + table["loss_model"] + table["lossy"],
                           table["significant"]))
    assert significant["0.05bernoulliboth"] and not significant["0.01bernoulliboth"]
    assert table[table["loss_model"] == "none"]["p"].isna().all()
    md_table = report.summary_table(runs)
    starred = md_table[md_table["p (Welch)"].str.endswith("*")]
    assert set(zip(starred["loss model"], starred["rate (%)"])) >= {("Bernoulli", "5"), ("Gilbert-Elliott", "5")}
    assert not any(md_table[(md_table["loss model"] == "Bernoulli") & (md_table["rate (%)"] == "1")]["p (Welch)"]
                   .str.endswith("*"))
    pivot = report.accuracy_pivot(runs)
    row5 = pivot[pivot["loss rate (%)"] == "5"].iloc[0]
    column = "Bernoulli, lossy=both"
    assert row5[column].endswith(" *") and not pivot[pivot["loss rate (%)"] == "1"].iloc[0][column].endswith("*")


def test_one_seed_gives_no_interval_and_no_test(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "_default_train", lambda: Recorder())
    spec = write_spec(tmp_path / "s.yaml", {"loss": ["none", "bernoulli:0.05"], "seed": [0]})
    assert cli.main(["sweep", str(spec), "--out", str(tmp_path / "r"), "--no-progress"]) == 0
    table = report.settings(report.load_runs(tmp_path / "r"))
    assert (table["n"] == 1).all() and table["ci"].isna().all() and table["p"].isna().all()
    assert not table["significant"].any()


def test_steps_to_target_from_metrics_when_the_summary_lacks_it(results):
    """The fake runs' matched accuracy rises linearly from 34% to its final value over 4 steps,
    evaluated at steps 2 and 4: reaching 80% at step 2 needs a final value >= 126%, never; at
    step 4 it needs a final >= 80%."""
    frame = pd.read_csv(results / "summary.csv")
    done = frame[frame["status"] == "completed"]
    assert (done["target_accuracy"] == 0.8).all()
    for _, row in done.iterrows():
        final = row["final_accuracy_validation_matched"]
        if final >= 0.8:
            assert row["steps_to_target"] == 4, row["run_dir"]
        else:
            assert math.isnan(row["steps_to_target"]), row["run_dir"]
    table = report.summary_table(report.load_runs(results))
    assert table[table["loss model"] == "no loss"].iloc[0]["steps to target"] == "4 ± 0 (2/2 reached)"
    assert table[(table["loss model"] == "Bernoulli") & (table["rate (%)"] == "20")].iloc[0][
        "steps to target"] == "not reached (0/1 reached)"


def _timed_runs():
    """Two seeds of a loss-free baseline and of a slower lossy setting, with known clocks."""
    runs, metrics = [], []
    for setting, (speed, accs) in {"none": (1.0, [0.5, 0.8, 0.9]), "bernoulli:0.05": (3.0, [0.4, 0.7, 0.9])}.items():
        for seed in (0, 1):
            run_dir = f"{setting}-{seed}"
            lossy = setting != "none"
            runs.append({"run_dir": run_dir, "status": "completed", "loss": setting, "seed": seed,
                         "loss_model": "bernoulli" if lossy else "none", "loss_rate": 0.05 if lossy else 0.0,
                         "mean_burst": 1.05 if lossy else 0.0, "transport": "retransmit" if lossy else "drop",
                         "accuracy": accs[-1], "eval_split": "validation_matched",
                         "comm_s_per_step": 0.001 * speed, "dataset_name": "synthetic"})
            for i, acc in enumerate(accs):
                step = 10 * (i + 1)
                metrics.append({"run_dir": run_dir, "split": "validation_matched", "eval_split": "validation_matched",
                                "step": step, "accuracy": acc + 0.01 * seed, "sim_time_s": speed * step * (1 + seed)})
    return pd.DataFrame(runs), pd.DataFrame(metrics)


def test_time_to_accuracy_table_against_hand_computed_times():
    runs, metrics = _timed_runs()
    table, target = report.time_to_accuracy_table(runs, metrics, fraction=0.85)
    assert target == pytest.approx(0.85 * 0.9)                  # 76.5%: reached at the third evaluation
    base, lossy = table.iloc[0], table.iloc[1]
    assert base["setting"].startswith("no loss") and base["reached"] == "2/2"
    # baseline: seeds reach 76.5% at step 20 (0.8, 0.81), times 20 and 40; lossy: step 30, times 90 and 180
    est = report.mean_ci([90.0, 180.0])
    assert lossy["time to target (ms)"] == report._pm(est.mean, est.half_width, 2, scale=1e3, digits=3)
    assert lossy["x baseline"] == f"{135 / 30:.2f}" and lossy["steps"] == "30" and base["steps"] == "20"
    ax = report.plot_accuracy_vs_time(metrics, runs)
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert len(lines) == 2 and ax.get_xscale() == "log"
    lossy_line = next(line for label, line in lines.items() if "Bernoulli" in label)
    assert list(lossy_line.get_xdata()) == [45.0, 90.0, 135.0]   # mean simulated time over the seeds


def test_time_section_is_first_in_the_report(tmp_path):
    runs, metrics = _timed_runs()
    inputs = report.ReportInputs(tmp_path, runs, metrics)
    assert report.SECTIONS[1] is report.section_time_to_accuracy  # right after the overview
    text = report.section_time_to_accuracy(inputs)
    assert text.startswith("## Time to reach 81.0% accuracy") and "| no loss" in text, text
    assert report.section_time_to_accuracy(report.ReportInputs(tmp_path, runs, metrics.drop(columns="sim_time_s"))) == ""
    assert list(report.PLOTS)[0] == "accuracy_vs_time.png"
