"""Loss models: samples against their closed forms, exact chain semantics, spec parsing.

Masks are drawn per loss event (geometric gaps and sojourn times); the checks
here judge them against closed forms, against netem's per-packet logic and
against each other across call sizes. The seeds are fixed, but every statistical threshold is chosen so that a fresh
seed would fail a correct model with probability about 1e-5 per check, and most
checks also assert that a slightly wrong model fails them, so no bound is vacuous.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy import stats

from lossysim.loss import Bernoulli, FourState, GilbertElliott, NoLoss, Trace, load_trace, parse_loss_model
from lossysim.loss import kernels, sampling
from lossysim.loss.sampling import _alternating, _bernoulli_positions

GE = GilbertElliott
ALPHA = 1e-5        # p-value threshold of every statistical check
Z_MAX = 4.0         # loss rates: within 4 burst-aware standard errors
N_LONG = 2**21      # packets of the long chain each model is judged on,
N_BURSTY = 2**22    # more for mean bursts >= 20, whose runs are few
PMF_LENGTH = 4000   # run lengths tabulated (longer ones have negligible probability here)
LONG_CALL = 1 << 16  # a long call (many events per chain); sizes around it mix long and short calls


pytestmark = pytest.mark.usefixtures("one_torch_thread")


MODELS = {
    "bernoulli-1%": Bernoulli(0.01),
    "bernoulli-30%": Bernoulli(0.3),
    "gilbert-1%-burst8": GE.from_rate(0.01, 8),
    "gilbert-5%-burst20": GE.from_rate(0.05, 20),
    "gilbert-2%-burst50": GE.from_rate(0.02, 50),
    "ge-good-loss": GE(0.002, 0.05, loss_good=0.01, loss_bad=0.8),
    "ge-bursty-good-loss": GE(0.0005, 0.01, loss_good=0.001, loss_bad=1.0),
    "anti-simple": GE(0.3, 0.9),
    "anti-good-loss": GE(0.8, 0.7, loss_good=0.1, loss_bad=0.6),
    "netem-gemodel-p-only": GE.from_netem(0.05),
    "4-state-netem-example": FourState(0.01, 0.3, 0.02, 0.8, 0.005),
    "4-state-bursty": FourState(0.0004, 0.05, 0.2, 0.3, 0.004),
}


# -- helpers ---------------------------------------------------------------------
def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def is_simple(model) -> bool:
    """Simple Gilbert: all lost in Bad, none in Good, so run lengths are geometric."""
    return isinstance(model, GE) and model.loss_bad == 1.0 and model.loss_good == 0.0


def run_lengths(lost: np.ndarray):
    """Start index and length of every run of consecutive losses in a 1-D mask."""
    edges = np.diff(np.concatenate([[0], lost.astype(np.int8), [0]]))
    starts = np.flatnonzero(edges == 1)
    return starts, np.flatnonzero(edges == -1) - starts


def complete_runs(lost: np.ndarray) -> np.ndarray:
    """Run lengths, without a last run cut short by the end of the sample."""
    lengths = run_lengths(lost)[1]
    return lengths[:-1] if lost[-1] else lengths


def rate_z(lost: np.ndarray, rate: float, variance: float) -> float:
    """Observed minus expected loss rate, in standard errors sqrt(variance / n)."""
    return (lost.mean() - rate) / math.sqrt(variance / lost.size)


def sample_in_calls(model, sizes, seed, channels=(), carry=True) -> np.ndarray:
    """One chain drawn call by call, the state passed along (or dropped when ``carry`` is False)."""
    g, state, parts = generator(seed), None, []
    for n in sizes:
        lost, next_state = model.sample((*channels, n), g, state)
        parts.append(lost)
        state = next_state if carry else None
    return torch.cat(parts, -1).numpy()


def geometric_pmf(mean: float, count: int) -> np.ndarray:
    """P(L = l) = r (1 - r)^(l - 1), r = 1 / mean, for l = 1..count."""
    r = 1.0 / mean
    return r * (1.0 - r) ** np.arange(count)


def kernel_step(model: FourState, state: int, u: float) -> int:
    """netem's loss_4state, line by line (after the 2026 fix): the state a packet moves to."""
    if state == 1:                       # TX_IN_GAP_PERIOD
        if u < model.p14:
            return 4                     # LOST_IN_GAP_PERIOD
        elif u < model.p13 + model.p14:
            return 3                     # LOST_IN_BURST_PERIOD
        return 1
    if state == 2:                       # TX_IN_BURST_PERIOD
        return 3 if u < model.p23 else 2
    if state == 3:                       # LOST_IN_BURST_PERIOD
        if u < model.p32:
            return 2
        elif u < model.p32 + model.p31:
            return 1
        return 3
    return 1                             # LOST_IN_GAP_PERIOD always returns to the gap


def kernel_matrix(model: FourState) -> np.ndarray:
    """Transition matrix measured off ``kernel_step``, which is constant between its thresholds."""
    cuts = sorted({0.0, 1.0} | {min(1.0, c) for c in (model.p14, model.p13 + model.p14, model.p23,
                                                       model.p32, model.p32 + model.p31)})
    move = np.zeros((4, 4))
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        for s in range(1, 5):
            move[s - 1, kernel_step(model, s, (lo + hi) / 2) - 1] += hi - lo
    return move


def stationary_law(move: np.ndarray) -> np.ndarray:
    values, vectors = np.linalg.eig(move.T)
    v = np.real(vectors[:, np.argmin(np.abs(values - 1))])
    return v / v.sum()


def chain_matrices(model):
    """Transition matrix, per-state loss probability and stationary law (Good, Bad).

    For the 4-state model the state is the one a packet moves to (which decides its
    fate), states 1..4 in netem's order, the matrix measured off netem's logic.
    """
    if isinstance(model, FourState):
        move = kernel_matrix(model)
        return move, np.array([0.0, 0.0, 1.0, 1.0]), stationary_law(move)
    if isinstance(model, Bernoulli):
        return np.eye(2), np.array([model.p, model.p]), np.array([1.0, 0.0])
    move = np.array([[1 - model.p_gb, model.p_gb], [model.p_bg, 1 - model.p_bg]])
    pi = np.array([model.p_bg, model.p_gb]) / (model.p_gb + model.p_bg)
    return move, np.array([model.loss_good, model.loss_bad]), pi


def phase_type_burst(model, count: int):
    """(P(L = 1..count), mean L) of a run of losses, worked out from the chain itself.

    A run starts at a loss after a delivery and goes on while the next packet is
    lost; this is independent of the closed forms in loss_models.
    """
    move, loss, pi = chain_matrices(model)
    first = (pi * (1 - loss)) @ move * loss       # law of the state of a run's first packet
    first = first / first.sum()
    go_on = move * loss                           # lost in s, next packet lost in s'
    stop = 1 - go_on.sum(1)
    pmf, v = np.empty(count), first
    for i in range(count):
        pmf[i], v = v @ stop, v @ go_on
    return pmf, first @ np.linalg.solve(np.eye(len(pi)) - go_on, np.ones(len(pi)))


def burst_pmf(model, count: int) -> np.ndarray:
    """Theory for run lengths: geometric where the reference gives it, phase-type otherwise."""
    if isinstance(model, Bernoulli) or is_simple(model):
        return geometric_pmf(model.mean_burst, count)
    return phase_type_burst(model, count)[0]


def pooled_counts(lengths: np.ndarray, pmf: np.ndarray, runs: int):
    """Bins 1..K then one tail bin, K as large as keeps every expected count >= 5 for ``runs``."""
    expected = runs * pmf
    tail = runs - np.cumsum(expected)             # expected runs longer than l
    k = 0
    while k < len(pmf) and expected[k] >= 5 and tail[k] >= 5:
        k += 1
    assert k >= 1, "too few runs for a chi-square test"
    observed = np.bincount(np.minimum(lengths, k + 1) - 1, minlength=k + 1)
    probs = np.append(pmf[:k], 1.0 - pmf[:k].sum())
    return observed, probs


def burst_chisquare(lengths: np.ndarray, pmf: np.ndarray) -> float:
    observed, probs = pooled_counts(lengths, pmf, lengths.size)
    return stats.chisquare(observed, probs * lengths.size).pvalue


