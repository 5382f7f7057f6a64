"""``congestion.carry`` for every connection of a step at once: the same per-message loop, flat.

A TCP step carries each connection's window through its message (``congestion.carry``): a loop over the
message's losses and the delivered packets behind them, a few float operations each, run for millions of
losses in a large job. Here the numpy work that ``carry`` does per connection (where the delivered packets
behind each loss are, the sends in sending order, the found positions' arrays) is done once per step for
all of them, and each connection's loop runs on plain floats and locals, without the flow's objects and
calls: the same float operations in the same order as ``carry`` (and ``Flow.plan``, ``Flow.advance``,
``Flow.lose``), so the same floats to the last bit (tests/test_carried.py holds every figure against
``carry``'s). Where the cubic curve rises above the Reno-friendly line (round trips of milliseconds and
more, ``congestion.CURVE``) a connection is left to ``carry`` itself.
"""
from __future__ import annotations

import math
from itertools import chain

import numpy as np

from . import carried_kernel
from .congestion import CUBIC_C, CURVE, LINE, PIPE, WINDOWS, Flow, carry

# whether the busy connections run compiled where numba is installed (tests run both ways)
COMPILED = True

NAN, INF = math.nan, math.inf


def step(kind: str, windows: np.ndarray, window: np.ndarray, row: np.ndarray, lost: np.ndarray,
         conn: np.ndarray, firsts: np.ndarray, ends: np.ndarray, taus: np.ndarray, rtts: np.ndarray,
         reveal: int, found_at: dict) -> np.ndarray:
    """One step's connections (``windows``: ``[sends, connections, 3]`` states, updated in place), each
    sending its share of its send's packets (connection ``c`` of send ``r`` the packets ``firsts[r, c]`` to
    ``ends[r, c]``, ``taus[r]`` seconds each, round trips of ``rtts[r]``) and losing those at ``lost``
    (sorted by send, then packet; ``row`` and ``conn`` say whose): per send the seconds beyond its
    loss-free time that its slowest connection's window costs (``carry``'s first figure, 0 at least), each
    connection's window at the end in ``window``, and per connection with losses where their SACKs come
    back (``carry``'s last two, in packets of the send) in ``found_at[(r, c)]``. A send with nothing lost
    whose connections were never cut is left alone (at the pipe)."""
    n, k = windows.shape[:2]
    beta, alpha = WINDOWS[kind]
    cubic = kind == "cubic"
    delays = np.zeros(n)
    counts = np.bincount(row, minlength=n) if len(row) else np.zeros(n, dtype=np.int64)
    busy = np.flatnonzero((counts > 0) | ~np.isnan(windows[:, :, 1]).all(1)).tolist()
    if not busy:
        return delays
    packets = ends - firsts + 1                                   # [send, connection]
    # per loss: its group (send x connections + connection), its place in the group, where it is in the
    # connection's packets, and the delivered packets behind it (congestion.behind, for all groups at once)
    group = row * k + conn
    m = len(group)
    bounds = np.searchsorted(group, np.arange(n * k + 1)) if m else np.zeros(n * k + 1, dtype=np.int64)
    start = bounds[group]
    index = np.arange(m) - start
    position = lost - firsts[row, conn]
    size = packets[row, conn]
    delivered = position - index
    span = int(packets.max()) + reveal + 2
    keys = group * span + delivered
    after = []
    for behind in (1, reveal):
        target = delivered + behind - 1
        before = np.searchsorted(keys, group * span + target, side="right") - start
        after.append(np.minimum(target + before, size))
    # the sends that matter, in sending order per group: a loss (0) and the delivered packets behind it (1, 2)
    whats = [np.zeros(m, dtype=np.int64), np.ones(m, dtype=np.int64), np.full(m, 2, dtype=np.int64)]
    places = [position] + after
    keep = [np.ones(m, dtype=bool), after[0] < size, after[1] < size]
    e_group = np.concatenate([group[x] for x in keep])
    e_place = np.concatenate([p[x] for p, x in zip(places, keep)])
    e_what = np.concatenate([w[x] for w, x in zip(whats, keep)])
    e_loss = np.concatenate([np.arange(m)[x] for x in keep])    # global loss index
    order = np.lexsort((e_loss, e_what, e_place, e_group))
    P, W, K = e_place[order].astype(np.float64), e_what[order], e_loss[order]
    sends = np.searchsorted(e_group[order], np.arange(n * k + 1))
    taus_l, rtts_l = taus.tolist(), rtts.tolist()
    half_cube = {}
    for r in busy:
        rtt = rtts_l[r]
        if rtt not in half_cube:
            half = math.sqrt(alpha / (3 * CUBIC_C * rtt)) / 2
            half_cube[rtt] = (half, half ** 3)
    delay_of = np.zeros(n * k)                 # each connection's delay
    kernel = carried_kernel.connections() if COMPILED else None
    if kernel is not None:
        status, outs, F0, F1 = _compiled(kernel, busy, k, cubic, beta, alpha, windows, packets, taus_l, rtts_l,
                                         half_cube, P, W, K, sends, m)
        done = np.flatnonzero(status == carried_kernel.DONE)
        r_done, c_done = np.divmod(done, k)
        windows[r_done, c_done], window[r_done, c_done] = outs[done, 1:4], outs[done, 4]
        delay_of[done] = outs[done, 0]
        left = np.flatnonzero(status == carried_kernel.PYTHON).tolist()
    else:
        F0, F1 = [NAN] * m, [NAN] * m          # where each loss's first and reveal-th SACK comes back
        left = [r * k + c for r in busy for c in range(k)]
    if left:
        _in_python(left, kind, cubic, beta, alpha, windows, window, delay_of, packets.tolist(), taus_l, rtts_l,
                   half_cube, P.tolist(), W.tolist(), K.tolist(), sends.tolist(), bounds.tolist(), position, reveal,
                   F0, F1)
    # a send's delay: its slowest connection's, 0 at least (``max(0.0, d, ...)``, a NaN passed over)
    slowest = np.fmax.reduce(delay_of.reshape(n, k), axis=1)
    delays = np.where(slowest > 0.0, slowest, 0.0)
    beyond = size + window[row, conn]           # where a SACK after the stream is, before its pace
    if m:
        firsts_l = firsts[row, conn]
        sacks, marks = np.array(F0), np.array(F1)
        sacks = np.where(np.isnan(sacks), beyond, sacks) + firsts_l
        marks = np.where(np.isnan(marks), beyond, marks) + firsts_l
        for g in np.unique(group).tolist():
            lo, hi = bounds[g], bounds[g + 1]
            found_at[divmod(g, k)] = [sacks[lo:hi], marks[lo:hi]]
    return delays


