"""Fitting loss models to traces: parameters recovered from traces drawn with known ones.

Tolerances: closed-form fits (Bernoulli, simple Gilbert) within 4 standard
errors; Baum-Welch fits on 1e5 packets within 25% relative per transition
probability (10% for the Bad state's loss probability, 50% for the rare
Good-state losses), which the fits here meet with room, while the models that
are too simple are rejected by the run-length tests.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lossysim.cli import main
from lossysim.loss.fit import (fit_all, fit_bernoulli, fit_four_state, fit_gilbert, log_likelihood, recommend,
                          run_chisquare, run_length_pmf)
from lossysim.loss import Bernoulli, FourState, GilbertElliott, parse_loss_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GE_TRUE = GilbertElliott(0.01, 0.1, loss_good=0.002, loss_bad=0.6)
FOUR_TRUE = FourState(0.005, 0.3, 0.2, 0.4, 0.01)


def draw(model, n, seed):
    return model.sample(n, torch.Generator().manual_seed(seed))[0].numpy()


@pytest.fixture(scope="module")
def ge_fits():
    return fit_all(draw(GE_TRUE, 100_000, 1), n_iter=100)


def by_name(fits):
    return {f.name: f for f in fits}


def test_bernoulli_and_simple_gilbert_fits_within_4_standard_errors():
    lost = draw(Bernoulli(0.03), 10**6, 2)
    p = fit_bernoulli(lost).p
    assert abs(p - 0.03) < 4 * math.sqrt(0.03 * 0.97 / lost.size)
    truth = GilbertElliott.from_rate(0.02, 5)
    lost = draw(truth, 10**6, 3)
    fitted = fit_gilbert(lost)
    goods, bads = (~lost[:-1]).sum(), lost[:-1].sum()
    assert abs(fitted.p_gb - truth.p_gb) < 4 * math.sqrt(truth.p_gb * (1 - truth.p_gb) / goods)
    assert abs(fitted.p_bg - truth.p_bg) < 4 * math.sqrt(truth.p_bg * (1 - truth.p_bg) / bads)
    assert (fitted.loss_bad, fitted.loss_good) == (1.0, 0.0)


def test_gilbert_elliott_fit_recovers_parameters(ge_fits):
    ge = by_name(ge_fits)["gilbert-elliott"].model
    assert ge.p_gb == pytest.approx(GE_TRUE.p_gb, rel=0.25)
    assert ge.p_bg == pytest.approx(GE_TRUE.p_bg, rel=0.25)
    assert ge.loss_bad == pytest.approx(GE_TRUE.loss_bad, rel=0.10)
    assert ge.loss_good == pytest.approx(GE_TRUE.loss_good, rel=0.50)


def test_too_simple_models_fail_the_run_length_tests_and_the_right_one_is_recommended(ge_fits):
    fits = by_name(ge_fits)
    assert fits["bernoulli"].gap_pvalue < 1e-3 and fits["gilbert"].gap_pvalue < 1e-3
    assert fits["gilbert-elliott"].gap_pvalue > 1e-3
    assert fits["gilbert-elliott"].log_likelihood > fits["gilbert"].log_likelihood + 100
    assert recommend(ge_fits).name == "gilbert-elliott"
    for f in ge_fits:   # every printed spec is a model lossysim runs
        assert parse_loss_model(f.model.spec) == f.model


def test_four_state_fit_recovers_parameters():
    lost = draw(FOUR_TRUE, 100_000, 4)
    fitted = fit_four_state(lost)
    for name in ("p13", "p31", "p32", "p23", "p14"):
        assert getattr(fitted, name) == pytest.approx(getattr(FOUR_TRUE, name), rel=0.25), name
    # the fitted model explains the runs of deliveries; Bernoulli at the same rate does not
    gaps = np.diff(np.flatnonzero(np.diff(np.r_[0, (~lost).astype(int), 0])))[::2][1:-1]
    assert run_chisquare(gaps, run_length_pmf(fitted, False, 20_000), 5) > 1e-3
    assert run_chisquare(gaps, run_length_pmf(Bernoulli(lost.mean()), False, 20_000), 1) < 1e-3


def test_log_likelihood_matches_the_direct_formulas():
    lost = draw(GilbertElliott.from_rate(0.05, 3), 20_000, 5)
    p = 0.05
    k = lost.sum()
    assert log_likelihood(Bernoulli(p), lost) == pytest.approx(k * math.log(p) + (lost.size - k) * math.log(1 - p),
                                                               rel=1e-9)
    g = GilbertElliott(0.02, 0.3)
    move = np.array([[1 - g.p_gb, g.p_gb], [g.p_bg, 1 - g.p_bg]])
    x = lost.astype(int)
    direct = math.log([1 - g.pi_bad, g.pi_bad][x[0]]) + np.log(move[x[:-1], x[1:]]).sum()
    assert log_likelihood(g, lost) == pytest.approx(direct, rel=1e-9)


@pytest.mark.parametrize("model", [Bernoulli(0.1), GilbertElliott.from_rate(0.05, 4), GE_TRUE, FOUR_TRUE],
                         ids=lambda m: m.spec)
def test_run_length_laws_sum_to_one_and_agree_with_mean_burst(model):
    pmf = run_length_pmf(model, True, 5000)
    assert pmf.sum() == pytest.approx(1.0, abs=1e-9)
    assert (np.arange(1, 5001) * pmf).sum() == pytest.approx(model.mean_burst, rel=1e-6)
    gaps = run_length_pmf(model, False, 20000)
    # mean gap: delivered packets per run of deliveries = (1 - rate) / rate * mean burst
    expected_gap = (1 - model.loss_rate) / model.loss_rate * model.mean_burst
    assert (np.arange(1, 20001) * gaps).sum() == pytest.approx(expected_gap, rel=1e-4)


def test_run_chisquare_rejects_a_wrong_law_and_accepts_the_right_one():
    rng = np.random.default_rng(0)
    lengths = rng.geometric(0.2, 5000)
    right, wrong = 0.2 * 0.8 ** np.arange(400), 0.25 * 0.75 ** np.arange(400)
    assert run_chisquare(lengths, right, 0) > 1e-3
    assert run_chisquare(lengths, wrong, 0) < 1e-6


def test_cli_fit_prints_every_model_and_a_recommendation(tmp_path, capsys):
    path = tmp_path / "trace.npy"
    np.save(path, draw(GilbertElliott.from_rate(0.03, 6), 40_000, 6))
    assert main(["fit", str(path), "--iterations", "20"]) == 0
    out = capsys.readouterr().out
    for name in ("bernoulli", "gilbert", "gilbert-elliott", "4-state"):
        assert f"\n{name} " in out
    spec = out.split("recommended", 1)[1].split(": ", 1)[1].splitlines()[0]
    model = parse_loss_model(spec)
    assert model.loss_rate == pytest.approx(0.03, rel=0.2)
    assert main(["fit", str(tmp_path / "missing.npy")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["", "# only a comment\n", "1\n"])
def test_cli_fit_names_a_trace_too_short_to_fit(tmp_path, capsys, text):
    path = tmp_path / "short.txt"
    path.write_text(text)
    assert main(["fit", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err and "packet" in err, err