def mean_burst_pvalue(lost: np.ndarray, mean: float, batches: int = 64) -> float:
    """Two-sided p-value that runs of losses average ``mean`` packets.

    Runs of a general Gilbert-Elliott chain are not independent (the state
    carries over), so the standard error is a ratio estimator's over batches of
    runs grouped by where they start, which are nearly independent.
    """
    starts, lengths = run_lengths(lost)
    batch = starts * batches // lost.size
    lost_in = np.bincount(batch, lengths, batches)
    runs_in = np.bincount(batch, minlength=batches)
    ratio = lost_in.sum() / runs_in.sum()
    se = math.sqrt(batches / (batches - 1) * ((lost_in - ratio * runs_in) ** 2).sum()) / runs_in.sum()
    return 2 * stats.t.sf(abs(ratio - mean) / se, batches - 1)


def block_variance(model, block: int) -> float:
    """Var(losses in ``block`` packets) / block, finite-block form of variance_per_packet."""
    rate = model.loss_rate
    if isinstance(model, FourState):  # sum of Bartlett-weighted autocovariances, from the chain
        move, loss, pi = chain_matrices(model)
        v, total = loss.copy(), rate * (1 - rate)
        for k in range(1, block):
            v = move @ v
            total += 2 * (1 - k / block) * ((pi * loss) @ v - rate**2)
        return total
    if isinstance(model, Bernoulli):
        return rate * (1 - rate)
    lam = 1 - model.p_gb - model.p_bg
    spread = (model.loss_bad - model.loss_good) ** 2 * model.pi_bad * (1 - model.pi_bad)
    lag_sum = lam / (1 - lam) - lam * (1 - lam**block) / (block * (1 - lam) ** 2)
    return rate * (1 - rate) + 2 * spread * lag_sum


def binom_ok(hits: int, trials: int, p: float) -> bool:
    """A count agrees with Binomial(trials, p): exactly when p is 0 or 1, else by binomtest."""
    if p in (0.0, 1.0):
        return hits == trials * p
    return stats.binomtest(int(hits), int(trials), p).pvalue > ALPHA


# -- the grid ------------------------------------------------------------------------
def test_grid_covers_bursty_good_state_loss_and_anti_persistent_chains():
    """The statistical checks below are only as good as the parameter grid they run on."""
    ge = [m for m in MODELS.values() if isinstance(m, GE)]
    assert len(MODELS) >= 8
    assert sum(m.mean_burst >= 20 for m in MODELS.values()) >= 2
    assert sum(m.loss_good > 0 for m in ge) >= 2
    assert sum(m.p_gb + m.p_bg > 1 for m in ge) >= 2
    assert any(m.mean_burst >= 20 and m.loss_good > 0 for m in ge)
    four = [m for m in MODELS.values() if isinstance(m, FourState)]
    assert len(four) >= 2 and all(m.p14 > 0 and m.p32 > 0 for m in four)  # isolated losses, 2-sojourns


@pytest.fixture(scope="module", params=list(MODELS))
def chain(request):
    """One long stationary chain per model (one call: the blocked algorithm), shared by the checks."""
    model = MODELS[request.param]
    seed = 1000 + list(MODELS).index(request.param)
    n = N_BURSTY if model.mean_burst >= 20 else N_LONG
    lost, in_bad, _ = model.sample_with_states(n, generator(seed))
    return SimpleNamespace(name=request.param, model=model, seed=seed,
                           lost=lost.numpy(), in_bad=in_bad.numpy())


@pytest.mark.parametrize("calls", ["one-call", "many-calls"])
def test_loss_rate_within_4_standard_errors(chain, calls):
    """Observed rate over >= 1e6 packets vs loss_rate, for both chain algorithms."""
    model = chain.model
    if calls == "one-call":
        lost = chain.lost
    else:  # calls just below the blocked threshold, the state passed along
        lost = sample_in_calls(model, [LONG_CALL - 1] * 16, chain.seed + 1)
    assert lost.size >= 1e6
    var = model.variance_per_packet
    assert abs(rate_z(lost, model.loss_rate, var)) < Z_MAX
    wrong = 1.25 * model.loss_rate
    if wrong - model.loss_rate > 12 * math.sqrt(var / lost.size):  # where the data can tell
        assert abs(rate_z(lost, wrong, var)) > Z_MAX


def test_variance_per_packet_matches_block_counts(chain):
    """The burst-aware variance behind every rate check is right (and the i.i.d. one is not)."""
    model, block = chain.model, 2**12
    counts = chain.lost.reshape(-1, block).sum(1).astype(float)
    observed = counts.var(ddof=1)
    centred = counts - counts.mean()
    se = math.sqrt(((centred**4).mean() - centred.var() ** 2) / counts.size)
    expected = block * block_variance(model, block)
    assert abs(observed - expected) < 5 * se
    iid = block * model.loss_rate * (1 - model.loss_rate)
    if not 1 / 8 < expected / iid < 8:
        assert abs(observed - iid) > 5 * se


def test_mean_burst_agrees_with_closed_form(chain):
    model = chain.model
    assert mean_burst_pvalue(chain.lost, model.mean_burst) > ALPHA
    assert mean_burst_pvalue(chain.lost, 1.5 * model.mean_burst) < ALPHA


def test_burst_length_distribution_chisquare(chain):
    """Run lengths vs theory; the tail is pooled so every expected count is >= 5."""
    model = chain.model
    lengths = complete_runs(chain.lost)
    pmf = burst_pmf(model, PMF_LENGTH)
    assert burst_chisquare(lengths, pmf) > ALPHA
    assert burst_chisquare(lengths, geometric_pmf(1.5 * model.mean_burst, PMF_LENGTH)) < ALPHA


def test_state_transitions_and_per_state_losses(chain):
    """in_bad moves Good->Bad w.p. p_gb, Bad->Good w.p. p_bg; losses follow the arrival state."""
    model, lost, in_bad = chain.model, chain.lost, chain.in_bad
    if isinstance(model, Bernoulli):  # no Bad state: every packet sent in Good
        assert not in_bad.any()
        return
    if isinstance(model, FourState):
        check_four_state_transitions(model, lost, in_bad)
        return
    now, after = in_bad[:-1], in_bad[1:]
    to_bad, to_good = (after & ~now).sum(), (now & ~after).sum()
    assert binom_ok(to_bad, (~now).sum(), model.p_gb)
    assert binom_ok(to_good, now.sum(), model.p_bg)
    assert binom_ok(lost[in_bad].sum(), in_bad.sum(), model.loss_bad)
    assert binom_ok(lost[~in_bad].sum(), (~in_bad).sum(), model.loss_good)
    assert not binom_ok(to_bad, (~now).sum(), min(1.0, 1.25 * model.p_gb))
    assert not binom_ok(to_good, now.sum(), min(1.0, 1.25 * model.p_bg))


def four_states(lost: np.ndarray, in_bad: np.ndarray) -> np.ndarray:
    """netem's state of each packet, read off (lost, in_bad): 1 gap, 2 burst, 3 burst loss, 4 isolated loss."""
    return np.where(lost, np.where(in_bad, 3, 4), np.where(in_bad, 2, 1))


def check_four_state_transitions(model, lost, in_bad):
    """Every move between consecutive packets happens as often as netem's logic says, and no other."""
    states = four_states(lost, in_bad)
    counts = np.zeros((4, 4), dtype=np.int64)
    np.add.at(counts, (states[:-1] - 1, states[1:] - 1), 1)
    move = kernel_matrix(model)
    assert (counts[move == 0] == 0).all()
    for i in range(4):
        for j in range(4):
            if move[i, j] > 0:
                assert binom_ok(counts[i, j], counts[i].sum(), move[i, j]), (i + 1, j + 1)
    wrong = FourState(min(1.0, 1.25 * model.p13), model.p31, model.p32, model.p23, model.p14)
    assert not binom_ok(counts[0, 2], counts[0].sum(), kernel_matrix(wrong)[0, 2])


# -- closed forms ---------------------------------------------------------------------
@pytest.mark.parametrize("name", list(MODELS))
def test_closed_form_mean_burst_matches_phase_type(name):
    """NTIA's general mean-burst formula against the chain worked out directly."""
    model = MODELS[name]
    pmf, mean = phase_type_burst(model, 200)
    assert model.mean_burst == pytest.approx(mean, rel=1e-9)
    if isinstance(model, Bernoulli) or is_simple(model):
        np.testing.assert_allclose(pmf, geometric_pmf(model.mean_burst, 200), rtol=1e-9, atol=1e-15)


