"""``lossysim fit TRACE``: which loss model explains a measured loss trace, and with what parameters.

Four models are fitted by maximum likelihood: Bernoulli and simple Gilbert in
closed form (their states are the losses themselves), general Gilbert-Elliott
and netem's 4-state model as hidden Markov models with hmmlearn's
CategoricalHMM (Baum-Welch). Every model is then scored the same way: its
log-likelihood of the whole trace (forward algorithm), BIC, and chi-square
goodness of fit of the trace's burst lengths and gap lengths (runs of losses,
runs of deliveries) against the run-length laws the fitted chain implies. The
recommendation is the lowest-BIC model whose run lengths both fit (p >= 0.01),
or the lowest-BIC model when none does. The chi-square treats runs as
independent, which they are for Bernoulli and simple Gilbert and nearly are
otherwise: read p-values near the threshold with care.
"""
from __future__ import annotations

import argparse
import math
import warnings
from dataclasses import dataclass
from typing import Optional

import numpy as np
from scipy import stats

from .four_state import FourState
from .gilbert_elliott import GilbertElliott
from .models import Bernoulli, LossModel
from .traces import load_trace, trace_runs

GOF_ALPHA = 0.01     # run lengths "fit" when both chi-square p-values reach this
MIN_EXPECTED = 5.0   # chi-square bins are pooled until each expects this many runs
_DIGITS = 4          # significant digits kept in fitted parameters (specs stay readable)
TOLERANCE = 0.01     # Baum-Welch stops when an iteration gains less log-likelihood than this


@dataclass
class Fit:
    """One fitted model and how well it explains the trace."""

    name: str
    model: LossModel
    log_likelihood: float
    parameters: int
    bic: float
    burst_pvalue: float
    gap_pvalue: float

    @property
    def fits_runs(self) -> bool:
        return self.burst_pvalue >= GOF_ALPHA and self.gap_pvalue >= GOF_ALPHA


def _round(x: float) -> float:
    return float(f"{x:.{_DIGITS}g}")


def hmm_form(model: LossModel):
    """(start law, transition matrix, emission matrix [state, delivered/lost]) of a model.

    The state of a packet decides its fate, then the chain moves: Gilbert-Elliott's
    arrival state and the 4-state model's state after its move both read this way.
    """
    if isinstance(model, FourState):
        emission = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
        return model.stationary, model.transition_matrix, emission
    if isinstance(model, GilbertElliott):
        move = np.array([[1 - model.p_gb, model.p_gb], [model.p_bg, 1 - model.p_bg]])
        emission = np.array([[1 - model.loss_good, model.loss_good], [1 - model.loss_bad, model.loss_bad]])
        return np.array([1 - model.pi_bad, model.pi_bad]), move, emission
    if isinstance(model, Bernoulli):
        return np.ones(1), np.ones((1, 1)), np.array([[1 - model.p, model.p]])
    raise ValueError(f"model={model.spec!r} has no hidden-Markov form")


def _hmm(start, move, emission, n_iter: int = 0, params: str = "", seed: int = 0):
    from hmmlearn.hmm import CategoricalHMM

    hmm = CategoricalHMM(n_components=len(start), n_iter=n_iter, tol=TOLERANCE, params=params, init_params="",
                         random_state=seed)
    hmm.n_features = 2
    hmm.startprob_, hmm.transmat_, hmm.emissionprob_ = start, move, emission
    return hmm


