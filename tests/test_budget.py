"""Loss budgets (``lossysim budget``): the search finds the crossing it is given, says when the grid does not
bracket it, and the command runs paired runs of a pretrained model from local files, resumably."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from lossysim.budget import FAMILIES, Point, find_budget
from lossysim.budget.command import BASE, Runner, policies_for
from lossysim.budget.report import cost_text
from lossysim.budget.search import MIN_PAIRS, TOLERANCE_PCT
from lossysim.cli import main
from tiny_pretrained import save_tiny_pretrained

pytestmark = pytest.mark.usefixtures("private_cache", "one_torch_thread")


def linear(slope: float, half: float = 0.2, pairs: int = 3):
    """A family whose paired change grows as ``slope`` x rate (percent), with a fixed interval; records
    the rates asked."""
    asked = []

    def measure(rate: float) -> Point:
        asked.append(rate)
        return Point(rate, slope * rate, half, pairs)
    return measure, asked


@pytest.mark.parametrize("slope", [10.0, 30.0, 300.0, 2000.0])
def test_the_budget_brackets_the_crossing_and_bisection_narrows_it(slope):
    """The crossing is where slope x rate + 0.2 = 1: the budget passes, its failure fails, both around it,
    and two bisections of a 3x grid step leave them within 3^(1/4) of each other."""
    measure, asked = linear(slope)
    budget = find_budget(measure, refine=2)
    crossing = (TOLERANCE_PCT - 0.2) / slope
    assert budget.bracketed
    assert budget.rate <= crossing < budget.failed_at
    assert budget.failed_at / budget.rate == pytest.approx(3 ** 0.25, rel=0.05)
    assert asked[:-2] == sorted(asked[:-2]) and len(asked) == len(set(asked))   # upward, then bisections


def test_a_grid_that_does_not_bracket_says_which_side():
    high, _ = linear(0.1)
    budget = find_budget(high)
    assert budget.rate == pytest.approx(0.3) and budget.failed_at is None and not budget.bracketed
    assert budget.describe().startswith(">= 30%") and "highest" in budget.describe()
    low, asked = linear(1e5)
    budget = find_budget(low)
    assert budget.rate is None and budget.failed_at == pytest.approx(1e-4) and asked == [1e-4]
    assert budget.describe().startswith("< 0.01%")


def test_too_few_pairs_never_pass():
    assert not Point(0.01, 0.0, 0.1, MIN_PAIRS - 1).passes
    assert Point(0.01, 0.0, 0.1, MIN_PAIRS).passes
    assert not Point(0.01, 0.0, math.nan, MIN_PAIRS).passes


def test_a_bad_grid_is_refused():
    with pytest.raises(ValueError, match="rates in"):
        find_budget(linear(1.0)[0], grid=[0.0, 0.1])
    for refine in (-1, 1.5, True):
        with pytest.raises(ValueError, match="count of bisections"):
            find_budget(linear(1.0)[0], refine=refine)


def test_the_grid_is_scanned_from_its_lowest_rate_once_each():
    measure, asked = linear(1.0)
    find_budget(measure, grid=[0.1, 0.001, 0.01, 0.1], refine=0)
    assert asked == sorted(set(asked)) and asked[0] == 0.001


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    return save_tiny_pretrained(tmp_path_factory.mktemp("pretrained"))


def test_every_familys_runs_validate_and_name_their_traffic_alone(pretrained, tmp_path):
    runner = Runner(tmp_path, {**BASE, "model": str(pretrained)}, seeds=3)
    for family in FAMILIES:
        config = runner.config(family, 2, 0, "zero", 0.01)
        assert config.lossy_traffic == family.lossy_traffic and config.loss == "bernoulli:0.01"
        assert runner.config(family, 2, 0).loss == "none"


def test_a_layout_key_set_by_the_user_wins_over_every_familys_own(pretrained, tmp_path):
    """``--set dp_size=4`` measures DP's budget at dp 4 (the family's own dp 2 would silently win otherwise);
    BASE sets no layout key, which is how the runner tells the user's apart."""
    assert not {key for family in FAMILIES for key in family.layout} & set(BASE)
    runner = Runner(tmp_path, {**BASE, "model": str(pretrained), "dp_size": 4}, seeds=3)
    by_name = {family.name: family for family in FAMILIES}
    assert runner.config(by_name["dp"], 2, 0, "zero", 0.1).dp_size == 4
    tp = runner.config(by_name["tp"], 2, 0, "zero", 0.1)
    assert (tp.tp_size, tp.dp_size, tp.lossy_traffic) == (3, 4, by_name["tp"].lossy_traffic)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda family: family.name)