def test_closed_form_loss_rate_matches_stationary_law():
    for model in MODELS.values():
        _, loss, pi = chain_matrices(model)
        assert model.loss_rate == pytest.approx(pi @ loss, rel=1e-12)


@pytest.mark.parametrize("rate,burst", [(0.01, 1), (0.01, 8), (0.05, 20), (0.3, 2), (0.5, 1)])
def test_from_rate_hits_requested_rate_and_burst(rate, burst):
    model = GE.from_rate(rate, burst)
    assert is_simple(model)
    assert model.loss_rate == pytest.approx(rate, rel=1e-12)
    assert model.mean_burst == pytest.approx(burst, rel=1e-12)


def test_from_netem_follows_gemodel_argument_order_and_defaults():
    """netem `gemodel p r 1-h 1-k`; p alone is Bernoulli, losing p (not old iproute2's p/(1+p))."""
    model = GE.from_netem(0.02, 0.3, 0.9, 0.01)
    assert (model.p_gb, model.p_bg, model.loss_bad, model.loss_good) == (0.02, 0.3, 0.9, 0.01)
    only_p = GE.from_netem(0.05)
    assert only_p.loss_rate == pytest.approx(0.05)
    assert only_p.mean_burst == pytest.approx(Bernoulli(0.05).mean_burst)
    lost = only_p.sample(2**21, generator(5))[0].numpy()
    var = only_p.variance_per_packet
    assert abs(rate_z(lost, 0.05, var)) < Z_MAX
    assert abs(rate_z(lost, 0.05 / 1.05, var)) > Z_MAX


def test_extreme_models_are_exact():
    g = generator(0)
    assert not NoLoss().sample(1000, g)[0].any() and NoLoss().lossless and NoLoss().mean_burst == 0
    assert Bernoulli(1.0).sample(1000, g)[0].all() and Bernoulli(1.0).mean_burst == math.inf
    flip = GE(1.0, 1.0)  # deterministic alternation: rate 1/2, bursts of 1, no variance
    assert (flip.loss_rate, flip.mean_burst, flip.variance_per_packet) == (0.5, 1.0, 0.0)


# -- the event algorithm, exactly --------------------------------------------------------
def expand_sojourns(ends, start, n):
    """Per-packet loop: packet t arrives in the state of the sojourn covering t (states alternate)."""
    states, j, state = [], 0, start
    for t in range(n + 1):
        while t >= ends[j]:
            j, state = j + 1, not state
        states.append(state)
    return states[:n], states[n]


CHAIN_SIZES = [5000, LONG_CALL + 77]   # two chains: above the short-call size, so sojourns are drawn
SHORT_SIZES = [0, 1, 1000, 4096]        # two chains: short calls, one uniform per packet and a scan


@pytest.mark.parametrize("n", CHAIN_SIZES)
@pytest.mark.parametrize("name", ["gilbert-5%-burst20", "anti-simple", "anti-good-loss"])
def test_masks_expand_the_drawn_sojourns_exactly(name, n):
    """White box: the chain is the drawn sojourns, written out packet by packet, and nothing else."""
    model = MODELS[name]
    g, start = generator(3), torch.tensor([False, True])
    saved = g.get_state()
    lost, in_bad, next_state = model.sample_with_states((2, n), g, start)
    g.set_state(saved)
    ends = _alternating(start, n + 1, model.p_gb, model.p_bg, g)
    for row in range(2):
        states, final = expand_sojourns(ends[row].tolist(), bool(start[row]), n)
        assert in_bad[row].tolist() == states
        assert bool(next_state[row]) == final
    if is_simple(model):
        assert torch.equal(lost, in_bad)
    else:  # losses only where the state allows them
        assert not (lost & in_bad & (model.loss_bad == 0)).any()
        assert not (lost & ~in_bad & (model.loss_good == 0)).any()


def test_the_walk_marks_the_packets_in_ranges_indexes():
    """``walk_ranges`` (compiled, and as Python) marks the very packets ``_in_ranges`` indexes, empty
    ranges, dense and sparse positions included."""
    rng = np.random.default_rng(0)
    walks = [kernels.walk_ranges, kernels.compiled("walk_ranges")]
    assert walks[1] is not None, "the dev extra installs numba"
    for trial in range(200):
        lengths = rng.integers(0, 6, size=int(rng.integers(1, 40)))
        total = int(lengths.sum())
        base = np.cumsum(lengths + rng.integers(0, 4, size=len(lengths))) - lengths   # ranges apart
        pos = np.flatnonzero(rng.random(total) < [0.05, 0.5, 0.95][trial % 3])
        expected = np.zeros(int(base[-1] + lengths[-1]) + 1, dtype=bool)
        expected[sampling._in_ranges(base, lengths, total, pos, np)] = True
        for walk in walks:
            got = np.zeros_like(expected)
            ends = lengths.cumsum(0)
            walk(got, ends, base - ends + lengths, pos, True)
            assert np.array_equal(got, expected)


@pytest.mark.parametrize("name", [name for name, model in MODELS.items()
                                  if isinstance(model, GE) and not is_simple(model)])
def test_the_compiled_walk_gives_numpys_masks(name, monkeypatch):
    """General Gilbert-Elliott's masks with the losses written by the compiled walk (numba, the fast
    extra) and by numpy's index arrays: the same, packet for packet, in short and long calls."""
    walk = kernels.compiled("walk_ranges")
    assert walk is not None, "the dev extra installs numba"
    for shape in [(2, 5000), (3, LONG_CALL + 77), (4 * LONG_CALL,)]:
        drawn = []
        for which in (None, walk):
            monkeypatch.setitem(kernels._compiled, "walk_ranges", which)
            drawn.append(MODELS[name].sample_with_states(shape, generator(5)))
        for numpy_mask, walked in zip(*drawn):
            assert torch.equal(numpy_mask, walked)


@pytest.mark.parametrize("compiled", [False, True])
def test_repeat_into_is_numpys_repeat_and_stops_at_the_buffers_end(compiled):
    """``repeat_into`` (compiled, and as Python) writes ``np.repeat``'s runs, empty, short and long ones,
    and refuses counts that do not fit, leaving the spare bytes and everything past them alone."""
    fill = kernels.compiled("repeat_into") if compiled else kernels.repeat_into
    assert fill is not None, "the dev extra installs numba"
    rng = np.random.default_rng(1)
    for trial in range(60):
        counts = rng.geometric([0.9, 0.3, 0.02][trial % 3], size=int(rng.integers(1, 300))) - 1
        values = rng.integers(0, 4, size=len(counts)).astype(np.uint8)
        total = int(counts.sum())
        out = np.full(total + 8 + 5, 255, dtype=np.uint8)
        assert fill(out[:total + 8], values, counts) == total
        assert np.array_equal(out[:total], np.repeat(values, counts))
        assert (out[total + 8:] == 255).all()
        short = np.full(total + 8, 255, dtype=np.uint8)
        if total:
            assert fill(short[:total + 7], values, counts) == -1
            assert short[-1] == 255
    assert fill(np.zeros(9, np.uint8), np.ones(2, np.uint8), np.array([1, -1])) == -1


def reference_chain(u, p_gb, p_bg, start):
    """Per-packet loop of _scan_chain's docstring: s_{t+1} = Bad iff u_t < P(Bad next | s_t)."""
    out, state = [], start
    for x in u:
        out.append(state)
        state = x < ((1 - p_bg) if state else p_gb)
    return out, state


@pytest.mark.parametrize("n", SHORT_SIZES)
@pytest.mark.parametrize("name", ["gilbert-5%-burst20", "anti-simple", "anti-good-loss"])
def test_short_calls_match_a_per_packet_loop(name, n):
    """White box: a short call's chain is netem's per-packet loop fed the same uniforms, bit for bit."""
    model = MODELS[name]
    g, start = generator(3), torch.tensor([False, True])
    saved = g.get_state()
    lost, in_bad, next_state = model.sample_with_states((2, n), g, start)
    g.set_state(saved)
    u = torch.rand((2, n), generator=g, dtype=torch.float64)
    for row in range(2):
        states, final = reference_chain(u[row].tolist(), model.p_gb, model.p_bg, bool(start[row]))
        assert in_bad[row].tolist() == states
        assert bool(next_state[row]) == final
    if is_simple(model):
        assert torch.equal(lost, in_bad)
    else:
        v = torch.rand((2, n), generator=g, dtype=torch.float64)
        assert torch.equal(lost, v < torch.where(in_bad, model.loss_bad, model.loss_good))


