"""The perplexity table of causal-LM sweeps: paired statistics against closed forms, and the report
showing it for LM runs only (a fake trainer with known perplexities and clocks; nothing trains)."""
from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from lossysim import cli
from lossysim.loss import parse_loss_model
from lossysim.results import load, perplexity
from lossysim.run import sweep
from test_sweep import fake_run_experiment, write_spec

# Known damage, in percent, of each setting on every seed, and the seeds' own perplexities: the
# paired change must come out as exactly these shifts, whatever the seeds' spread.
DAMAGE = {("tp", 0.01, "zero"): [4.0, 6.0, 11.0], ("tp", 0.05, "zero"): [30.0, 45.0, 60.0],
          ("dp", 0.1, "zero"): [1.0, 2.0, 6.0], ("dp", 0.1, "rescale"): [0.5, 0.25, 0.75]}
SEED_PPL = [17.0, 25.0, 19.0]
STEP_S = {"tp": 0.02, "dp": 0.05}   # the loss-free simulated time per step of each mesh


def mesh(config) -> str:
    return "dp" if config.dp_size > 1 else "tp"


def fake_ppl(config) -> float:
    rate = parse_loss_model(config.loss).loss_rate
    damage = 0.0 if rate == 0 else DAMAGE[(mesh(config), rate, config.recovery)][config.seed]
    return SEED_PPL[config.seed] * (1 + damage / 100)


def lm_trainer(config, run_dir, **_):
    """fake_run_experiment, its eval loss set to log(perplexity) and its clock to a known one."""
    summary = fake_run_experiment(config, run_dir)
    for split in summary["final"].values():
        split["loss"] = math.log(fake_ppl(config))
    rate = parse_loss_model(config.loss).loss_rate
    summary["sim_time"] = {"total_s": config.steps * STEP_S[mesh(config)] * (1 + 10 * rate)}
    if config.dp_size > 1:
        summary["data_parallel"] = {"dp_size": config.dp_size, "packets_sent_dp": 1000,
                                    "packets_lost_dp": round(1000 * rate)}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return summary


@pytest.fixture
def lm_results(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "_default_train", lambda: lm_trainer)
    spec = write_spec(tmp_path / "s.yaml", [
        {"tp_size": [2], "lossy_traffic": ["tp_forward,tp_backward"],
         "loss": ["none", "bernoulli:0.01", "bernoulli:0.05"], "seed": [0, 1, 2]},
        {"tp_size": [1], "dp_size": [2], "lossy_traffic": ["dp"], "loss": ["none", "bernoulli:0.1"],
         "recovery": ["zero", "rescale"], "seed": [0, 1, 2]},
    ], task="lm", eval_lossy=False, batch_size=4, max_length=64, lr=1e-4)
    out = tmp_path / "results"
    assert cli.main(["sweep", str(spec), "--out", str(out), "--no-progress"]) == 0
    return out


def closed_form(changes) -> tuple[float, float, float]:
    """Mean, 95% half-width t_{0.975, n-1} s / sqrt(n) and the two-sided p of t = mean / (s / sqrt(n))."""
    d = np.asarray(changes, dtype=float)
    n, s = len(d), d.std(ddof=1)
    t = d.mean() / (s / math.sqrt(n))
    return d.mean(), stats.t.ppf(0.975, n - 1) * s / math.sqrt(n), 2 * stats.t.sf(abs(t), n - 1)


def test_paired_change_is_the_mean_percent_change_with_its_t_interval():
    base = np.array([17.0, 25.0, 19.0])
    mean, half, n, p = perplexity.paired_change(base * [1.01, 1.02, 1.06], base)
    want = closed_form([1.0, 2.0, 6.0])
    assert n == 3 and (mean, half, p) == pytest.approx(want, rel=1e-9)
    assert mean == pytest.approx(3.0) and p == pytest.approx(stats.ttest_1samp([1, 2, 6], 0).pvalue)
    # a pair with a side missing is dropped whole; one pair left: a mean, no interval, no test
    mean, half, n, p = perplexity.paired_change([18.7, math.nan], [17.0, 25.0])
    assert (n, mean) == (1, pytest.approx(10.0)) and math.isnan(half) and math.isnan(p)