def test_every_familys_layout_trains_a_pretrained_model_from_files_under_loss(pretrained, tmp_path, family):
    """One lossy step of each family's layout on a model loaded as a pretrained one is (transformers 5
    swapped hub kernels into a loaded model's norms on ``train()``, dropping the per-rank forwards a
    context rank's gradients are caught by: every CP run of a pretrained model failed)."""
    base = {**BASE, "model": str(pretrained), "max_eval_samples": 4, "max_train_samples": 16, "max_length": 32}
    runner = Runner(tmp_path, base, seeds=1, progress=False)
    summary, _ = runner.summary(runner.config(family, 1, 0, "zero", 0.05))
    assert summary["status"] == "completed", summary.get("error")
    lossy = [d for axis in summary["traffic"].values() for d in axis.values() if d["lossy"]]
    assert lossy and sum(d["lost"] for d in lossy) > 0   # the family's own traffic lost packets


def test_any_recovery_policy_is_tried_where_it_acts(pretrained, tmp_path):
    """Beyond the default six: ``hadamard+rescale`` on TP's all-reduces, and on every family where
    ``hadamard`` is tried (both act on summed traffic), nowhere else."""
    runner = Runner(tmp_path, {**BASE, "model": str(pretrained)}, seeds=3)
    by_name = {family.name: family for family in FAMILIES}
    config = runner.config(by_name["tp"], 2, 0, "hadamard+rescale", 0.01)
    assert config.recovery == "hadamard+rescale" and config.lossy_traffic == by_name["tp"].lossy_traffic
    wanted = ["zero", "hadamard+rescale"]
    assert policies_for(runner, by_name["tp"], 2, wanted) == wanted
    for family in FAMILIES:
        kept = policies_for(runner, family, 2, ["zero", "hadamard", "hadamard+rescale"])
        assert ("hadamard" in kept) == ("hadamard+rescale" in kept), (family.name, kept)
    assert "hadamard" not in policies_for(runner, by_name["ep"], 2, ["zero", "hadamard"])


def test_the_trade_is_the_mean_step_over_its_steps_with_their_interval(monkeypatch):
    """A budget's price is what ``estimate`` times over ``STEPS`` steps of the family's job: the mean step
    over the loss-free one, and the mean's 95% interval, both in percent of the loss-free step."""
    from lossysim.budget import trade
    from lossysim.estimate import simulate
    real, calls = simulate.estimate, []

    def recording(*args, **kwargs):
        calls.append((kwargs, real(*args, **kwargs)))
        return calls[-1][1]
    monkeypatch.setattr(simulate, "estimate", recording)
    cost = trade.step_cost({f.name: f for f in FAMILIES}["pp"], 0.01, "tcp")
    (kwargs, row), = calls
    assert kwargs["steps"] == trade.STEPS >= 20   # TCP's step varies too much for a few
    free = row["loss_free_step_s"]
    assert math.isclose(cost.pct, 100 * (row["step_mean_s"] / free - 1), rel_tol=1e-12) and cost.pct > 0
    assert math.isclose(cost.pct - cost.half_width, 100 * (row["step_mean_lo_s"] / free - 1), rel_tol=1e-9)
    assert math.isclose(cost.pct + cost.half_width, 100 * (row["step_mean_hi_s"] / free - 1), rel_tol=1e-9)
    assert 0 < cost.half_width < cost.pct
    assert cost.failures_per_1000_steps == row["failures_per_1000_steps"] == 0   # TCP's 15 retries hold at 1%


@pytest.mark.parametrize("pct,half,printed", [(207.27, 10.2, "207 +-10"), (1779.3, 27.7, "1,779 +-28"),
                                              (0.21, 0.0032, "0.210 +-0.003"), (0.00132, 6.35e-5, "0.00132 +-0.00006"),
                                              (12.4, math.nan, "12.4"), (math.nan, math.nan, "–")])
def test_a_price_is_printed_to_its_intervals_first_digit(pct, half, printed):
    assert cost_text(pct, half) == printed
    if math.isfinite(pct):   # and, where the transport gives collectives up, how often
        assert cost_text(pct, half, 291.67) == f"{printed}, gives up 292 times per 1,000 steps"
        assert cost_text(pct, half, 2458.3) == f"{printed}, gives up 2,458 times per 1,000 steps"