@pytest.mark.parametrize("q0,q1", [(0.01, 0.2), (0.9, 0.3), (1.0, 0.05)])
def test_sojourns_are_geometric_with_the_leaving_probability(q0, q1):
    """Sojourn lengths of each state follow Geometric(q) on 1, 2, ... (chi-square, pooled tail)."""
    start = torch.arange(400) % 2 == 0
    ends = _alternating(start, 20_000, q0, q1, generator(9))
    lengths = torch.diff(ends, dim=1, prepend=torch.zeros_like(ends[:, :1]))
    in_state1 = start.unsqueeze(-1) ^ (torch.arange(ends.shape[1]) % 2 == 1)
    done = ends <= 20_000                           # the last sojourn of a chain is capped
    for q, sel in ((q0, ~in_state1 & done), (q1, in_state1 & done)):
        sample = lengths[sel].numpy()
        if q == 1.0:
            assert (sample == 1).all()
            continue
        pmf = geometric_pmf(1 / q, PMF_LENGTH)
        assert burst_chisquare(sample, pmf) > ALPHA
        assert burst_chisquare(sample, geometric_pmf(1.2 / q, PMF_LENGTH)) < ALPHA
    assert (ends[:, -1] >= 20_000).all()


@pytest.mark.parametrize("n", [1001, LONG_CALL + 3])
def test_anti_persistent_extreme_alternates_across_calls(n):
    """p_gb = p_bg = 1 flips every packet: a deterministic check of the flip handling."""
    g, state, parts = generator(0), torch.tensor([False, True]), []
    for _ in range(3):
        lost, state = GE(1.0, 1.0).sample((2, n), g, state)
        parts.append(lost)
    lost = torch.cat(parts, -1)
    t = torch.arange(lost.shape[-1])
    assert torch.equal(lost[0], t % 2 == 1) and torch.equal(lost[1], t % 2 == 0)


# -- determinism -----------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1000,), (4, 1000), (LONG_CALL + 5,), (3, LONG_CALL + 5)])
@pytest.mark.parametrize("name", ["bernoulli-30%", "gilbert-1%-burst8", "anti-good-loss"])
def test_same_seed_and_state_give_identical_masks(name, shape):
    model = MODELS[name]
    for state in (None, torch.arange(math.prod(shape[:-1])).reshape(shape[:-1]) % 2 == 0):
        kept = None if state is None else state.clone()
        a = model.sample_with_states(shape, generator(7), state)
        b = model.sample_with_states(shape, generator(7), state)
        for x, y in zip(a, b):
            assert (x is None and y is None) or torch.equal(x, y)
        assert state is None or torch.equal(state, kept)  # the caller's state is not modified


@pytest.mark.parametrize("n", [50_000, LONG_CALL + 5])
@pytest.mark.parametrize("name", list(MODELS))
def test_different_seeds_give_different_masks(name, n):
    """Long enough that two equal masks (e.g. both loss-free) have negligible probability."""
    model = MODELS[name]
    assert not torch.equal(model.sample((4, n), generator(7))[0], model.sample((4, n), generator(8))[0])


def test_generator_moves_on_between_calls():
    """Never reseeded per call: two same-sized calls on one generator differ."""
    g, model = generator(1), MODELS["gilbert-1%-burst8"]
    first, state = model.sample(5000, g)
    assert not torch.equal(first, model.sample(5000, g, state)[0])


# -- a chain split over calls ------------------------------------------------------------
SPLIT_SIZES = ([1] * 200 + [2, 3, 5, 8, 13] * 40
               + [LONG_CALL - 1, 1, LONG_CALL, 7, LONG_CALL + 1, 1, 3 * LONG_CALL + 11] * 3)


@pytest.mark.parametrize("name", ["gilbert-1%-burst8", "ge-good-loss", "anti-good-loss"])
def test_split_chain_agrees_with_one_long_chain(name):
    model = MODELS[name]
    split = sample_in_calls(model, SPLIT_SIZES, seed=21)
    whole = model.sample(split.size, generator(22))[0].numpy()
    assert split.size >= 1e6
    diff = split.mean() - whole.mean()
    assert abs(diff) / math.sqrt(2 * model.variance_per_packet / split.size) < Z_MAX
    a, b = complete_runs(split), complete_runs(whole)
    pmf = burst_pmf(model, PMF_LENGTH)
    table = [pooled_counts(x, pmf, min(a.size, b.size))[0] for x in (a, b)]
    assert stats.chi2_contingency(np.array(table)).pvalue > ALPHA
    assert burst_chisquare(a, pmf) > ALPHA


@pytest.mark.parametrize("channels,sizes", [
    (1000, [1, 2, 5, 1, 17] * 12),
    (64, [LONG_CALL + 3, 1, 2, LONG_CALL]),
], ids=["small-calls", "blocked-calls"])
def test_state_is_carried_into_the_next_call(channels, sizes):
    """First packet of call k+1 follows the last of call k: lost w.p. 1 - p_bg after a loss, p_gb after none."""
    model = GE.from_rate(0.2, 50)

    def next_first(carry):
        g, state, last, pairs = generator(4), None, None, []
        for n in sizes:
            lost, next_state = model.sample((channels, n), g, state)
            if last is not None:
                pairs.append(torch.stack([last, lost[:, 0]], -1))
            last, state = lost[:, -1], (next_state if carry else None)
        pairs = torch.cat(pairs).numpy()
        return pairs[pairs[:, 0], 1], pairs[~pairs[:, 0], 1]

    after_loss, after_delivery = next_first(carry=True)
    assert binom_ok(after_loss.sum(), after_loss.size, 1 - model.p_bg)
    assert binom_ok(after_delivery.sum(), after_delivery.size, model.p_gb)
    assert after_loss.mean() > 10 * after_delivery.mean()
    forgotten, _ = next_first(carry=False)  # what a fresh chain per call would give
    assert not binom_ok(forgotten.sum(), forgotten.size, 1 - model.p_bg)


# -- specs --------------------------------------------------------------------------
INVALID_SPECS = {
    "bernoulli:1.5": ["p=1.5"],
    "bernoulli:-0.1": ["p=-0.1"],
    "bernoulli:150%": ["p=1.5"],
    "bernoulli:abc": ["p=", "abc"],
    "bernoulli:": ["p"],
    "ge:p_gb=-0.1,p_bg=0.5": ["p_gb=-0.1"],
    "ge:p_gb=0.1,p_bg=1.2": ["p_bg=1.2"],
    "ge:p_gb=0.1,p_bg=0.5,loss_bad=2": ["loss_bad=2"],
    "ge:p_gb=0.1,p_bg=0.5,loss_good=-1": ["loss_good=-1"],
    "ge:p_gb=x,p_bg=0.5": ["p_gb=", "x"],
    "ge:foo=1,p_gb=0.1,p_bg=0.5": ["foo=1"],
    "ge:p_gb=0.1": ["p_bg"],
    "ge:p_bg=0.1": ["p_gb"],
    "ge:p_gb=0,p_bg=0": ["p_gb=0", "p_bg=0"],
    "ge:rate=0.1,burst=0.5": ["burst=0.5"],
    "ge:rate=0.9,burst=2": ["rate=0.9", "burst=2"],
    "ge:rate=1.5,burst=4": ["rate=1.5"],
    "ge:rate=-0.1,burst=4": ["rate=-0.1"],
    "ge:rate=0.1": ["burst"],
    "ge:burst=4": ["rate"],
    "ge:rate=0.01,burst=4,p_gb=0.1": ["p_gb=0.1"],
    "ge:p_gb": ["p_gb"],
    "pareto:0.1": ["pareto"],
    "none:0.1": ["0.1"],
}


@pytest.mark.parametrize("spec", list(INVALID_SPECS))
def test_invalid_spec_names_bad_field_and_value(spec):
    with pytest.raises(ValueError) as err:
        parse_loss_model(spec)
    for fragment in INVALID_SPECS[spec]:
        assert fragment in str(err.value)


