"""Reports: plots and tables from a sweep's run directories (fake trainer: known accuracies)."""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib.image import imread
from scipy import stats

from lossysim import cli
from lossysim.results import collectives, compare, labels, load, plots, report, sections, table, tables
from lossysim.results.stats import mean_ci
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
    assert cli.main(["sweep", str(spec_path), "--out", str(out), "--no-progress"]) == sweep.FAILED_EXIT
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
    for name in sections.PLOTS:
        path = results / name
        assert path.is_file() and path.stat().st_size > 10_000, name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        pixels = imread(path)
        assert pixels.shape[0] > 200 and pixels.shape[1] > 300 and pixels.std() > 0.01, f"{name} is blank"
    md = (results / "report.md").read_text()
    assert "synthetic" in md and "synthetic" in printed
    for name in sections.PLOTS:
        assert f"({name})" in md
    # The pivot: rates down, loss models across, accuracy mean ± 95% CI over the seeds.
    mean, std = expected("none")
    assert "| 0 (no loss)" in md and f"{mean:.1f} ± {std:.1f}" in md
    for loss, column in (("bernoulli:0.05", "Bernoulli"), ("ge:rate=0.05,burst=8", "Gilbert-Elliott (burst 8)")):
        mean, std = expected(loss)
        assert f"{mean:.1f} ± {std:.1f}" in md, loss
    pivot_lines = [l for l in md.splitlines() if l.startswith("| 5 ")]
    assert len(pivot_lines) == 1, "Bernoulli and Gilbert-Elliott at 5% belong to one row"
    frame = pd.read_csv(results / "summary.csv")
    assert len(frame) == len(list(results.glob("*/summary.json"))) == 16


def test_summary_table_rows_and_counts(results):
    runs = load.load_runs(results)
    table = tables.summary_table(runs)
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
    runs = load.load_runs(results)
    assert plots.plot_fwd_vs_bwd(runs) is not None
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


