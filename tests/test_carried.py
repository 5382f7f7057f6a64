"""``carried.step``, every connection of a step carried at once, against ``congestion.carry`` one connection
at a time: every figure to the last bit (delays, states, last windows, where the SACKs come back), on
random steps of CUBIC and Reno connections, with and without losses, fresh and already cut, carried over
several steps, on round trips from a cluster's microseconds (the Reno-friendly line) to 30 ms (the cubic
curve, left to ``carry``)."""
from __future__ import annotations

import numpy as np
import pytest

from lossysim.timing import carried, carried_kernel, congestion


@pytest.fixture(autouse=True, params=["compiled", "python"])
def path(request, monkeypatch):
    """Every test twice: the busy connections through the compiled kernel (numba: the ``dev`` and ``fast``
    extras install it) and through ``carried_kernel.connection`` in Python, the path without numba."""
    if request.param == "compiled":
        assert carried_kernel.connections() is not None, "numba is not installed: pip install -e '.[dev]'"
    monkeypatch.setattr(carried, "COMPILED", request.param == "compiled")
    return request.param


def test_events_are_each_loss_and_the_delivered_packets_behind_it_in_sending_order(path):
    """``carried_kernel.events`` against ``congestion.behind``: each loss, the first delivered packet
    behind it and the reveal-th (those within the stream), sorted by (place, what, loss)."""
    rng = np.random.default_rng(7)
    events = carried_kernel.events
    if path == "compiled":
        carried_kernel.connections()
        events = carried_kernel._compiled_events
    for _ in range(300):
        size, reveal, lo = int(rng.integers(1, 300)), int(rng.integers(1, 5)), int(rng.integers(0, 4))
        lost = np.flatnonzero(rng.random(size) < rng.uniform(0, 0.7))
        places = [lost, congestion.behind(lost, size, 1), congestion.behind(lost, size, reveal)]
        expected = sorted((int(at), what, lo + i) for what, ats in enumerate(places) for i, at in enumerate(ats)
                          if at < size)
        position = np.concatenate([np.zeros(lo, dtype=np.int64), lost])   # another connection's losses first
        m = len(lost) + 1
        A1, A2, P, W, K = (np.zeros(m, dtype=np.int64), np.zeros(m, dtype=np.int64), np.zeros(3 * m),
                           np.zeros(3 * m, dtype=np.int64), np.zeros(3 * m, dtype=np.int64))
        n = events(position, lo, lo + len(lost), size, reveal, A1, A2, P, W, K)
        assert list(zip(P[:n].astype(int).tolist(), W[:n].tolist(), K[:n].tolist())) == expected


def _by_carry(kind, windows, row, packet, conn, firsts, ends, taus, rtts, reveal):
    """What ``_Rack._windows`` did before ``carried``: ``carry`` per connection."""
    n, k = windows.shape[:2]
    windows, window, sacks, marks = windows.copy(), np.zeros((n, k)), [], []
    delays = np.zeros(n)
    bounds = np.searchsorted(row, np.arange(n + 1)).tolist()
    for r in range(n):
        lo, hi = bounds[r], bounds[r + 1]
        if lo == hi and np.isnan(windows[r, :, 1]).all():
            continue
        lost = packet[lo:hi]
        split = np.searchsorted(conn[lo:hi], np.arange(k + 1)).tolist()
        for c in range(k):
            first = int(firsts[r, c])
            ours = lost[split[c]:split[c + 1]] - first
            delay, state, last, *found = congestion.carry(kind, windows[r, c], int(ends[r, c]) - first + 1, ours,
                                                          float(taus[r]), float(rtts[r]), reveal)
            windows[r, c], window[r, c] = state, last
            sacks += (found[0] + first).tolist()
            marks += (found[1] + first).tolist()
            delays[r] = max(delays[r], delay)
    return delays, windows, window, sacks, marks


def _random_step(rng, n, k, rtt_range, rate, runs=False, most=4000):
    sizes = rng.integers(k, most, size=n)
    base, extra = np.divmod(sizes, k)
    firsts = np.array([[c * b + min(c, e) for c in range(k)] for b, e in zip(base, extra)])
    ends = np.array([[firsts[r, c + 1] - 1 if c + 1 < k else sizes[r] - 1 for c in range(k)] for r in range(n)])
    rows, packets = [], []
    for r in range(n):
        lost = np.flatnonzero(rng.random(sizes[r]) < rate * rng.uniform(0, 2))
        if runs:
            lost = np.unique(np.minimum(np.concatenate([lost, lost + 1, lost + 2]), sizes[r] - 1))
        rows.append(np.full(len(lost), r))
        packets.append(lost)
    row, packet = np.concatenate(rows).astype(np.int64), np.concatenate(packets).astype(np.int64)
    conn = np.array([np.searchsorted(firsts[r], p, side="right") - 1 for r, p in zip(row, packet)], dtype=np.int64)
    rtts = 10 ** rng.uniform(*rtt_range, size=n)
    taus = rtts / 10 ** rng.uniform(0.5, 3.5, size=n)
    return row, packet, conn, firsts, ends, taus, rtts