@pytest.mark.parametrize("spec,expected", [
    ("none", NoLoss()),
    (None, NoLoss()),
    ("off", NoLoss()),
    ("bernoulli:0", NoLoss()),
    ("bernoulli:1%", Bernoulli(0.01)),
    ("bernoulli:0.05", Bernoulli(0.05)),
    ("random:p=0.05", Bernoulli(0.05)),
    ("ge:rate=0.01,burst=8", GE.from_rate(0.01, 8)),
    ("ge:rate=1%,burst=8", GE.from_rate(0.01, 8)),
    (" GE: p_gb=0.001 , p_bg=0.2 ", GE(0.001, 0.2)),
    ("ge:p_gb=0.001,p_bg=0.2,loss_bad=0.9,loss_good=0.01", GE(0.001, 0.2, 0.01, 0.9)),
])
def test_valid_spec_parses_to_model(spec, expected):
    model = parse_loss_model(spec)
    assert type(model) is type(expected) and model == expected
    assert model.loss_rate == pytest.approx(expected.loss_rate, rel=1e-12)
    assert model.mean_burst == pytest.approx(expected.mean_burst, rel=1e-12)


@pytest.mark.parametrize("name", list(MODELS))
def test_spec_round_trips(name):
    model = MODELS[name]
    parsed = parse_loss_model(model.spec)
    assert parsed == model and parsed.spec == model.spec
    assert parsed.loss_rate == pytest.approx(model.loss_rate, rel=1e-5)  # spec keeps 6 digits
    assert parsed.mean_burst == pytest.approx(model.mean_burst, rel=1e-5)
    assert parse_loss_model(model) is model


# -- netem's vocabulary ------------------------------------------------------------------
@pytest.mark.parametrize("spec,expected", [
    ("netem:loss random 1%", Bernoulli(0.01)),
    ("netem:loss 1%", Bernoulli(0.01)),                       # netem's old syntax
    ("netem:random 0.02", Bernoulli(0.02)),
    ("netem:loss random 0%", NoLoss()),
    ("netem:loss gemodel 1% 10% 70% 0.1%", GE(0.01, 0.1, loss_good=0.001, loss_bad=0.7)),
    ("netem:loss gemodel 1% 10%", GE(0.01, 0.1)),             # 1-h = 1, 1-k = 0
    ("netem:loss gemodel 5%", GE(0.05, 0.95)),                # r = 1 - p
    ("netem:LOSS GEMODEL 0.01 0.1 0.7 0.001", GE(0.01, 0.1, loss_good=0.001, loss_bad=0.7)),
    ("netem:loss state 1% 30% 2% 80% 0.5%", FourState(0.01, 0.3, 0.02, 0.8, 0.005)),
    ("netem:loss state 1%", FourState(0.01, 0.99, 0.0, 1.0, 0.0)),   # iproute2's defaults
    ("netem:loss state 1% 30%", FourState(0.01, 0.3, 0.0, 1.0, 0.0)),
])
def test_netem_spec_parses_with_netems_defaults(spec, expected):
    model = parse_loss_model(spec)
    assert type(model) is type(expected) and model == expected
    assert parse_loss_model(model.spec) == model


NETEM_INVALID = {
    "netem:loss random 1% 25%": ["correlation=25%"],
    "netem:loss random": ["p is missing"],
    "netem:loss random 1% ecn": ["ecn"],
    "netem:loss gemodel 1% 200%": ["r=2"],
    "netem:loss gemodel 1% 10% 70% 0.1% 5%": ["at most 4"],
    "netem:loss state 50% 30% 2% 80% 60%": ["p13=0.5", "p14=0.6"],
    "netem:loss state 1% 80% 30%": ["p31=0.8", "p32=0.3"],
    "netem:loss state x%": ["p13=", "x%"],
    "netem:loss state 1% 30% 2% -80%": ["p23=-0.8"],
    "netem:loss pareto 1%": ["pareto"],
    "netem:": ["loss random"],
    "trace:": ["PATH"],
    "trace:/no/such/file.txt": ["/no/such/file.txt", "does not exist"],
}


@pytest.mark.parametrize("spec", list(NETEM_INVALID))
def test_invalid_netem_or_trace_spec_is_one_line_naming_the_field(spec):
    with pytest.raises(ValueError) as err:
        parse_loss_model(spec)
    assert "\n" not in str(err.value)
    for fragment in NETEM_INVALID[spec]:
        assert fragment in str(err.value)


# -- the 4-state model against netem's logic ------------------------------------------------
FOUR = [FourState(0.01, 0.3, 0.02, 0.8, 0.005), FourState(0.2, 0.5, 0.5, 1.0, 0.8),
        FourState(0.05), FourState(0.0, 0.3, 0.1, 0.2, 0.1)]


@pytest.mark.parametrize("model", FOUR, ids=lambda m: m.spec)
def test_four_state_matrix_and_closed_forms_follow_the_kernel(model):
    """Matrix, stationary law, loss rate and mean burst against netem's line-by-line logic."""
    move = kernel_matrix(model)
    np.testing.assert_allclose(model.transition_matrix, move, atol=1e-15)
    pi = stationary_law(move)
    np.testing.assert_allclose(model.stationary, pi, rtol=1e-9, atol=1e-15)
    assert model.loss_rate == pytest.approx(pi[2] + pi[3], rel=1e-9)
    if model.loss_rate > 0:
        assert model.mean_burst == pytest.approx(phase_type_burst(model, 10)[1], rel=1e-9)


def test_four_state_with_netem_defaults_is_bernoulli():
    """iproute2's defaults (p31 = 1 - p13, no 2-state, no isolated losses) make losses independent."""
    model = FourState(0.05)
    assert model.loss_rate == pytest.approx(0.05)
    assert model.mean_burst == pytest.approx(Bernoulli(0.05).mean_burst)
    assert model.variance_per_packet == pytest.approx(0.05 * 0.95)


def test_four_state_sampler_matches_the_kernel_loop():
    """Runs of losses and of deliveries: event sampler vs netem's per-packet loop, two-sample chi-square."""
    model = MODELS["4-state-netem-example"]
    rng, state, loop = np.random.default_rng(0), 1, np.empty(400_000, dtype=bool)
    for t, u in enumerate(rng.random(loop.size)):
        state = kernel_step(model, state, u)
        loop[t] = state >= 3
    ours = model.sample(loop.size, generator(31))[0].numpy()
    for runs_of in (True, False):
        a, b = (complete_runs(x if runs_of else ~x) for x in (loop, ours))
        top = 12 if runs_of else 400
        table = np.array([np.bincount(np.minimum(r, top), minlength=top + 1)[1:] for r in (a, b)])
        table = table[:, table.min(0) > 0]
        assert stats.chi2_contingency(table).pvalue > ALPHA
    # and the loop really is judged: a Bernoulli stream of the same rate differs
    iid = np.random.default_rng(1).random(loop.size) < model.loss_rate
    table = np.array([np.bincount(np.minimum(complete_runs(x), 12), minlength=13)[1:] for x in (loop, iid)])
    assert stats.chi2_contingency(table[:, table.min(0) > 0]).pvalue < ALPHA


def test_four_state_edge_states_continue_exactly():
    """A chain left in state 4 delivers its next packet; one left in 2 loses it w.p. p23."""
    model = FourState(0.1, 0.3, 0.4, 0.25, 0.2)
    g = generator(4)
    lost, in_bad, _ = model.sample_with_states((20_000, 1), g, torch.full((20_000,), 4))
    assert not lost.any() and not in_bad.any()
    lost, in_bad, _ = model.sample_with_states((20_000, 1), g, torch.full((20_000,), 2))
    assert in_bad.all() and binom_ok(lost.sum(), lost.numel(), model.p23)
    lost, in_bad, _ = model.sample_with_states((20_000, 1), g, torch.full((20_000,), 3))
    assert binom_ok((~lost & ~in_bad).sum(), lost.numel(), model.p31)
    assert binom_ok((~lost & in_bad).sum(), lost.numel(), model.p32)


# -- used: packets drawn but not sent -----------------------------------------------------------
USED_MODELS = ["bernoulli-30%", "gilbert-5%-burst20", "ge-good-loss", "anti-good-loss", "4-state-netem-example"]