def _in_python(groups, kind, cubic, beta, alpha, windows, window, delay_of, packets, taus, rtts, half_cube, P, W, K,
               sends, bounds, position, reveal, F0, F1) -> None:
    """Connections ``groups`` (``send * connections + connection``) through ``_connection``, those whose
    window follows the cubic curve through ``carry``: their states, last windows and delays written in
    place, where their SACKs come back in ``F0``, ``F1``."""
    k = windows.shape[1]
    for g in groups:
        r, c = divmod(g, k)
        tau, rtt, size_c = taus[r], rtts[r], packets[r][c]
        half, cube = half_cube[rtt]
        got = _connection(kind, cubic, beta, alpha, windows[r, c].tolist(), size_c, tau, rtt, half, cube,
                          P, W, K, sends[g], sends[g + 1], F0, F1)
        if got is None:                 # the cubic curve: carry's own loop
            lo, hi = bounds[g], bounds[g + 1]
            delay, state, last, sacks, marks = carry(kind, windows[r, c], size_c, position[lo:hi], tau, rtt, reveal)
            F0[lo:hi], F1[lo:hi] = sacks.tolist(), marks.tolist()
        else:
            delay, *state, last = got
        windows[r, c], window[r, c], delay_of[g] = state, last, delay


def _compiled(kernel, busy, k, cubic, beta, alpha, windows, packets, taus, rtts, half_cube, P, W, K, sends, m):
    """Every busy connection through the compiled ``kernel`` (``carried_kernel.connections()``): each one's outcome and figures (as
    ``_connection`` returns them), and where SACKs come back (``F0``, ``F1``, as lists)."""
    n = len(taus)
    # per send, in Python as ``_connection`` computes them (``pipe ** 2`` is C's pow): the same floats
    pipes, p2s, halfs, cubes = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
    for r in busy:
        pipe = rtts[r] / taus[r]
        pipes[r], p2s[r] = pipe, pipe ** 2
        halfs[r], cubes[r] = half_cube[rtts[r]]
    n_groups = len(sends) - 1
    F = np.full((2, max(m, 1)), NAN)
    outs = np.empty((n_groups, 5))
    status = np.full(n_groups, -1, dtype=np.int64)   # -1: not busy
    kernel(np.array(busy, dtype=np.int64), k, cubic, beta, alpha, np.ascontiguousarray(windows, dtype=np.float64),
           packets.astype(np.float64), np.array(taus), np.array(rtts), np.array(pipes), np.array(p2s), np.array(halfs),
           np.array(cubes), P, W.astype(np.int64, copy=False), K.astype(np.int64, copy=False),
           sends.astype(np.int64, copy=False), F, outs, status)
    return status, outs, F[0, :m].tolist(), F[1, :m].tolist()