def _same(a, b):
    return np.asarray(a, dtype=float).tobytes() == np.asarray(b, dtype=float).tobytes()


def _check(kind, windows, step, reveal):
    row, packet, conn, firsts, ends, taus, rtts = step
    want = _by_carry(kind, windows, row, packet, conn, firsts, ends, taus, rtts, reveal)
    got_windows, got_window = windows.copy(), np.zeros(windows.shape[:2])
    delays, sacks, marks = carried.step(kind, got_windows, got_window, row, packet, conn, firsts, ends, taus, rtts,
                                        reveal)
    assert _same(delays, want[0])
    assert _same(got_windows, want[1])
    assert _same(got_window, want[2])
    assert len(sacks) == len(row) and _same(sacks, want[3]) and _same(marks, want[4])
    return got_windows


@pytest.mark.parametrize("kind", ["cubic", "reno"])
@pytest.mark.parametrize("rate", [0.001, 0.01, 0.1])
def test_a_step_is_carrys_to_the_bit(kind, rate):
    """Fresh connections, cluster round trips (1 us to 1 ms), one step: every figure carry's."""
    rng = np.random.default_rng(int(rate * 1000) + len(kind))
    for trial in range(12):
        n, k = int(rng.integers(1, 6)), int(rng.integers(1, 5))
        _check(kind, congestion.fresh(n, k), _random_step(rng, n, k, (-6, -3), rate, runs=trial % 3 == 0),
               int(rng.integers(1, 4)))


@pytest.mark.parametrize("kind", ["cubic", "reno"])
def test_windows_carried_over_steps_are_carrys(kind):
    """The states one step leaves are what the next starts from: four steps in a row on the same
    connections, losses varying, some steps with none."""
    rng = np.random.default_rng(3)
    for _ in range(8):
        n, k = int(rng.integers(1, 5)), int(rng.integers(1, 4))
        windows = congestion.fresh(n, k)
        for s in range(4):
            step = _random_step(rng, n, k, (-6, -4), [0.02, 0.0, 0.005, 0.05][s])
            # the same links each step: their round trips and packet times stay
            if s == 0:
                taus, rtts = step[5], step[6]
            windows = _check(kind, windows, step[:5] + (taus, rtts), 3)


def test_the_cubic_curve_is_left_to_carry():
    """Round trips of 1 to 30 ms, where the cubic curve rises above the line (from the start or after a
    cut within the message): the same figures."""
    rng = np.random.default_rng(5)
    for _ in range(3):
        n, k = int(rng.integers(1, 4)), int(rng.integers(1, 3))
        windows = congestion.fresh(n, k)
        for rate in (0.01, 0.03):
            step = _random_step(rng, n, k, (-3, -1.5), rate, most=1500)
            if rate == 0.01:
                fixed = step[5:]
            windows = _check("cubic", windows, step[:5] + fixed, 3)


def test_nothing_lost_nothing_cut_is_left_alone():
    """A step with no losses on connections never cut: no delays, the states untouched (at the pipe)."""
    rng = np.random.default_rng(9)
    row, packet, conn, firsts, ends, taus, rtts = _random_step(rng, 3, 2, (-6, -5), 0.0)
    assert len(row) == 0
    windows, window = congestion.fresh(3, 2), np.zeros((3, 2))
    delays, sacks, marks = carried.step("cubic", windows, window, row, packet, conn, firsts, ends, taus, rtts, 3)
    assert not delays.any() and not len(sacks) and not len(marks) and not window.any()
    assert _same(windows, congestion.fresh(3, 2))


def test_cut_states_without_losses_are_carried():
    """Connections cut in an earlier step, nothing lost now: their windows grow back as carry's."""
    rng = np.random.default_rng(13)
    for kind in ("cubic", "reno"):
        windows = congestion.fresh(4, 3)
        windows = _check(kind, windows, _random_step(rng, 4, 3, (-6, -5), 0.03), 3)
        empty = _random_step(rng, 4, 3, (-6, -5), 0.0)
        assert not np.isnan(windows[:, :, 1]).all()
        _check(kind, windows, empty, 3)


@pytest.mark.parametrize("kind", ["cubic", "reno"])
def test_pipes_of_a_hundred_thousand_packets_and_more(kind):
    """Where the plan's lower bound is off (pipes of 1e5 packets a round trip and more) and around it:
    still carry's figures, over two steps."""
    rng = np.random.default_rng(17)
    for _ in range(6):
        n, k = int(rng.integers(1, 4)), int(rng.integers(1, 3))
        windows = congestion.fresh(n, k)
        for rate in (0.02, 0.005):
            step = _random_step(rng, n, k, (-5, -3), rate)
            if rate == 0.02:
                rtts = step[6]
                taus = rtts / 10 ** rng.uniform(4.5, 6, size=n)
            windows = _check(kind, windows, step[:5] + (taus, rtts), 3)