def test_the_command_writes_its_table_and_resumes_without_training(pretrained, tmp_path, capsys, monkeypatch):
    from lossysim.budget import command, trade
    monkeypatch.setattr(trade, "STEPS", 3)   # the price's length is not what this test is about
    priced_calls = []
    monkeypatch.setattr(command, "step_cost", lambda *a: priced_calls.append(a) or trade.step_cost(*a))
    out = tmp_path / "budget"
    argv = ["budget", "--out", str(out), "--model", str(pretrained), "--families", "dp", "--policies",
            "zero,rescale", "--steps", "2", "--seeds", "3", "--grid", "0.3", "--refine", "0", "--no-progress", "--nics", "irn",
            "--set", "max_eval_samples=8", "--set", "max_train_samples=32", "--set", "max_length=32"]
    assert main([*argv, "--dry-run"]) == 0 and not out.exists()   # 2 searches x 1 rate x 3 seeds, 3 loss-free
    assert capsys.readouterr().out.splitlines()[-1].startswith("at most 9 runs still to train")
    assert main(argv) == 0
    table = pd.read_csv(out / "budgets.csv")
    assert set(table["policy"]) == {"zero", "rescale"} and set(table["family"]) == {"dp"}
    points = pd.read_csv(out / "points.csv")
    assert (points["pairs"] == 3).all() and points["train_loss_gap"].notna().all()
    training = pd.read_csv(out / "training.csv")   # every seed's every step, at every rate measured
    assert len(training) == len(points) * 3 * 2 and set(training["step"]) == {1, 2}
    assert np.allclose(training["gap"], training["lossy_loss"] - training["loss_free_loss"])
    mean_gap = training.groupby(["policy", "rate"])["gap"].mean()
    assert np.allclose([mean_gap[p.policy, p.rate] for p in points.itertuples()], points["train_loss_gap"])
    assert (out / "training.png").stat().st_size > 0
    written = (out / "budgets.md").read_text()   # every point too, as measured
    for p in points.itertuples():
        assert f"| dp | {p.policy} | 2 | 30% | {p.change_pct:+.2f}% | +-{p.change_pct_ci:.2f} |" in written
    priced = table[table["budget_rate"].notna()]
    assert (priced["retransmit_irn_pct"] > 0).all() and table.loc[table["budget_rate"].isna(), "retransmit_irn_pct"].isna().all()
    price = priced[["retransmit_irn_pct", "retransmit_irn_pct_ci"]]
    assert price.nunique().tolist() == [1, 1] and price["retransmit_irn_pct_ci"].gt(0).all()
    assert [call[1:] for call in priced_calls] == [(0.3, "irn")]   # the two policies' one rate priced once
    assert all(f"| {r.budget} | {cost_text(r.retransmit_irn_pct, r.retransmit_irn_pct_ci, failures)} |" in written
               for r, failures in zip(priced.itertuples(), priced["retransmit_irn_failures_per_1000_steps"]))
    # at 30% IRN's 7 retries run out: the job would stop, which its step time does not show; the table says so
    assert (priced["retransmit_irn_failures_per_1000_steps"] > 0).all() and "gives up" in written
    assert (out / "budget.png").stat().st_size > 0 and "| DP gradient buckets |" in (out / "budgets.md").read_text()
    assert "on h100 over roce-200g (nvlink4 inside a node)" in (out / "budgets.md").read_text()   # the job's hardware
    assert "Every run took `max_eval_samples=8`, `max_train_samples=32`, `max_length=32` (`--set`); the priced " \
           "jobs did not" in written   # what the price does not follow, said
    runs = sorted(p.name for p in (out / "runs").iterdir())
    mtimes = {p: (out / "runs" / p / "summary.json").stat().st_mtime_ns for p in runs}
    capsys.readouterr()
    assert main(argv) == 0
    assert sorted(p.name for p in (out / "runs").iterdir()) == runs
    assert {p: (out / "runs" / p / "summary.json").stat().st_mtime_ns for p in runs} == mtimes
    assert pd.read_csv(out / "budgets.csv").equals(table)
    capsys.readouterr()
    wider = [a if a != "0.3" else "0.3,0.5" for a in argv]   # each search replayed over the runs it made
    assert main([*wider, "--dry-run"]) == 0
    plan = capsys.readouterr().out.splitlines()
    passed = table.set_index("policy")["budget_rate"].notna()
    for policy in ("zero", "rescale"):
        row = next(line.split() for line in plan if line.split()[:2] == ["dp", policy])
        assert row[2:] == (["2", "1", "50%", "1", "rates"] if passed[policy] else ["2", "1", "done", "0", "rates"])
    left = [line for line in plan if line.startswith("at most")]
    assert len(left) == 1 and left[0].startswith(f"at most {3 * passed.sum()} runs still to train")
    took = [line for line in plan if line.startswith("the 9 runs done there took")]   # 6 lossy, 3 loss-free
    assert len(took) == int(passed.any()) and plan[-1] == (took or left)[0]