@pytest.mark.parametrize("chains", [300, 40], ids=["long-call", "short-call"])
@pytest.mark.parametrize("name", USED_MODELS)
def test_used_state_is_the_state_after_exactly_used_packets(name, chains):
    model = MODELS[name]
    used = torch.tensor([0, 1, 40, 99, 100, 40] * 50)[:chains]
    state = None if isinstance(model, Bernoulli) else model.sample_with_states((chains, 50), generator(2))[2]
    lost, in_bad, next_state = model.sample_with_states((chains, 100), generator(5), state, used=used)
    full = model.sample_with_states((chains, 100), generator(5), state)
    assert torch.equal(lost, full[0]) and torch.equal(in_bad, full[1])   # used changes no draw
    if isinstance(model, Bernoulli):
        assert next_state is None
        return
    for c in range(chains):
        u = int(used[c])
        if u == 100:
            expected = full[2][c]
        elif isinstance(model, GE):                  # the state packet u arrives in
            expected = in_bad[c, u]
        elif u == 0:                                 # 4-state: the state the last sent packet left
            expected = state[c]
        else:
            expected = torch.tensor(four_states(lost[c, u - 1:u].numpy(), in_bad[c, u - 1:u].numpy())[0])
        assert int(next_state[c]) == int(expected), (c, u)


@pytest.mark.parametrize("name", ["gilbert-5%-burst20", "ge-good-loss", "4-state-netem-example"])
def test_drawing_100_using_40_continues_like_one_chain(name):
    """Calls of 100 packets of which 40 are sent, the state carried: the 40s join into one chain."""
    model = MODELS[name]
    g, state, parts = generator(8), None, []
    for _ in range(30):
        lost, state = model.sample((256, 100), g, state, used=torch.full((256,), 40))
        parts.append(lost[:, :40])
    joined = torch.cat(parts, 1).numpy()
    whole = model.sample((256, 1200), generator(9))[0].numpy()
    var = model.variance_per_packet
    assert abs(rate_z(joined.ravel(), model.loss_rate, var)) < Z_MAX
    # runs that straddle the joins: P(lost | previous lost) is the chain's, not a fresh chain's
    for x in (joined, whole):
        prev, nxt = x[:, 39:-1:40].ravel(), x[:, 40::40].ravel()
        pairs_ok = binom_ok(nxt[prev].sum(), prev.sum(), (x[:, 1:][x[:, :-1]]).mean())
        assert pairs_ok
    table = [np.bincount(np.minimum(np.concatenate([complete_runs(r) for r in x]), 8), minlength=9)[1:]
             for x in (joined, whole)]
    table = np.array(table)
    assert stats.chi2_contingency(table[:, table.min(0) > 0]).pvalue > ALPHA


def test_used_out_of_range_is_refused():
    with pytest.raises(ValueError, match="used"):
        MODELS["gilbert-1%-burst8"].sample((2, 10), generator(0), used=torch.tensor([3, 11]))


# -- traces -----------------------------------------------------------------------------------------
@pytest.fixture
def trace_files(tmp_path):
    lost = np.random.default_rng(3).random(5000) < 0.1
    lost[100:130] = True                                    # one long burst
    files = {"npy": tmp_path / "t.npy", "txt": tmp_path / "t.txt", "runs": tmp_path / "t.runs"}
    np.save(files["npy"], lost)
    files["txt"].write_text("# measured\n" + "\n".join(" ".join(str(int(v)) for v in row)
                                                       for row in lost.reshape(50, 100)))
    edges = np.flatnonzero(np.diff(lost.astype(int))) + 1
    runs = np.diff(np.concatenate([[0], edges, [lost.size]]))    # alternating, from lost[0]'s kind
    files["runs"].write_text(" ".join(map(str, np.r_[0, runs] if lost[0] else runs)))
    return lost, files


def test_trace_formats_load_the_same_indicator(trace_files):
    lost, files = trace_files
    for path in files.values():
        assert np.array_equal(load_trace(path), lost)
        model = parse_loss_model(f"trace:{path}")
        assert isinstance(model, Trace) and parse_loss_model(model.spec) == model
        assert model.loss_rate == pytest.approx(lost.mean())


def test_trace_statistics_are_the_traces_own():
    lost = np.array([1, 1, 0, 0, 0, 1, 0, 1, 1, 1], dtype=bool)   # runs 2, 1, 3+2 around the wrap
    model = Trace("inline", lost)
    assert model.loss_rate == 0.6 and model.mean_burst == pytest.approx(6 / 2)


def test_trace_replays_from_seeded_offsets_and_wraps(trace_files):
    lost, files = trace_files
    model = parse_loss_model(f"trace:{files['npy']}")
    g = generator(1)
    first, in_bad, state = model.sample_with_states((8, 3000), g)
    assert not in_bad.any()
    start = (state - 3000) % lost.size
    assert len(set(start.tolist())) == 8                     # every link its own offset
    for c in range(8):
        expected = np.take(lost, np.arange(int(start[c]), int(start[c]) + 3000), mode="wrap")
        assert np.array_equal(first[c].numpy(), expected)
    second, state2 = model.sample((8, 7000), g, state, used=torch.full((8,), 100))
    for c in range(8):                                      # the replay continues where it stopped
        expected = np.take(lost, np.arange(int(state[c]), int(state[c]) + 7000), mode="wrap")
        assert np.array_equal(second[c].numpy(), expected)
    assert torch.equal(state2, (state + 100) % lost.size)
    again = model.sample_with_states((8, 3000), generator(1))[0]
    assert torch.equal(again, first)


