"""The report's simulated times: a unit picked from the values shown, and a seed whose time to target
includes a restart shown as such, never folded into the other seeds' mean (synthetic runs, known clocks)."""
from __future__ import annotations

import pandas as pd
import pytest

from lossysim.results import compare, labels, plots, sections, tables
from lossysim.results.stats import mean_ci

ACCURACIES = {"none": [0.5, 0.8, 0.9], "bernoulli:0.05": [0.4, 0.7, 0.9]}   # target 0.85 x 0.9: 76.5%
RESTART_S = 300.0


def _runs_and_metrics(failures_at: dict[int, int], seeds=(0, 1, 2)):
    """A loss-free setting (1 ms per 10 steps) and a lossy one (2 ms per 10 steps), seed s 10 s% slower;
    the lossy seed s gives up on a collective after step ``failures_at[s]``: a 300 s restart on its clock
    from then on (the ideal nic's clock never pays one). Train rows every 10 steps carry the count."""
    runs, metrics = [], []
    for setting, accs in ACCURACIES.items():
        lossy = setting != "none"
        for seed in seeds:
            run_dir = f"{setting}-{seed}"
            failed_after = failures_at.get(seed) if lossy else None
            runs.append({"run_dir": run_dir, "status": "completed", "loss": setting, "seed": seed,
                         "loss_model": "bernoulli" if lossy else "none", "loss_rate": 0.05 if lossy else 0.0,
                         "mean_burst": 1.05 if lossy else 0.0, "transport": "retransmit" if lossy else "drop",
                         "accuracy": accs[-1], "eval_split": "validation_matched", "dataset_name": "synthetic",
                         "failures": int(failed_after is not None), "comm_s_per_step": 1e-4})
            for i, acc in enumerate(accs):
                step = 10 * (i + 1)
                failures = int(failed_after is not None and step > failed_after)
                ideal = (2e-4 if lossy else 1e-4) * step * (1 + 0.1 * seed)
                metrics.append({"run_dir": run_dir, "split": "train", "eval_split": "validation_matched",
                                "step": step, "failures": failures})
                metrics.append({"run_dir": run_dir, "split": "validation_matched", "eval_split": "validation_matched",
                                "step": step, "accuracy": acc, "sim_time_s": ideal + RESTART_S * failures,
                                "sim_time_s_ideal_nic": ideal})
    return pd.DataFrame(runs), pd.DataFrame(metrics)


def test_the_unit_is_the_one_the_typical_value_reads_in():
    assert labels.time_unit([0.0004, 0.002, 0.003, 300.5]) == (1e3, "ms"), "one restart does not make ms minutes"
    assert labels.time_unit([20.0, 40.0, 90.0, 180.0]) == (1.0, "s")
    assert labels.time_unit([600.0, 1800.0, float("nan")]) == (1 / 60, "min")
    assert labels.time_unit([3 * 3600.0]) == (1 / 3600, "h")
    assert labels.time_unit([]) == (1.0, "s")


def test_a_seed_that_paid_a_restart_is_shown_apart_from_the_mean():
    runs, metrics = _runs_and_metrics({2: 15})        # lossy seed 2 restarts before its target (step 30)
    table, _ = tables.time_to_accuracy_table(runs, metrics, fraction=0.85)
    base, lossy = table.iloc[0], table.iloc[1]
    # seeds 0 and 1 reach 76.5% at step 30 in 6.0 and 6.6 ms; seed 2's 300.0072 s is no part of that mean
    est = mean_ci([6.0e-3, 6.6e-3])
    assert lossy["time to target (ms)"] == tables._pm(est.mean, est.half_width, 2, scale=1e3, digits=3)
    assert lossy["ideal nic (ms)"] == tables._pm(est.mean, est.half_width, 2, scale=1e3, digits=3)
    assert lossy["restarted before target"] == "1 of 3 seeds: 5 min; each restart +5 min"
    assert lossy["reached"] == "3/3" and base["restarted before target"] == "–"
    assert lossy["x baseline"] == f"{6.3 / 2.2:.2f}"   # the baseline's seeds: 2.0, 2.2 and 2.4 ms
    text = sections.section_time_to_accuracy(sections.ReportInputs(".", runs, metrics))
    assert sections.RESTART_NOTE in text and "| restarted before target " in text


def test_when_every_seed_paid_a_restart_there_is_no_mean_at_all():
    runs, metrics = _runs_and_metrics({0: 5, 1: 5, 2: 15})
    lossy = tables.time_to_accuracy_table(runs, metrics, fraction=0.85)[0].iloc[1]
    assert lossy["time to target (ms)"] == "restarted" and lossy["x baseline"] == "-"
    assert lossy["restarted before target"] == "3 of 3 seeds: 5 min, 5 min, 5 min; each restart +5 min"


def test_a_restart_after_the_target_leaves_the_time_to_target_alone():
    runs, metrics = _runs_and_metrics({2: 30})        # seed 2 fails after its step-30 evaluation
    table, _ = tables.time_to_accuracy_table(runs, metrics, fraction=0.85)
    est = mean_ci([6.0e-3, 6.6e-3, 7.2e-3])
    assert table.iloc[1]["time to target (ms)"] == tables._pm(est.mean, est.half_width, 3, scale=1e3, digits=3)
    assert "restarted before target" not in table.columns
    assert sections.RESTART_NOTE not in sections.section_time_to_accuracy(sections.ReportInputs(".", runs, metrics))


def test_a_restart_between_train_rows_is_never_missed():
    rows = pd.DataFrame([{"split": "train", "step": 10, "failures": 0}, {"split": "train", "step": 40, "failures": 1},
                         {"split": "validation_matched", "step": 30, "accuracy": 0.9}])
    assert compare.restarts_by(rows, 30) == 1, "the next train row's count: the failure may precede step 30"
    assert compare.restarts_by(rows, 10) == 0
    no_counts = rows.drop(columns="failures")
    assert compare.restarts_by(no_counts, 30, final=2) == 2, "no counts in the metrics: the run's final one"
    assert compare.restarts_by(no_counts, 30) == 0


def test_the_time_plot_labels_milliseconds_as_milliseconds():
    runs, metrics = _runs_and_metrics({2: 15})
    fig = plots.plot_accuracy_vs_time(metrics, runs)
    (ax,) = fig.axes
    assert ax.get_xlabel() == "simulated time (ms, log scale)"
    lines = {line.get_label(): line for line in ax.get_lines()}
    # the loss-free seeds' mean clock: 1.1, 2.2 and 3.3 ms
    assert list(lines["no loss"].get_xdata()) == pytest.approx([1.1, 2.2, 3.3])