def _mode(kind: str, cubic: bool, w_max: float, cut: float, tau: float, rtt: float, alpha: float, pipe: float,
          half: float, cube: float) -> int:
    """``Flow._find_mode`` on plain floats: the shortcut of ``Flow._reno_governs`` inline, the full check
    by the flow itself."""
    if cut != cut:
        return PIPE
    if not cubic:
        return LINE
    if (pipe - cut) * rtt / alpha < half and max(w_max - cut, 0.0) / CUBIC_C < cube:
        return LINE
    return Flow(kind, (w_max, cut, 0.0), tau, rtt)._find_mode()


def _connection(kind, cubic, beta, alpha, state, packets, tau, rtt, half, cube, P, W, K, lo, hi, F0, F1):
    """``carry``'s loop for one connection, its sends ``P[lo:hi]`` (positions, as floats: ``float(x)``),
    ``W`` (what), ``K`` (the loss, a global index into ``F0``/``F1``, filled with where its SACKs come back,
    NaN: after the stream): (delay, w_max, cut, epoch, the last window), or None where the cubic curve
    governs at some point.

    ``min(a, b)`` is written ``b if b < a else a`` and ``max(a, b)`` ``b if b > a else a``: what the builtins
    return, NaN included; ``0.0 + x`` is ``x`` (never -0.0 here). Before a send the loop asks whether the
    next SACK comes back first, which ``carry`` answers by planning the send (``now + seconds``); where the
    SACK is back by ``now`` plus half the send's time at the pipe (``d * tau / 2``, d >= 1 packets), no plan
    is needed: the window is never above the pipe, so ``seconds >= d * tau`` but for rounding (at most
    ``pipe^2 * 2e-15`` of it in the square root's cancellation, well under half below 1e5 packets a round
    trip; beyond, the bound is 0), and a float sum never falls as one of its terms grows: the same answer."""
    pipe = rtt / tau
    w_max, cut, epoch = state
    mode = _mode(kind, cubic, w_max, cut, tau, rtt, alpha, pipe, half, cube)
    if mode == CURVE:
        return None
    hw = pipe if pipe < cut else cut         # the window held through recovery's round trip: min(cut, pipe)
    a2, pp, p2, onebeta, sqrt = 2 * alpha, pipe * pipe, pipe ** 2, 1 + beta, math.sqrt
    bound = tau / 2 if pipe < 1e5 else 0.0   # seconds a packet at least, half over
    line = mode == LINE
    returns = []                             # SACKs on their way back: (time, which list, loss)
    h = nret = 0
    nxt = INF                                # the next SACK's time
    now, at, starter, cut_at = 0.0, 0.0, None, None
    sends = zip(P[lo:hi], W[lo:hi], K[lo:hi]) if hi > lo else ()
    for position, what, k in chain(sends, ((float(packets), -1, -1),)):
        while True:
            d = position - at
            if not (nxt <= now + d * bound and d >= 1.0):
                # plan: the seconds sending up to ``position`` takes, and the epoch after (Flow.plan)
                if d <= 0:
                    seconds, planned = 0.0, epoch
                else:
                    sec0, e = 0.0, epoch
                    if epoch < 0:            # recovery's round trip: the window holds at its cut
                        held = -epoch * hw / rtt
                        if d < held:
                            held = d
                        sec0, d, e = held * rtt / hw, d - held, 0.0
                    if d <= 0:
                        planned = epoch + sec0
                        seconds, planned = sec0, (0.0 if 0.0 < planned else planned)
                    else:                    # the line's (or Reno's) growth from epoch e (Flow.plan)
                        if line:
                            w = cut + alpha * e / rtt
                            if w >= pipe:
                                more = d * tau
                            else:
                                ww = w * w
                                to_pipe = (pp - ww) / a2
                                more = ((pipe - w) * rtt / alpha + (d - to_pipe) * tau if d >= to_pipe
                                        else (sqrt(ww + a2 * d) - w) * rtt / alpha)
                        else:
                            more = d * tau
                        seconds, planned = (sec0 + more, more) if epoch < 0 else (more, epoch + more)
                if not nxt <= now + seconds:
                    break
            # a SACK comes back before this send: where the stream is then (Flow.advance)
            back, which, i = returns[h]
            sec = back - now
            if sec > 0:
                sent = 0.0
                if epoch < 0:
                    held = -epoch
                    if sec < held:
                        held = sec
                    sent, sec, epoch = held * hw / rtt, sec - held, epoch + held
                if sec > 0:
                    w = cut + alpha * epoch / rtt if line else pipe
                    if w >= pipe:
                        more = sec / tau
                    else:
                        to_pipe = (pipe - w) * rtt / alpha
                        if sec >= to_pipe:
                            more = (p2 - w * w) / a2 + (sec - to_pipe) / tau
                        else:
                            grown = w + alpha * sec / rtt
                            more = (grown * grown - w * w) / a2
                    sent, epoch = sent + more, epoch + sec
                at += sent
            else:
                at += 0.0
            now = back
            which[i] = at
            h += 1
            nxt = returns[h][0] if h < nret else INF
            if i == starter and which is F1 and cut_at is None:   # the episode's first loss is found: cut
                if epoch < 0:
                    w = hw
                elif line:
                    w = cut + alpha * epoch / rtt
                    if pipe < w:
                        w = pipe
                else:
                    w = pipe
                w_max = w * onebeta / 2 if cubic and w_max == w_max and w < w_max else w
                cut, epoch = beta * w, -rtt
                if 2.0 > cut:
                    cut = 2.0
                if cubic:                    # Flow._reno_governs's shortcut, else the flow's own check
                    over = w_max - cut
                    if not ((pipe - cut) * rtt / alpha < half and (0.0 if 0.0 > over else over) / CUBIC_C < cube):
                        if _mode(kind, cubic, w_max, cut, tau, rtt, alpha, pipe, half, cube) == CURVE:
                            return None
                mode, line = LINE, True
                hw = pipe if pipe < cut else cut
                cut_at, starter = at, None
        now, at, epoch = now + seconds, position, planned
        if what == 0:
            if starter is None and (cut_at is None or position >= cut_at):
                starter, cut_at = k, None
        elif what > 0:
            returns.append((now + rtt, F0 if what == 1 else F1, k))
            if h == nret:
                nxt = now + rtt
            nret += 1
    end = now
    last = hw if epoch < 0 else (pipe if mode == PIPE else min(cut + alpha * epoch / rtt, pipe))
    for back, which, i in returns[h:]:       # found after the stream: at the last window's pace
        which[i] = packets + (back - end) / rtt * last
        if i == starter and which is F1 and cut_at is None:
            w = hw if epoch < 0 else (pipe if mode == PIPE else min(cut + alpha * epoch / rtt, pipe))
            w_max = w * onebeta / 2 if cubic and w_max == w_max and w < w_max else w
            cut, epoch = max(beta * w, 2.0), -rtt
            cut_at, starter = which[i], None
    return end - packets * tau, w_max, cut, max(epoch, 0.0), last