def test_trace_errors_name_the_problem(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("0 1 2")
    with pytest.raises(ValueError, match="'2'"):
        parse_loss_model(f"trace:{bad}")
    runs = tmp_path / "bad.runs"
    runs.write_text("3 -1")
    with pytest.raises(ValueError, match="negative run length -1"):
        parse_loss_model(f"trace:{runs}")
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no packets"):
        parse_loss_model(f"trace:{empty}")


@pytest.mark.parametrize("p", [0.6, 0.97])
def test_dense_bernoulli_draws_its_complement(p):
    """Above 1/2 the deliveries are drawn as events; rate and independence still hold."""
    lost = Bernoulli(p).sample(2**20, generator(6))[0].numpy()
    assert abs(rate_z(lost, p, p * (1 - p))) < Z_MAX
    assert burst_chisquare(complete_runs(lost), geometric_pmf(1 / (1 - p), PMF_LENGTH)) > ALPHA


@pytest.mark.parametrize("name", ["bernoulli-1%", "bernoulli-30%", "ge-good-loss", "anti-good-loss"])
def test_short_calls_draw_the_same_law(name):
    """Calls of one collective's size (a uniform per packet) against the closed forms and a long call."""
    model = MODELS[name]
    short = sample_in_calls(model, [2000] * 1000, seed=41, channels=(2,)).ravel()
    assert abs(rate_z(short, model.loss_rate, model.variance_per_packet)) < Z_MAX
    wrong = 1.25 * model.loss_rate
    assert abs(rate_z(short, wrong, model.variance_per_packet)) > Z_MAX
    pmf = burst_pmf(model, PMF_LENGTH)
    assert burst_chisquare(complete_runs(short), pmf) > ALPHA


@pytest.mark.parametrize("total, p", [(0, 0.1), (50, 1.0), (10, 0.0), (300_000, 0.01), (300_000, 0.5)])
def test_bernoulli_positions_are_one_rule_in_torch_or_numpy(total, p):
    """The gaps' rule is written once: numpy and torch give the same positions from the same draws
    (300 000 packets take several blocks of gaps), sorted, distinct, in range, and as many as a
    Binomial(total, p) allows."""
    got = {xp.__name__: _bernoulli_positions(total, p, torch.Generator().manual_seed(9), xp) for xp in (np, torch)}
    assert isinstance(got["numpy"], np.ndarray) and isinstance(got["torch"], torch.Tensor)
    pos = got["torch"].numpy()
    assert np.array_equal(got["numpy"], pos) and pos.dtype == got["numpy"].dtype == np.int64
    assert np.all(np.diff(pos) > 0) and (not len(pos) or 0 <= pos[0] and pos[-1] < total)
    if 0 < p < 1 and total:
        assert stats.binomtest(len(pos), total, p).pvalue > 1e-6
    else:
        assert len(pos) == total * p


# -- the long-call Gilbert-Elliott masks, held to the algorithm every published figure was drawn with --
def reference_alternating(start, cover, q0, q1, g):
    """``_alternating`` as first written: a [chains, block] scale, state by state."""
    from lossysim.loss.sampling import _MAX_EXPONENTIAL, _SPARE_FIXED, _block_size, _hazard
    chains = start.shape[0]
    cycle = (1.0 / q0 if q0 > 0 else math.inf) + (1.0 / q1 if q1 > 0 else math.inf)
    size = _block_size(2.0 * cover / cycle) if math.isfinite(cycle) else _SPARE_FIXED
    size += size % 2
    lam0, lam1 = _hazard(q0), _hazard(q1)
    scale = torch.where(start.unsqueeze(-1) ^ (torch.arange(size) % 2 == 1),
                        torch.tensor(-1.0 / lam1 if lam1 > 0 else -math.inf, dtype=torch.float64),
                        torch.tensor(-1.0 / lam0 if lam0 > 0 else -math.inf, dtype=torch.float64))
    parts, offset = [], torch.zeros(chains, 1, dtype=torch.int64)
    while True:
        x = torch.rand((chains, size), generator=g, dtype=torch.float64).neg_().log1p_().mul_(scale)
        if min(lam0, lam1) == 0.0:
            x.nan_to_num_(nan=cover, posinf=cover)
        elif _MAX_EXPONENTIAL / min(lam0, lam1) > cover:
            x.clamp_(max=cover)
        ends = x.add_(1.0).to(torch.int64).cumsum_(1).add_(offset)
        parts.append(ends)
        offset = ends[:, -1:]
        if chains == 0 or int(offset.min()) >= cover:
            return torch.cat(parts, 1)


def reference_thin_ranges(mask, base, lengths, p, g):
    """Bernoulli(p) over ranges laid end to end, each event mapped back by a binary search."""
    from lossysim.loss.sampling import _range_indices, _thin
    if p == 0.0:
        return
    if p == 1.0:
        mask[_range_indices(base, lengths)] = True
        return
    ends = lengths.cumsum(0)
    pos, value = _thin(int(ends[-1]), p, g)
    j = torch.searchsorted(ends, pos, right=True)
    if not value:
        mask[_range_indices(base, lengths)] = True
    mask[base[j] + pos - (ends[j] - lengths[j])] = value


def reference_long_ge(model, shape, g, state=None, used=None):
    """GilbertElliott.sample_with_states on a long call as first written: zero masks filled from
    index lists of the Bad and Good sojourns."""
    from lossysim.loss.sampling import _flat_chains, _range_indices, _segments_to_masks, _thin
    chains, packets, state, used = _flat_chains(shape, state, used, "cpu")
    assert chains * packets > 8192, "a long call (short ones draw a uniform per packet)"
    if state is None:
        state = torch.rand(chains, generator=g) < model.pi_bad
    state = state.to(torch.bool)
    ends = reference_alternating(state, packets + 1, model.p_gb, model.p_bg, g)
    bad = state.unsqueeze(-1) ^ (torch.arange(ends.shape[1]) % 2 == 1)
    starts = torch.cat([torch.zeros_like(ends[:, :1]), ends[:, :-1]], 1)
    which = torch.searchsorted(ends, used.unsqueeze(-1), right=True).squeeze(-1)
    bad_idx = _range_indices(*_segments_to_masks(starts, ends, bad, packets))
    in_bad, lost = torch.zeros(chains * packets, dtype=torch.bool), torch.zeros(chains * packets, dtype=torch.bool)
    in_bad[bad_idx] = True
    if model.loss_bad == 1.0:
        lost[bad_idx] = True
    elif model.loss_bad > 0.0:
        pos, value = _thin(bad_idx.numel(), model.loss_bad, g)
        if not value:
            lost[bad_idx] = True
        lost[bad_idx[pos]] = value
    reference_thin_ranges(lost, *_segments_to_masks(starts, ends, ~bad, packets), model.loss_good, g)
    return lost.view(shape), in_bad.view(shape), (state ^ (which % 2 == 1)).view(shape[:-1])


REFERENCE_MODELS = {
    "benchmark-1%": GE(0.001, 0.1, loss_good=0.001, loss_bad=0.9),       # Good events searched for
    "benchmark-low-h": GE(0.002, 0.1, loss_good=0.002, loss_bad=0.4),    # Bad events dense: offsets written
    "benchmark-20%": GE(0.05, 0.15, loss_good=0.05, loss_bad=0.65),
    "simple": GE.from_rate(0.01, 8),
    "bad-all-lost": GE(0.001, 0.2, loss_good=0.7, loss_bad=1.0),          # Good thinned from its complement
    "bad-none-lost": GE(0.01, 0.3, loss_good=0.02, loss_bad=0.0),
    "good-all-lost": GE(0.01, 0.3, loss_good=1.0, loss_bad=0.5),
    "anti-flipping": GE(1.0, 1.0, loss_good=0.1, loss_bad=0.9),
    "never-leaves-good": GE(0.0, 0.3, loss_good=0.01, loss_bad=0.9),
    "never-leaves-bad": GE(0.4, 0.0, loss_good=0.01, loss_bad=0.9),
}


@pytest.mark.parametrize("shape", [(20_000,), (3, 5000), (2, 3, 4000), (5000, 2), (300, 40)])
@pytest.mark.parametrize("name", list(REFERENCE_MODELS))
def test_long_ge_masks_are_the_first_algorithms_bit_for_bit(name, shape):
    """Same seed, same chain state and ``used``: the same lost and in_bad masks, the same next state,
    the generator left in the same state, and a continuation call the same too."""
    model = REFERENCE_MODELS[name]
    chains = math.prod(shape[:-1])
    states = [None, (torch.arange(chains) % 3 == 0).reshape(shape[:-1]), torch.ones(shape[:-1], dtype=torch.bool)]
    useds = [None, (torch.arange(chains) * 37 % (shape[-1] + 1)).reshape(shape[:-1])]
    for seed in (0, 5):
        for state in states:
            for used in useds:
                g, g_ref = generator(seed), generator(seed)
                got = model.sample_with_states(shape, g, state, used=used)
                want = reference_long_ge(model, shape, g_ref, state, used=used)
                for x, y in zip(got, want):
                    assert x.dtype == y.dtype and torch.equal(x, y), (seed, state, used)
                assert torch.equal(g.get_state(), g_ref.get_state())
                again = model.sample_with_states(shape, g, got[2])
                assert all(torch.equal(x, y) for x, y in zip(again, reference_long_ge(model, shape, g_ref, want[2])))
    assert got[0].any() or model.loss_rate < 0.02   # the masks compared are not all empty


@pytest.mark.parametrize("name", ["benchmark-1%", "benchmark-low-h", "bad-all-lost", "good-all-lost"])
def test_sojourn_masks_torch_path_matches_numpys(name):
    """The path a GPU takes (torch throughout), run on the CPU, against numpy's: same masks, same draws."""
    from lossysim.loss.sampling import _sojourn_masks
    model = REFERENCE_MODELS[name]
    for chains, packets in [(1, 30_000), (4, 5000), (5000, 2)]:
        state = torch.arange(chains) % 2 == 0
        g = generator(4)
        ends = _alternating(state, packets + 1, model.p_gb, model.p_bg, g)
        before = g.get_state()
        by_numpy = _sojourn_masks(ends, state, packets, model.loss_bad, model.loss_good, g)
        after = g.get_state()
        g.set_state(before)
        by_torch = _sojourn_masks(ends, state, packets, model.loss_bad, model.loss_good, g, xp=torch)
        assert torch.equal(g.get_state(), after)
        assert all(torch.equal(x, y) for x, y in zip(by_numpy, by_torch))


# -- the 4-state masks, held to the algorithm every published figure was drawn with --
def reference_four_state(model, shape, g, state=None, used=None):
    """FourState.sample_with_states as first written: slots of a primary and a secondary sojourn,
    the periods' phases from a scatter of ``_alternating``'s ends, masks from index lists or repeats."""
    from lossysim.loss.sampling import (_exponentials, _flat_chains, _geometric, _hazard, _range_indices,
                                        _segments_to_masks)
    chains, packets, state, used = _flat_chains(shape, state, used, "cpu")
    if state is None:
        cdf = torch.tensor(np.cumsum(model.stationary)[:3], dtype=torch.float64)
        state = torch.searchsorted(cdf, torch.rand(chains, generator=g, dtype=torch.float64), right=True) + 1
    state = state.to(torch.int64)
    q_gap, q_burst = model.p13 + model.p14, model.p31 + model.p32
    leave_gap = model.p13 / q_gap if q_gap > 0 else 0.0
    leave_burst = model.p31 / q_burst if q_burst > 0 else 0.0
    cover = packets + 1
    lead = torch.where(state == 4, 1, 0)
    lead = torch.where(state == 2, _geometric(_exponentials(chains, g), _hazard(model.p23), cover) + 1, lead)
    burst = (state == 2) | (state == 3)
    slot = model._slot_size(cover)
    seg_len, seg_state, covered = [lead.unsqueeze(-1)], [state.unsqueeze(-1)], lead.clone()
    while True:
        phase_ends = _alternating(burst, slot + 1, leave_gap, leave_burst, g)
        flips = torch.zeros(chains, slot + 2, dtype=torch.int32)
        flips.scatter_add_(1, phase_ends.clamp(max=slot + 1), torch.ones_like(phase_ends, dtype=torch.int32))
        in_burst = burst.unsqueeze(-1) ^ (flips[:, :-1].cumsum(1) % 2 == 1)
        ends_period = in_burst[:, 1:] != in_burst[:, :-1]
        in_burst = in_burst[:, :-1]
        e = _exponentials((chains, slot, 2), g)
        hazard = torch.where(in_burst, torch.tensor(_hazard(q_burst), dtype=torch.float64),
                             torch.tensor(_hazard(q_gap), dtype=torch.float64))
        primary = _geometric(e[..., 0], hazard, cover) + 1
        secondary = torch.where(in_burst, _geometric(e[..., 1], _hazard(model.p23), cover) + 1, 1)
        secondary = torch.where(ends_period, 0, secondary)
        seg_len.append(torch.stack([primary, secondary], -1).flatten(1))
        seg_state.append(torch.stack([torch.where(in_burst, 3, 1), torch.where(in_burst, 2, 4)], -1).flatten(1))
        covered = covered + (primary + secondary).sum(1)
        burst = in_burst[:, -1] ^ ends_period[:, -1]
        if chains == 0 or int(covered.min()) >= cover:
            break
    seg_len, seg_state = torch.cat(seg_len, 1), torch.cat(seg_state, 1)
    seg_end = seg_len.cumsum(1) - 1
    seg_start = seg_end - seg_len
    next_state = seg_state.gather(1, torch.searchsorted(seg_end, (used - 1).unsqueeze(-1), right=True)).squeeze(-1)
    lost, in_bad = torch.zeros(chains * packets, dtype=torch.bool), torch.zeros(chains * packets, dtype=torch.bool)
    lost[_range_indices(*_segments_to_masks(seg_start, seg_end, seg_state >= 3, packets))] = True
    in_bad[_range_indices(*_segments_to_masks(seg_start, seg_end, (seg_state == 2) | (seg_state == 3), packets))] = True
    return lost.view(shape), in_bad.view(shape), next_state.view(shape[:-1])


FOUR_STATE_REFERENCE_MODELS = {
    "benchmark-1%": FourState(0.0015, 0.3, 0.1, 0.5, 0.005),
    "benchmark-20%": FourState(0.03, 0.25, 0.15, 0.4, 0.14),
    "netem-example": FourState(0.01, 0.3, 0.02, 0.8, 0.005),
    "bursty": FourState(0.0004, 0.05, 0.2, 0.3, 0.004),
    "netem-defaults": FourState(0.05),                                    # Bernoulli: p23 = 1, no 2s, no 4s
    "isolated-only": FourState(0.0, 0.5, 0.0, 1.0, 0.1),                  # gap periods never end
    "burst-never-ends": FourState(0.01, 0.0, 0.3, 0.2, 0.01),             # p31 = 0
    "stuck-in-2": FourState(0.05, 0.0, 0.5, 0.0, 0.0),                    # p23 = 0: absorbing 2
    "lossless": FourState(0.0, 0.5, 0.2, 0.3, 0.0),                       # never leaves 1
    "sojourns-of-one": FourState(0.6, 0.7, 0.3, 1.0, 0.4),                # q_gap = q_burst = p23 = 1
    "dense": FourState(0.3, 0.2, 0.5, 0.6, 0.2),
}


@pytest.mark.parametrize("shape", [(1,), (7,), (20_000,), (3, 5000), (2, 3, 400), (5000, 2), (300, 40), (4, 0),
                                   (0, 10)])
@pytest.mark.parametrize("name", list(FOUR_STATE_REFERENCE_MODELS))
def test_four_state_masks_are_the_first_algorithms_bit_for_bit(name, shape):
    """Same seed, chain state and ``used``: the same lost and in_bad masks, the same next state, the
    generator left in the same state, and a continuation call the same too."""
    model = FOUR_STATE_REFERENCE_MODELS[name]
    chains = math.prod(shape[:-1])
    states = [None, (torch.arange(chains) % 4 + 1).reshape(shape[:-1]), torch.full(shape[:-1], 2)]
    useds = [None, (torch.arange(chains) * 37 % (shape[-1] + 1)).reshape(shape[:-1])]
    for seed in (0, 5):
        for state in states:
            for used in useds:
                g, g_ref = generator(seed), generator(seed)
                got = model.sample_with_states(shape, g, state, used=used)
                want = reference_four_state(model, shape, g_ref, state, used=used)
                for x, y in zip(got, want):
                    assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), (seed, state, used)
                assert torch.equal(g.get_state(), g_ref.get_state())
                again = model.sample_with_states(shape, g, got[2])
                assert all(torch.equal(x, y) for x, y in zip(again, reference_four_state(model, shape, g_ref, want[2])))
    assert got[0].any() or model.loss_rate == 0.0 or shape[-1] * chains < 100   # the masks compared are not all empty