def log_likelihood(model: LossModel, lost: np.ndarray) -> float:
    """log P(trace | model), the chain started from its stationary law (forward algorithm)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # log(0) of impossible paths is fine
        return float(_hmm(*hmm_form(model)).score(lost.astype(np.int64).reshape(-1, 1)))


def run_length_pmf(model: LossModel, lost_runs: bool, count: int) -> np.ndarray:
    """P(run length = 1..count) of runs of losses (or of deliveries) that the model implies."""
    start, move, emission = hmm_form(model)
    symbol = 1 if lost_runs else 0
    mine, other = emission[:, symbol], emission[:, 1 - symbol]
    first = (start * other) @ move * mine       # state of a run's first packet
    if first.sum() == 0.0:
        return np.zeros(count)
    first /= first.sum()
    go_on = move * mine                          # this packet in the run, the next one too
    stop = 1.0 - go_on.sum(1)
    pmf, v = np.empty(count), first
    for i in range(count):
        pmf[i], v = v @ stop, v @ go_on
    return pmf


def run_chisquare(lengths: np.ndarray, pmf: np.ndarray, fitted: int) -> float:
    """p-value of run lengths against ``pmf`` (lengths 1, 2, ...), bins pooled from the short end.

    Consecutive lengths are pooled until a bin expects at least MIN_EXPECTED runs
    (and about 1/40 of them), the rest go to one tail bin; ``fitted`` parameters
    are taken off the degrees of freedom (keeping at least one).
    """
    runs = lengths.size
    if runs == 0:
        return math.nan
    target = max(MIN_EXPECTED, runs / 40.0)
    cuts, acc, left = [], 0.0, float(runs)
    for length, p in enumerate(pmf, start=1):
        acc += p * runs
        if acc >= target and left - acc >= target:
            cuts.append(length)
            left, acc = left - acc, 0.0
    if not cuts:
        return math.nan                          # too few runs to judge
    edges = np.array(cuts)                       # bin i holds lengths (edges[i-1], edges[i]]
    observed = np.bincount(np.searchsorted(edges, lengths), minlength=len(cuts) + 1)
    cdf = np.cumsum(pmf)[edges - 1]
    probs = np.diff(np.concatenate([[0.0], cdf, [1.0]])).clip(min=0.0)
    ddof = min(fitted, len(cuts) - 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(stats.chisquare(observed, probs * runs, ddof=ddof).pvalue)


def _score(name: str, model: LossModel, lost: np.ndarray, parameters: int, runs) -> Fit:
    ll = log_likelihood(model, lost)
    bursts, gaps = runs
    longest = int(max(bursts.max(initial=1), gaps.max(initial=1))) + 2
    burst_p = run_chisquare(bursts, run_length_pmf(model, True, longest), parameters)
    gap_p = run_chisquare(gaps, run_length_pmf(model, False, longest), parameters)
    return Fit(name, model, ll, parameters, -2.0 * ll + parameters * math.log(lost.size), burst_p, gap_p)


def _transitions(lost: np.ndarray):
    """(losses after a delivery, deliveries followed by anything, deliveries after a loss, losses followed)."""
    now, nxt = lost[:-1], lost[1:]
    return int((~now & nxt).sum()), int((~now).sum()), int((now & ~nxt).sum()), int(now.sum())


def fit_bernoulli(lost: np.ndarray) -> Bernoulli:
    return Bernoulli(_round(lost.mean()))


def fit_gilbert(lost: np.ndarray) -> GilbertElliott:
    """Simple Gilbert: the state is the loss itself, so transition frequencies are the estimates."""
    to_bad, goods, to_good, bads = _transitions(lost)
    if goods == 0 or bads == 0:
        raise ValueError("trace has no losses or no deliveries: nothing to fit a chain to")
    return GilbertElliott(_round(to_bad / goods), _round(max(to_good, 1) / bads))


def fit_gilbert_elliott(lost: np.ndarray, n_iter: int = 100, seed: int = 0) -> GilbertElliott:
    """General Gilbert-Elliott by Baum-Welch (hmmlearn), started from the simple Gilbert fit."""
    simple = fit_gilbert(lost)
    x = lost.astype(np.int64).reshape(-1, 1)
    starts = [  # (p_gb, p_bg, loss_good, loss_bad): near simple Gilbert, and a softer one
        (simple.p_gb, simple.p_bg, 0.1 * lost.mean(), 0.9),
        (0.5 * simple.p_gb, 0.5 * simple.p_bg, 0.3 * lost.mean(), 0.6),
    ]
    best, best_score = None, -math.inf
    for p_gb, p_bg, loss_good, loss_bad in starts:
        ge = GilbertElliott(min(p_gb, 0.5), min(p_bg, 0.9), loss_good, loss_bad)
        hmm = _hmm(*hmm_form(ge), n_iter=n_iter, params="ste", seed=seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hmm.fit(x)
            score = hmm.score(x)
        if score > best_score:
            best, best_score = hmm, score
    move, emission = best.transmat_, best.emissionprob_
    bad = int(np.argmax(emission[:, 1]))
    good = 1 - bad
    return GilbertElliott(_round(move[good, bad]), _round(move[bad, good]),
                          loss_good=_round(emission[good, 1]), loss_bad=_round(emission[bad, 1]))


def fit_four_state(lost: np.ndarray, n_iter: int = 100, seed: int = 0) -> FourState:
    """netem's 4-state model by Baum-Welch on its 4-state chain, emissions fixed (1, 2 deliver; 3, 4 lose).

    Transitions netem does not have stay zero under Baum-Welch, so the fit stays a 4-state model.
    """
    simple = fit_gilbert(lost)
    start = FourState(0.5 * simple.p_gb, 0.5 * simple.p_bg, 0.5 * simple.p_bg, 0.5, 0.5 * simple.p_gb)
    hmm = _hmm(*hmm_form(start), n_iter=n_iter, params="st", seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hmm.fit(lost.astype(np.int64).reshape(-1, 1))
    a = hmm.transmat_
    p13, p14, p31, p32 = _round(a[0, 2]), _round(a[0, 3]), _round(a[2, 0]), _round(a[2, 1])
    # rounding must not push a row over 1
    p13, p31 = min(p13, 1.0 - p14), min(p31, 1.0 - p32)
    return FourState(p13, p31, p32, _round(a[1, 2]), p14)


def fit_all(lost: np.ndarray, n_iter: int = 100, seed: int = 0) -> list[Fit]:
    """Every model fitted to ``lost`` and scored; the order is by number of parameters."""
    lost = np.asarray(lost, dtype=bool)
    if lost.size < 2:
        raise ValueError(f"trace has {lost.size} packets; at least 2 are needed")
    runs = trace_runs(lost)
    bursts, gaps = _complete(lost, *runs)
    fits = [_score("bernoulli", fit_bernoulli(lost), lost, 1, (bursts, gaps))]
    if lost.any() and not lost.all():
        fits.append(_score("gilbert", fit_gilbert(lost), lost, 2, (bursts, gaps)))
        fits.append(_score("gilbert-elliott", fit_gilbert_elliott(lost, n_iter, seed), lost, 4, (bursts, gaps)))
        fits.append(_score("4-state", fit_four_state(lost, n_iter, seed), lost, 5, (bursts, gaps)))
    return fits


def _complete(lost, bursts, gaps):
    """Drop the runs cut short by the trace's two ends."""
    first_lost, last_lost = bool(lost[0]), bool(lost[-1])
    bursts = bursts[int(first_lost):bursts.size - int(last_lost)]
    gaps = gaps[int(not first_lost):gaps.size - int(not last_lost)]
    return bursts, gaps