def test_table_pairs_each_setting_with_the_loss_free_run_of_its_mesh_and_seed(lm_results):
    runs = load.load_runs(lm_results)
    frame = perplexity.table(runs)
    assert len(frame) == 2 + len(DAMAGE)
    for (where, rate, recovery), damage in DAMAGE.items():
        replicated = frame["dp_loss"] if where == "dp" else ~frame["dp_loss"]
        rows = frame[replicated & (frame["loss_rate"] == rate)]
        if where == "dp":
            rows = rows[rows["setting"].str.contains("rescale") == (recovery == "rescale")]
        (row,) = rows.itertuples()
        mean, half, p = closed_form(damage)
        assert (row.change_pct, row.change_pct_ci, row.p) == pytest.approx((mean, half, p), rel=1e-9)
        assert row.pairs == 3
        ppl = [s * (1 + d / 100) for s, d in zip(SEED_PPL, damage)]
        assert row.perplexity == pytest.approx(np.mean(ppl))
        assert row.time_vs_loss_free == pytest.approx(1 + 10 * rate)
        assert row.sim_s_per_step == pytest.approx(STEP_S[where] * (1 + 10 * rate))
        assert row.observed_loss_rate == pytest.approx(rate)
    lossless = frame[frame["loss_rate"] == 0]
    assert len(lossless) == 2 and lossless["change_pct"].isna().all()
    assert sorted(lossless["perplexity"]) == pytest.approx([np.mean(SEED_PPL)] * 2)


def test_report_shows_the_table_for_lm_runs_beside_the_published_claim(lm_results, capsys):
    (lm_results / "damage_map").mkdir()
    cells = pd.DataFrame({"model": "m", "rate": 0.01, "recovery": "zero", "layer": [-1, 0, 0, 1, 1],
                          "site": ["none", "attn", "mlp", "attn", "mlp"], "kl_per_token": [0, 0.1, 0.2, 0.3, 0.6]})
    cells.to_csv(lm_results / "damage_map" / "damage_map.csv", index=False)
    assert cli.main(["report", str(lm_results)]) == 0
    printed = capsys.readouterr().out
    assert "Eval perplexity after training under loss" in printed and "vs loss-free, paired (%)" in printed
    md = (lm_results / "report.md").read_text()
    assert "## Eval perplexity after training under loss" in md
    assert "Weintraub et al. 2025" in md and "at most 0.8% at 10% loss" in md
    assert "evaluated loss-free (`eval_lossy: false`)" in md and "4 texts of at most 64 tokens" in md
    assert "links `" in md and "transport `" in md and "nic `" in md and "compute `" in md, "the clock's assumptions"
    mean, half, _ = closed_form(DAMAGE[("dp", 0.1, "zero")])
    assert f"{mean:+.3g} ± {half:.2g}" in md
    assert "damage_map.png" not in md, "no map drawn, none embedded"
    csv = pd.read_csv(lm_results / perplexity.CSV)
    assert len(csv) == 6 and (lm_results / perplexity.PLOT).stat().st_size > 10_000
    shutil.copy(lm_results / perplexity.PLOT, lm_results / "damage_map" / "damage_map.png")
    assert cli.main(["report", str(lm_results), "--out", str(lm_results / "elsewhere")]) == 0
    md = (lm_results / "elsewhere" / "report.md").read_text()
    assert "![damage map](../damage_map/damage_map.png)" in md
    # the map's mean and worst KL over its sites (the loss-free row, layer -1, is not a site)
    assert "Over the map's 4 sites" in md and "| m     | 1        | zero     | 0.3                | 0.6        |" in md


def test_classification_report_has_no_perplexity(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "_default_train", lambda: fake_run_experiment)
    spec = write_spec(tmp_path / "s.yaml", {"loss": ["none", "bernoulli:0.05"], "seed": [0, 1]})
    out = tmp_path / "results"
    assert cli.main(["sweep", str(spec), "--out", str(out), "--no-progress"]) == 0
    assert cli.main(["report", str(out)]) == 0
    assert "perplexity" not in (out / "report.md").read_text().lower()
    assert not (out / perplexity.CSV).exists() and "perplexity" not in pd.read_csv(out / "summary.csv")