def test_report_of_a_folder_that_is_not_there_says_so(tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    for name, why in (("missing", "does not exist"), ("a-file", "is not a folder")):
        assert cli.main(["report", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err.strip()
        assert f"results folder '{tmp_path / name}' {why}" in err and "\n" not in err


def test_synthetic_data_is_labelled_synthetic():
    assert "synthetic" in table.dataset_display({"dataset": "nli-toy"}, {"dataset": "synthetic"})
    assert table.dataset_display({"dataset": "MNLI (GLUE)"}, {"dataset": "mnli"}) == "MNLI (GLUE)"


def test_settings_compare_each_with_its_loss_free_baseline(results):
    """Welch's p against the no-loss runs, as scipy computes it; * where p < 0.05, in table and pivot."""
    runs = load.load_runs(results)
    table = compare.settings(runs)
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
    md_table = tables.summary_table(runs)
    starred = md_table[md_table["p (Welch)"].str.endswith("*")]
    assert set(zip(starred["loss model"], starred["rate (%)"])) >= {("Bernoulli", "5"), ("Gilbert-Elliott", "5")}
    assert not any(md_table[(md_table["loss model"] == "Bernoulli") & (md_table["rate (%)"] == "1")]["p (Welch)"]
                   .str.endswith("*"))
    pivot = tables.accuracy_pivot(runs)
    row5 = pivot[pivot["loss rate (%)"] == "5"].iloc[0]
    # lossy=both is the usual direction: the column names only the loss model.
    column = "Bernoulli"
    assert set(pivot.columns) == {"loss rate (%)", "Bernoulli", "Bernoulli, fwd only", "Bernoulli, bwd only",
                                  "Gilbert-Elliott (burst 8)"}
    assert "*" in row5[column] and "*" not in pivot[pivot["loss rate (%)"] == "1"].iloc[0][column]


def test_one_seed_gives_no_interval_and_no_test(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "_default_train", lambda: Recorder())
    spec = write_spec(tmp_path / "s.yaml", {"loss": ["none", "bernoulli:0.05"], "seed": [0]})
    assert cli.main(["sweep", str(spec), "--out", str(tmp_path / "r"), "--no-progress"]) == 0
    table = compare.settings(load.load_runs(tmp_path / "r"))
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
    table = tables.summary_table(load.load_runs(results))
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
    table, target = tables.time_to_accuracy_table(runs, metrics, fraction=0.85)
    assert target == pytest.approx(0.85 * 0.9)                  # 76.5%: reached at the third evaluation
    base, lossy = table.iloc[0], table.iloc[1]
    assert base["loss"] == "no loss" and lossy["loss"] == "5% Bernoulli" and base["reached"] == "2/2"
    # Nothing but the loss varies: no other setting column, nothing spelled key=value.
    assert "transport" not in table.columns
    assert not table.astype(str).apply(lambda c: c.str.contains("=")).any().any()
    # baseline: seeds reach 76.5% at step 20 (0.8, 0.81), times 20 and 40; lossy: step 30, times 90 and 180
    est = mean_ci([90.0, 180.0])
    # times of 20 s to 180 s read in seconds
    assert lossy["time to target (s)"] == tables._pm(est.mean, est.half_width, 2, scale=1.0, digits=3)
    assert lossy["x baseline"] == f"{135 / 30:.2f}" and lossy["steps"] == "30" and base["steps"] == "20"
    fig = plots.plot_accuracy_vs_time(metrics, runs)
    (ax,) = fig.axes                                            # nothing varies but the loss: one panel
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"no loss", "Bernoulli"} and ax.get_xscale() == "log"
    # mean simulated time over the seeds, 45 s, 90 s and 135 s, in seconds (the curves' median time: 45 s)
    assert list(lines["Bernoulli"].get_xdata()) == pytest.approx([45, 90, 135])
    assert "(s, log scale)" in ax.get_xlabel()


def test_time_section_is_first_in_the_report(tmp_path):
    runs, metrics = _timed_runs()
    inputs = sections.ReportInputs(tmp_path, runs, metrics)
    # Right after the overview and the runs that could not be read (no text when there are none).
    assert sections.SECTIONS[1:3] == [sections.section_problems, sections.section_time_to_accuracy]
    assert sections.section_problems(inputs) == ""
    text = sections.section_time_to_accuracy(inputs)
    assert text.startswith("## Accuracy against simulated time") and "### Time to reach 81.0% accuracy" in text
    assert "| no loss" in text, text
    with_plot = sections.ReportInputs(tmp_path, runs, metrics, [tmp_path / "accuracy_vs_time.png"])
    text = sections.section_time_to_accuracy(with_plot)
    assert text.index("](accuracy_vs_time.png)") < text.index("### Time to reach"), "the plot opens the section"
    assert sections.section_time_to_accuracy(sections.ReportInputs(tmp_path, runs, metrics.drop(columns="sim_time_s"))) == ""
    assert list(sections.PLOTS)[0] == "accuracy_vs_time.png"


# -- labels, panels and paired statistics on a sweep shaped like experiments/quick.yaml ------------------
QUICK_LIKE = [
    {"loss": ["none", "bernoulli:0.01", "bernoulli:0.05", "bernoulli:0.2", "ge:rate=0.05,burst=8"], "seed": [0, 1]},
    {"loss": ["bernoulli:0.05", "bernoulli:0.2"], "algorithm": ["direct"], "seed": [0, 1]},
    {"loss": ["bernoulli:0.01", "bernoulli:0.05", "bernoulli:0.2"], "transport": ["retransmit", "deadline"],
     "seed": [0, 1]},
    {"loss": ["none", "bernoulli:0.05"], "tp_size": [4], "ranks_per_node": [2], "lossy_links": ["inter_node"],
     "seed": [0, 1]},
]
QUESTIONS = ("Collective algorithm", "Transport", "Topology", "Burstiness")


@pytest.fixture
def quick_like(tmp_path, monkeypatch):
    """15 settings x 2 seeds as the quick profile asks them (fake trainer), and their metrics."""
    monkeypatch.setattr(sweep, "_default_train", lambda: Recorder())
    spec = write_spec(tmp_path / "q.yaml", QUICK_LIKE, tp_size=2, ranks_per_node=1, deadline=3.0)
    out = tmp_path / "quick"
    assert cli.main(["sweep", str(spec), "--out", str(out), "--no-progress"]) == 0
    runs = load.load_runs(out)
    return out, runs, load.load_metrics(out, runs)


def legend_labels(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_time_plot_has_a_panel_per_question_with_its_own_baselines(quick_like):
    _, runs, metrics = quick_like
    fig = plots.plot_accuracy_vs_time(metrics, runs)
    titles = [ax.get_title() for ax in fig.axes]
    assert len(fig.axes) == len(QUESTIONS), titles
    for ax, question in zip(fig.axes, QUESTIONS):
        assert ax.get_title().startswith(question)
    panel = dict(zip(QUESTIONS, fig.axes))
    # Each panel names only what varies in it: the question's answer and, where it varies, the rate.
    assert legend_labels(panel["Collective algorithm"]) == ["no loss", "ring, 5%", "ring, 20%", "direct, 5%",
                                                            "direct, 20%"]
    transport = legend_labels(panel["Transport"])
    assert transport[0] == "no loss" and len(transport) == 1 + 3 * 3
    assert {"drop, 1%", "retransmit, 20%", "deadline 3x, 5%"} <= set(transport)
    assert legend_labels(panel["Topology"]) == ["no loss, 2 nodes x 1 rank", "no loss, 2 nodes x 2 ranks",
                                                "2 nodes x 1 rank", "2 nodes x 2 ranks, loss between nodes"]
    assert legend_labels(panel["Burstiness"]) == ["no loss", "Bernoulli", "Gilbert-Elliott (burst 8)"]
    # What a panel holds is said once, under its title, and never on a line.
    assert "ring" in panel["Transport"].get_title() and "5% loss" in panel["Burstiness"].get_title()
    for ax in fig.axes:
        for label in legend_labels(ax):
            assert "=" not in label and "tp_size" not in label and "lossy_links" not in label, label
    for word, question in (("ring", "Transport"), ("Bernoulli", "Transport"), ("drop", "Collective algorithm"),
                           ("2 nodes", "Burstiness"), ("%", "Topology")):
        assert not any(word in label for label in legend_labels(panel[question])), (word, question)
    # Every legend sits beside its axes, clear of the curves.
    fig.canvas.draw()
    for ax in fig.axes:
        assert ax.get_legend().get_window_extent().x0 >= ax.get_window_extent().x1
    # A baseline line is the mean over the loss-free runs timed like the panel's settings.
    (tp4,) = [line for line in panel["Topology"].get_lines() if line.get_label() == "no loss, 2 nodes x 2 ranks"]
    want = metrics[(metrics["split"] == "validation_matched") & (metrics["loss_model"] == "none")
                   & (metrics["tp_size"] == 4)].groupby("step")["accuracy"].mean()
    assert list(tp4.get_ydata()) == pytest.approx(list(100 * want))


def test_time_plot_of_the_quick_profile_asks_its_four_questions(tmp_path, monkeypatch):
    """The main job's own spec, run by the fake trainer: the report opens with these four panels."""
    monkeypatch.setattr(sweep, "_default_train", lambda: Recorder())
    spec = Path(__file__).resolve().parents[1] / "experiments" / "quick.yaml"
    out = tmp_path / "quick"
    assert cli.main(["sweep", str(spec), "--out", str(out), "--set", "steps=4", "--set", "eval_every=2",
                     "--grid", "seed=0 1", "--no-progress"]) == 0
    runs = load.load_runs(out)
    fig = plots.plot_accuracy_vs_time(load.load_metrics(out, runs), runs)
    titles = [ax.get_title() for ax in fig.axes]
    for question in QUESTIONS:
        assert sum(t.startswith(question) for t in titles) == 1, (question, titles)


def test_tables_name_settings_readably(quick_like):
    _, runs, metrics = quick_like
    table, _ = tables.time_to_accuracy_table(runs, metrics)
    assert list(table.columns[:4]) == ["loss", "algorithm", "transport", "topology"]
    # "–": a loss-free run has nothing to send again
    assert set(table["transport"]) == {"–", "drop", "retransmit", "deadline 3x"}
    assert set(table["topology"]) == {"2 nodes x 1 rank", "2 nodes x 2 ranks",
                                      "2 nodes x 2 ranks, loss between nodes"}
    assert "5% Gilbert-Elliott (burst 8)" in set(table["loss"])
    summary = tables.summary_table(runs)
    # lossy and recovery are the same for every lossy setting: no column for them.
    assert "lossy direction" not in summary.columns and "recovery" not in summary.columns
    for frame in (table, summary, tables.accuracy_pivot(runs)):
        cells = frame.astype(str).to_numpy().ravel().tolist() + list(frame.columns)
        assert not [c for c in cells if "=" in c], frame
    pivot = tables.accuracy_pivot(runs)
    assert "Bernoulli, 2 nodes x 2 ranks, loss between nodes" in pivot.columns and "Bernoulli" in pivot.columns
    # each column's first row is its own baseline: the 2x2 layout's is the tp=4 loss-free run
    base = compare.settings(runs)
    tp4 = base[(base["loss_model"] == "none") & (base["tp_size"] == 4)].iloc[0]
    assert pivot.iloc[0]["Bernoulli, 2 nodes x 2 ranks, loss between nodes"] == tables._pm(tp4["mean"], tp4["ci"], 2)


def test_paired_view_finds_what_the_seed_spread_hides(results):
    """The fake accuracy moves 1 point per seed and 1% Bernoulli loss costs every seed 1 point: Welch's
    test sees two groups that overlap, the paired one a constant shift."""
    runs = load.load_runs(results)
    table = compare.settings(runs)
    row = table[(table["loss_model"] == "bernoulli") & (table["loss_rate"] == 0.01)].iloc[0]
    assert row["p"] > 0.05 and row["paired_p"] < 0.05 and row["paired_significant"]
    assert row["paired_delta"] == pytest.approx(-0.01) and row["paired_ci"] == pytest.approx(0.0, abs=1e-9)
    assert row["paired_n"] == 2
    summary = tables.summary_table(runs)
    cells = summary[(summary["loss model"] == "Bernoulli") & (summary["rate (%)"] == "1")].iloc[0]
    assert cells["vs no loss, paired (pp)"] == "-1.0 ± 0.0" and cells["p (paired)"].endswith("*")
    assert not cells["p (Welch)"].endswith("*")
    pivot = tables.accuracy_pivot(runs)
    assert pivot[pivot["loss rate (%)"] == "1"].iloc[0]["Bernoulli"].endswith("†")
    # 20% lost a seed: one pair left, no interval and no test
    failed = table[(table["loss_model"] == "bernoulli") & (table["loss_rate"] == 0.2)].iloc[0]
    assert failed["paired_n"] == 1 and math.isnan(failed["paired_p"]) and math.isnan(failed["paired_ci"])
    assert table[table["loss_model"] == "none"]["paired_p"].isna().all()


def test_paired_statistics_pair_runs_by_seed():
    """Hand-made runs in shuffled order, one lossy seed without a baseline: pairs are matched by seed,
    the numbers are scipy's."""
    base = {0: 0.80, 1: 0.90, 2: 0.95}
    lossy = {2: 0.94, 0: 0.78, 1: 0.885, 3: 0.70}
    rows = [{"run_dir": f"none-{s}", "status": "completed", "loss": "none", "loss_model": "none", "loss_rate": 0.0,
             "mean_burst": 0.0, "seed": s, "accuracy": a} for s, a in base.items()]
    rows += [{"run_dir": f"b-{s}", "status": "completed", "loss": "bernoulli:0.05", "loss_model": "bernoulli",
              "loss_rate": 0.05, "mean_burst": 1.05, "seed": s, "accuracy": a} for s, a in lossy.items()]
    row = compare.settings(pd.DataFrame(rows)).iloc[1]
    a, b = np.array([lossy[s] for s in (0, 1, 2)]), np.array([base[s] for s in (0, 1, 2)])
    assert row["paired_n"] == 3 and row["n"] == 4
    assert row["paired_delta"] == pytest.approx((a - b).mean())
    assert row["paired_ci"] == pytest.approx(stats.t.ppf(0.975, 2) * (a - b).std(ddof=1) / np.sqrt(3))
    assert row["paired_p"] == pytest.approx(stats.ttest_rel(a, b).pvalue, rel=1e-9)
    assert row["p"] == pytest.approx(stats.ttest_ind(list(lossy.values()), list(base.values()),
                                                     equal_var=False).pvalue, rel=1e-9)
    cells = tables.summary_table(pd.DataFrame(rows)).iloc[1]
    assert cells["vs no loss, paired (pp)"].endswith("(3 pairs)")


def settings_frame(**columns) -> pd.DataFrame:
    n = len(next(iter(columns.values())))
    base = {"loss_model": ["bernoulli"] * n, "loss_rate": [0.05] * n, "mean_burst": [1.05] * n}
    return pd.DataFrame({**base, **columns})


def test_comparisons_hold_the_other_questions_at_their_usual_value():
    # algorithm x transport fully crossed: a tie everywhere, broken by the config's defaults
    crossed = settings_frame(algorithm=["ring", "ring", "direct", "direct"],
                             transport=["drop", "retransmit", "drop", "retransmit"])
    panels = labels.comparisons(crossed)
    assert [p.question.name for p in panels] == ["algorithm", "transport"]
    assert panels[0].held == ["drop", "5% loss"] and panels[1].held == ["ring", "5% loss"]
    assert set(panels[0].settings["transport"]) == {"drop"} and set(panels[1].settings["algorithm"]) == {"ring"}
    # two keys changed together (as one grid row would) are one question, not two empty ones
    together = settings_frame(link_inter=["roce-200g", "roce-100g"], compute=["h100", "a100"])
    (panel,) = labels.comparisons(together)
    assert len(panel.settings) == 2 and "link" in panel.title and "compute" in panel.title
    # only the rate varies: one panel of everything, labelled by the rate alone
    rates = settings_frame(loss_rate=[0.01, 0.05, 0.2])
    (panel,) = labels.comparisons(rates)
    assert panel.question is None and len(panel.settings) == 3
    dims = labels.varying(panel.settings)
    assert [labels.describe(r, dims) for _, r in panel.settings.iterrows()] == ["1%", "5%", "20%"]


def test_labels_leave_out_what_is_equal_or_usual():
    frame = settings_frame(transport=["drop", "deadline", "retransmit"], deadline=[3.0, 3.0, 3.0],
                           retransmit=["selective", "selective", "go_back_n"], tp_size=[2, 2, 2])
    dims = labels.varying(frame)
    assert [d.name for d in dims] == ["transport"]            # deadline, tp_size: equal, not written
    ref = labels.reference(frame, dims)
    assert ref == {"transport": "drop"}
    named = [labels.describe(r, dims, ref) for _, r in frame.iterrows()]
    assert named == ["Bernoulli", "deadline 3x", "retransmit (go-back-N)"]
    lossless = {"loss_model": "none", "loss_rate": 0.0, "transport": "drop", "tp_size": 4, "ranks_per_node": 2,
                "lossy_links": "all"}
    topology = next(d for d in labels.KNOWN if d.name == "topology")
    assert labels.describe(lossless, [topology]) == "no loss, 2 nodes x 2 ranks"
    assert topology.value({**lossless, "loss_model": "ge", "lossy_links": "inter_node"}) == \
        "2 nodes x 2 ranks, loss between nodes"
    assert topology.value({"loss_model": "ge", "tp_size": 4, "ranks_per_node": None}) == "1 node x 4 ranks"


def test_a_runs_restart_total_does_not_overwrite_the_restart_setting(tmp_path):
    """restart_s is a setting (seconds per restart) and the run's charged total: the table keeps both apart, so
    runs that failed a different number of times still group as one setting."""
    import json
    for name, total in (("a", 600.4), ("b", 900.5)):
        run = tmp_path / name
        run.mkdir()
        summary = {"status": "completed", "steps": 1, "final": {},
                   "config": {"loss": "bernoulli:0.2", "seed": 0 if name == "a" else 1, "restart_s": 300.0},
                   "sim_time": {"total_s": 1.0 + total, "restart_s": total, "failures": total // 300}}
        (run / "summary.json").write_text(json.dumps(summary))
    frame = table.collect(tmp_path)
    assert sorted(frame["restart_total_s"]) == [600.4, 900.5]
    assert "restart_s" not in frame.columns or set(frame["restart_s"]) == {300.0}
    assert not any(c.endswith(".1") for c in frame.columns)


# -- pipelines: stages beside data and tensor parallelism -------------------------------------------------------
PP_TRAFFIC = "pp_forward,pp_backward"
PIPELINES = [
    # tp 1 x pp 2, a stage per node, loss on the boundary: 1F1B and GPipe, 2 and 4 micro-batches
    {"loss": ["none", "bernoulli:0.05"], "pp_size": [2], "pp_schedule": ["1f1b", "gpipe"], "microbatches": [2, 4],
     "lossy_traffic": [PP_TRAFFIC], "seed": [0, 1]},
    # the same rate on DP gradients (tp 1 x dp 2) and on TP traffic (tp 2)
    {"loss": ["none", "bernoulli:0.05"], "dp_size": [2], "lossy_traffic": ["dp"], "seed": [0, 1]},
    {"loss": ["none", "bernoulli:0.05"], "tp_size": [2], "lossy_traffic": ["tp_forward,tp_backward"], "seed": [0, 1]},
]


@pytest.fixture
def pipelines(tmp_path, monkeypatch):
    """Pipelines of 2 stages in four schedules beside dp and tp runs (fake trainer), and their table."""
    monkeypatch.setattr(sweep, "_default_train", lambda: Recorder())
    spec = write_spec(tmp_path / "p.yaml", PIPELINES, tp_size=1, ranks_per_node=1, lossy_links="inter_node",
                      batch_size=8)
    out = tmp_path / "pp"
    assert cli.main(["sweep", str(spec), "--out", str(out), "--no-progress"]) == 0
    return out, load.load_runs(out)


def layout(pp=1, m=None, schedule="1f1b", dp=1, tp=1, seed=0, loss="none"):
    return from_dict({"loss": loss, "seed": seed, "pp_size": pp, "microbatches": m, "pp_schedule": schedule,
                      "dp_size": dp, "tp_size": tp, "ranks_per_node": 1, "lossy_links": "inter_node",
                      "lossy_traffic": PP_TRAFFIC if pp > 1 else "dp" if dp > 1 else "tp_forward,tp_backward"})


LAYOUTS = {"pp 2 (1f1b, m=2)": dict(pp=2), "pp 2 (1f1b, m=4)": dict(pp=2, m=4),
           "pp 2 (gpipe, m=2)": dict(pp=2, schedule="gpipe"), "pp 2 (gpipe, m=4)": dict(pp=2, m=4, schedule="gpipe"),
           "dp": dict(dp=2), "tp": dict(tp=2)}


def test_pipeline_runs_are_named_and_compared_with_their_own_layouts_baseline(pipelines):
    out, runs = pipelines
    assert len(runs) == 2 * 2 * len(LAYOUTS)
    # summary.csv says which pipeline ran: stages always, schedule and micro-batches since some runs have stages
    csv = pd.read_csv(out / "summary.csv")
    assert {"pp_size", "pp_schedule", "microbatches"} <= set(csv.columns)
    assert sorted(csv["pp_size"].unique()) == [1, 2]
    assert any(name.startswith("bernoulli-0.05_tp1_pp2_gpipe_m4_seed1-") for name in csv["run_dir"])
    pipeline = next(d for d in labels.KNOWN if d.name == "pipeline")
    traffic = next(d for d in labels.KNOWN if d.name == "lossy traffic")
    lossy = runs[runs["loss_model"] != "none"]
    assert set(labels.values(lossy, pipeline)) == {*(k for k in LAYOUTS if k.startswith("pp")), "pp 1"}
    assert set(labels.values(lossy, traffic)) == {"PP traffic", "DP gradients", "TP traffic"}
    # Each lossy setting against the loss-free runs of its own layout: the fake's accuracies differ by layout
    # (stages, schedule, micro-batches, replicas), so any other baseline would move delta off the loss's -5 pp.
    table = compare.settings(runs)
    for name, kw in LAYOUTS.items():
        rows = table[(table["loss_model"] != "none") & table["series"].str.contains(name, regex=False)] \
            if name.startswith("pp") else None
        if rows is None:
            key = "dp_size" if name == "dp" else "tp_size"
            rows = table[(table["loss_model"] != "none") & (table[key] == 2)]
        (row,) = rows.itertuples()
        want = np.mean([fake_accuracy(layout(**kw, seed=s)) for s in (0, 1)])
        assert row.baseline_mean == pytest.approx(want, abs=1e-12), name
        assert row.delta == pytest.approx(-0.05, abs=1e-12) and row.paired_delta == pytest.approx(-0.05, abs=1e-12)


def test_pipeline_section_shows_accuracy_bubble_time_and_pp_loss_side_by_side(pipelines):
    out, runs = pipelines
    shown = tables.pipeline_table(runs)
    assert list(shown.columns[-6:]) == ["time per step (ms)", "x no loss", "bubble (%)", "PP per step (ms)",
                                        "observed PP loss (%)", "n"]
    pipeline = shown.columns.get_loc("pipeline")
    for p, m in ((2, 2), (2, 4)):
        for schedule in ("1f1b", "gpipe"):
            for loss, stretch, observed in (("no loss", 1.0, "0"), ("5% Bernoulli", 1.5, "5")):
                (row,) = [r for r in shown.itertuples(index=False)
                          if r[pipeline] == f"pp {p} ({schedule}, m={m})" and r[0] == loss]
                cells = dict(zip(shown.columns, row))
                # closed forms: bubble (p-1)/(m+p-1), a step (m+p-1)/(m p) of one stage's 1 ms, stretched by loss
                assert cells["bubble (%)"] == f"{100 * (p - 1) / (m + p - 1):.3g}"
                # printed to 3 significant digits: within half a unit of the third
                assert float(cells["time per step (ms)"]) == pytest.approx(stretch * (m + p - 1) / (m * p), rel=5e-3)
                assert cells["x no loss"] == f"{stretch:.3f}", "timed against its own layout's loss-free runs"
                assert cells["observed PP loss (%)"] == observed and cells["PP per step (ms)"] == "0"
    for row in shown[shown["pipeline"] == "pp 1"].itertuples(index=False):
        cells = dict(zip(shown.columns, row))
        assert [cells[c] for c in ("bubble (%)", "PP per step (ms)", "observed PP loss (%)")] == ["–"] * 3
        assert cells["x no loss"] == ("1.500" if cells["loss"] != "no loss" else "1.000")
    # The time table says "–", never nan or a pipeline's off-path traffic sum, where a figure does not apply.
    time_table, _ = tables.time_to_accuracy_table(runs, load.load_metrics(out, runs))
    assert not time_table.astype(str).apply(lambda c: c.str.contains("nan")).any().any()
    staged = time_table["pipeline"] != "pp 1"
    assert set(time_table.loc[staged, "comm per step (ms)"]) == {"–"}
    assert set(time_table.loc[~staged, "bubble (%)"]) == {"–"} and set(time_table.loc[staged, "bubble (%)"]) == \
        {"33.3", "20"}
    text = report.write_report(out)["files"][0].read_text()
    assert text.index("## Pipeline parallelism") < text.index("## Accuracy against average loss rate")
    assert "| pp 2 (gpipe, m=4)" in text


def test_the_expert_section_shows_its_traffic_and_names_the_most_fragile_setting(pipelines):
    """A parallelism's own section (experts here; context parallelism's is the same table): its time and
    observed loss beside accuracy, "–" where the axis is 1, and under it the setting whose accuracy fell
    furthest below the loss-free runs of the same seeds. The pipeline runs stand in for expert runs."""
    out, runs = pipelines
    staged = runs["pp_size"] > 1
    runs = runs.assign(ep_size=runs["pp_size"], ep_s_per_step=np.where(staged, 2e-3, np.nan),
                       observed_loss_rate_ep=runs["observed_loss_rate_pp"])
    worst = (runs["loss_model"] != "none") & (runs["pp_schedule"] == "gpipe") & (runs["microbatches"] == 4)
    runs.loc[worst, "accuracy"] -= 0.07          # 5 pp from the loss, 7 more for this setting alone
    shown = tables.axis_table(runs, "ep")
    assert list(shown.columns[-5:]) == ["EP per step (ms)", "observed EP loss (%)", "n"] + tables.HIDDEN
    for row in shown.itertuples(index=False):
        cells = dict(zip(shown.columns, row))
        expert = cells["pipeline"] != "pp 1"
        assert cells["EP per step (ms)"] == ("2" if expert else "–")
        assert cells["observed EP loss (%)"] == (("5" if cells["loss"] != "no loss" else "0") if expert else "–")
    fragile = tables.most_fragile(shown)
    assert fragile["pipeline"] == "pp 2 (gpipe, m=4)" and fragile["vs no loss, paired (pp)"] == "-12.0 ± 0.0"
    text = sections.axis_section("ep")(sections.ReportInputs(out, runs, pd.DataFrame()))
    assert text.startswith("## Expert parallelism") and "_paired" not in text
    assert "Most fragile: 5% Bernoulli, " in text and "pipeline pp 2 (gpipe, m=4)" in text and "-12.0" in text
    assert sections.axis_section("cp")(sections.ReportInputs(out, runs, pd.DataFrame())) == ""   # cp 1 throughout
    # summary.csv leaves out a size every run shares: the runs' EP time still says which have experts
    alike = runs[staged].drop(columns="ep_size")
    assert sections.axis_section("ep")(sections.ReportInputs(out, alike, pd.DataFrame())).startswith(
        "## Expert parallelism")
    assert set(tables.axis_table(alike, "ep")["EP per step (ms)"]) == {"2"}


def test_a_sweep_without_stages_has_no_pipeline_section_or_columns(results):
    runs = load.load_runs(results)
    assert set(runs["pp_size"]) == {1} and "pp_schedule" not in runs.columns
    assert sections.axis_section("pp")(sections.ReportInputs(results, runs, pd.DataFrame())) == ""
    assert "bubble (%)" not in tables.time_to_accuracy_table(runs, load.load_metrics(results, runs))[0].columns


def test_pipeline_labels_and_topology_count_every_stage():
    pipeline = next(d for d in labels.KNOWN if d.name == "pipeline")
    topology = next(d for d in labels.KNOWN if d.name == "topology")
    row = {"loss_model": "bernoulli", "tp_size": 2, "pp_size": 2, "ranks_per_node": 2, "lossy_links": "inter_node"}
    assert topology.value(row) == "2 nodes x 2 ranks, loss between nodes"
    assert pipeline.value({**row, "pp_schedule": "gpipe", "microbatches": 8}) == "pp 2 (gpipe, m=8)"
    assert pipeline.value({**row, "pp_schedule": "1f1b", "microbatches": None}) == "pp 2 (1f1b, m=2)"
    assert pipeline.value({"pp_size": 1, "microbatches": 4}) == "pp 1 (m=4)"   # accumulation without stages
    assert pipeline.value({"pp_size": 2}) == "pp 2", "columns summary.csv lacks are not guessed"


# -- which algorithm each collective ran -----------------------------------------------------------------
def _record_choices(run_dir: Path) -> None:
    """What a real run writes into summary.json's collectives: a network of the run's spec calls every
    TP site of the tiny model (2 blocks) at two sizes."""
    from lossysim import LossyNetwork
    from lossysim.config import load_config
    import json
    import torch
    config = load_config(run_dir / "config.yaml")
    net = LossyNetwork(config.network_spec())
    for numel in (10240, 11264):
        for site in (f"h.{i}.{m}.{k}" for i in range(2) for m in ("attn", "mlp") for k in ("copy", "reduce")):
            net.simulate(site, "fwd" if site.endswith("reduce") else "bwd", numel, torch.float32)
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["collectives"] = [{"network": "tp", **row} for row in net.choices()]
    (run_dir / "summary.json").write_text(json.dumps(summary))


def test_report_names_the_algorithm_each_collective_ran(quick_like):
    out, runs, metrics = quick_like
    assert sections.section_collectives(sections.ReportInputs(out, runs, metrics)) == "", "no records, no section"
    for run_dir in runs["run_dir"]:
        _record_choices(out / run_dir)
    table = collectives.collectives_table(out, runs)
    # Three groups timed alike: ring on 2 nodes, direct on 2 nodes, ring on 2 x 2 (loss never splits a group).
    assert list(table["runs"]) == ["ring, 2 nodes x 1 rank", "direct, 2 nodes x 1 rank", "ring, 2 nodes x 2 ranks"]
    assert set(table["traffic"]) == {"TP"} and set(table["collective"]) == {"all_reduce"}
    # 40 KiB on 2 ranks across roce-200g: NCCL's LL; the direct exchange has no protocol.
    assert list(table["algorithm"]) == ["ring/LL", "direct", "ring/LL"]
    assert list(table["channels"]) == ["1", "0", "2"]
    sites = "h.*.attn.copy, h.*.attn.reduce, h.*.mlp.copy, h.*.mlp.reduce (8)"
    assert list(table["call sites"]) == [sites] * 3
    assert list(table["message"]) == ["40.0–44.0 KiB"] * 3
    section = sections.section_collectives(sections.ReportInputs(out, runs, metrics))
    assert section.startswith("## Collectives: which algorithm each ran") and "| ring/LL" in section
    report.write_report(out)
    assert "## Collectives: which algorithm each ran" in (out / "report.md").read_text()

def test_a_retransmitted_run_names_no_recovery_policy():
    """Under retransmission every packet arrives and no policy acts: its label says "–", not the
    policy its config happens to carry."""
    from lossysim.results.labels import KNOWN, NOT_APPLICABLE
    recovery = next(d for d in KNOWN if d.name == "recovery")
    row = {"loss_model": "bernoulli", "transport": "retransmit", "recovery": "zero"}
    assert recovery.value(row) == NOT_APPLICABLE
    assert recovery.value({**row, "transport": "drop"}) == "zero-fill"
    assert recovery.value({**row, "transport": "deadline", "recovery": "hadamard"}) == "hadamard"


def test_report_names_interrupted_and_never_started_runs_and_strict_fails(tmp_path, monkeypatch, capsys):
    import shutil as _shutil
    import yaml
    monkeypatch.setattr(sweep, "_default_train", lambda: Recorder())
    spec = write_spec(tmp_path / "s.yaml", {"loss": ["none", "bernoulli:0.01", "bernoulli:0.05"]})
    out = tmp_path / "results"
    assert cli.main(["sweep", str(spec), "--out", str(out), "--no-progress"]) == 0
    done, interrupted, unstarted = [r.dir_name for r in sweep.expand(sweep.load_spec(spec), out)]
    (out / interrupted / "summary.json").unlink()   # killed: config, metrics and checkpoints, no summary
    (out / interrupted / "checkpoints" / "step-0000002").mkdir(parents=True)
    _shutil.rmtree(out / unstarted)                 # the sweep never got to it
    capsys.readouterr()
    assert cli.main(["report", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"{interrupted}: no summary.json" in err and "from its last checkpoint" in err
    assert f"{unstarted}: never started" in err and done not in err
    text = (out / "report.md").read_text()
    assert f"`{interrupted}`" in text and f"`{unstarted}`" in text and "2 more could not be read" in text
    assert cli.main(["report", str(out), "--strict"]) == 1
    capsys.readouterr()
    # A folder a sweep wrote before sweep.yaml listed its runs: its folders alone are named.
    record = yaml.safe_load((out / "sweep.yaml").read_text())
    del record["runs"]
    (out / "sweep.yaml").write_text(yaml.safe_dump(record))
    assert cli.main(["report", str(out), "--strict"]) == 1
    err = capsys.readouterr().err
    assert interrupted in err and unstarted not in err
    _shutil.rmtree(out / interrupted)
    assert cli.main(["report", str(out), "--strict"]) == 0