def recommend(fits: list[Fit]) -> Fit:
    """Lowest BIC among models whose run lengths fit; lowest BIC overall when none does."""
    good = [f for f in fits if f.fits_runs]
    return min(good or fits, key=lambda f: f.bic)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="loss trace: .npy of bools, .runs run lengths, or text of 0/1 "
                                      "(a trace:PATH spec works too)")
    parser.add_argument("--max-packets", type=int, default=1_000_000,
                        help="fit on the first N packets only (hidden-state fits take ~1 s per 1e5 packets "
                             "and iteration; default 1e6)")
    parser.add_argument("--iterations", type=int, default=100, help="Baum-Welch iterations at most (default 100)")
    parser.add_argument("--seed", type=int, default=0)


def run(args) -> int:
    path = args.trace[len("trace:"):] if args.trace.startswith("trace:") else args.trace
    if args.iterations < 1:   # before the trace is read: Baum-Welch with no iteration fits nothing
        raise ValueError(f"--iterations {args.iterations}: give at least 1 Baum-Welch iteration")
    lost = load_trace(path)
    if args.max_packets < 2:
        raise ValueError(f"max-packets={args.max_packets} must be >= 2")
    if lost.size < 2:
        raise ValueError(f"trace {path!r} holds {lost.size} packet; fitting needs at least 2")
    total = lost.size
    lost = lost[:args.max_packets]
    bursts, gaps = _complete(lost, *trace_runs(lost))
    print(f"trace {path}: {total} packets" + (f", fitted on the first {lost.size}" if lost.size < total else "")
          + f"; loss rate {lost.mean():.4%}, {bursts.size} complete bursts (mean {_mean(bursts)}), "
            f"gaps mean {_mean(gaps)}")
    fits = fit_all(lost, args.iterations, args.seed)
    best = recommend(fits)
    print(f"{'model':<17}{'log-likelihood':>16}{'params':>8}{'BIC':>14}{'burst p':>10}{'gap p':>10}  spec")
    for f in fits:
        print(f"{f.name:<17}{f.log_likelihood:>16.2f}{f.parameters:>8}{f.bic:>14.2f}"
              f"{_p(f.burst_pvalue):>10}{_p(f.gap_pvalue):>10}  {f.model.spec}")
    why = "lowest BIC whose burst and gap lengths fit" if best.fits_runs else \
        "lowest BIC; no model's run lengths fit (p < 0.01)"
    print(f"recommended ({why}): {best.model.spec}")
    print(f"  loss rate {best.model.loss_rate:.4%}, mean burst {best.model.mean_burst:.3f}")
    return 0


def _mean(x: np.ndarray) -> str:
    return f"{x.mean():.3f}" if x.size else "n/a"


def _p(value: Optional[float]) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.3g}"