@pytest.mark.parametrize("name", list(FOUR_STATE_REFERENCE_MODELS))
def test_four_state_block_in_torch_equals_numpy(name, monkeypatch):
    """A GPU runs the 4-state block's arithmetic in torch, a CPU in numpy: the same masks, next state and
    generator state from the same draws (torch's path run here on the CPU)."""
    import lossysim.loss.four_state as four_state
    model, shape = FOUR_STATE_REFERENCE_MODELS[name], (3, 20_000)
    used = torch.tensor([0, 7_777, 20_000])
    g = generator(1)
    got = model.sample_with_states(shape, g, None, used=used)
    monkeypatch.setattr(four_state, "_array_module", lambda device: torch)
    g_torch = generator(1)
    want = model.sample_with_states(shape, g_torch, None, used=used)
    for x, y in zip(got, want):
        assert x.dtype == y.dtype and torch.equal(x, y)
    assert torch.equal(g.get_state(), g_torch.get_state())


@pytest.mark.parametrize("slot", [None, 3])
@pytest.mark.parametrize("name", list(FOUR_STATE_REFERENCE_MODELS))
def test_four_states_compiled_slots_give_numpys_masks(name, slot, monkeypatch):
    """The 4-state blocks in one compiled pass (numba, the fast extra) and in numpy's arithmetic: the same
    masks, next state and generator state, in one block or in many (3 slots a block)."""
    model, shape = FOUR_STATE_REFERENCE_MODELS[name], (3, 20_000)
    compiled = kernels.compiled("four_state_slots")
    assert compiled is not None, "the dev extra installs numba"
    if slot is not None:
        monkeypatch.setattr(FourState, "_slot_size", lambda self, cover: slot)
    drawn, generators = [], []
    for which in (None, compiled):
        monkeypatch.setitem(kernels._compiled, "four_state_slots", which)
        g = generator(2)
        drawn.append([model.sample_with_states(shape, g, state, used=torch.tensor([0, 7_777, 20_000]))
                      for state in (None, torch.tensor([1, 2, 4]), torch.tensor([3, 3, 2]))])
        generators.append(g.get_state())
    for numpy_draw, compiled_draw in zip(*drawn):
        for x, y in zip(numpy_draw, compiled_draw):
            assert x.dtype == y.dtype and torch.equal(x, y)
    assert torch.equal(*generators)