def test_runs_side_by_side_give_the_same_budgets(pretrained, tmp_path, capsys):
    """``--jobs 2`` trains each round's runs (every search's next rate at once) in two worker processes: the
    same runs, the same points and the same table as one at a time."""
    def budget(out, jobs):
        assert main(["budget", "--out", str(out), "--model", str(pretrained), "--families", "dp", "--policies",
                     "zero,rescale", "--steps", "2", "--seeds", "3", "--grid", "0.3", "--refine", "0",
                     "--no-progress", "--nics", "none", "--jobs", str(jobs), "--set", "max_eval_samples=8",
                     "--set", "max_train_samples=32", "--set", "max_length=32"]) == 0
        return {name: pd.read_csv(out / name) for name in ("budgets.csv", "points.csv")}
    one, two = budget(tmp_path / "one", 1), budget(tmp_path / "two", 2)
    assert list(one["budgets.csv"]["policy"]) == ["zero", "rescale"] and len(one["points.csv"]) == 2
    for name in one:
        pd.testing.assert_frame_equal(one[name], two[name])
    assert sorted(p.name for p in (tmp_path / "one" / "runs").iterdir()) == \
        sorted(p.name for p in (tmp_path / "two" / "runs").iterdir())


@pytest.mark.parametrize("flags,message", [(["--families", "nope"], "families='nope' must be"),
                                           (["--seeds", "2"], "at least 3 paired seeds"),
                                           (["--policies", "zero,magic"], "--policies magic"),
                                           (["--nics", "irn,carrier-pigeon"], "--nics carrier-pigeon"),
                                           (["--jobs", "0"], "jobs=0 must be a whole number >= 1"),
                                           (["--refine", "-1"], "refine is a count of bisections, >= 0"),
                                           (["--set", "batchsize=8"], "'batchsize' (did you mean batch_size?)"),
                                           (["--set", "loss=bernoulli:0.1"], "--set loss: the budget sets it"),
                                           (["--grid", "0.1,2"], "a budget's grid needs rates in (0, 1)"),
                                           (["--grid", "0.01,1e-3x"], "--grid 1e-3x: loss rates in (0, 1)"),
                                           (["--steps", "6,six"], "--steps six: optimizer steps, >= 1"),
                                           (["--families", "ep", "--policies", "rescale,outliers"],
                                            "none acts on the traffic of ep")])
def test_bad_input_is_one_line_and_exit_2(flags, message, tmp_path, capsys):
    assert main(["budget", "--out", str(tmp_path / "b"), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "b").exists()   # refused before anything is written


def test_a_length_or_rate_given_twice_is_measured_once(tmp_path, capsys):
    """Nor is a family trained loss-free where none of the policies asked for acts on its traffic."""
    assert main(["budget", "--out", str(tmp_path / "b"), "--families", "ep,tp", "--policies", "rescale",
                 "--steps", "6,6", "--grid", "0.01,0.01,0.1", "--refine", "1", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:3] for line in lines[1:-1]] == [["tp", "rescale", "6"]]
    assert lines[-1].startswith("at most 12 runs still to train")   # (2 rates + a bisection) x 3, 3 loss-free


@pytest.mark.parametrize("ranks,algorithm", [(2, "ring"), (4, "ring"), (4, "direct")])
def test_the_share_of_an_average_a_lossy_all_reduce_keeps_is_the_closed_form_the_docs_use(ranks, algorithm):
    """docs/budgets.md's dp 4 reading: with q = 1 - p a ring keeps ((1 + q + ... + q^(n-1)) / n)^2 of each
    element's contributions in expectation (a lost hop drops every upstream rank's partial sum, or the sum
    for every rank downstream), the direct exchange (1 + (n - 1) q) / n. Tested over seeds with a t-test."""
    from scipy import stats
    from lossysim.net.network import LossyNetwork
    q = 0.9
    expected = (sum(q ** k for k in range(ranks)) / ranks) ** 2 if algorithm == "ring" else (1 + (ranks - 1) * q) / ranks
    kept = []
    for seed in range(6):
        net = LossyNetwork(ranks, "bernoulli:0.1", seed=seed, algorithm=algorithm)
        out = net.all_reduce("dp.bucket0", "bwd", torch.ones(ranks, 1_000_000), list(range(ranks)))
        kept.append(float(out.double().mean()) / ranks)
    assert stats.ttest_1samp(kept, expected).pvalue > 1e-3, (kept, expected)
    assert abs(np.mean(kept) - expected) < 0.01   # and near it, not only within a wide spread
