"""``congestion.carry`` for every connection of a step at once: the same per-message loop, flat.

A TCP step carries each connection's window through its message (``congestion.carry``): a loop over the
message's losses and the delivered packets behind them, a few float operations each, run for millions of
losses in a large job. Here the numpy work that ``carry`` does per connection (where the delivered packets
behind each loss are, the sends in sending order, the found positions' arrays) is done once per step for
all of them, and each connection's loop (``carried_kernel.connection``: compiled with numba where it is
installed, plain Python where not) runs on plain floats, without the flow's objects and calls: the same
float operations in the same order as ``carry`` (and ``Flow.plan``, ``Flow.advance``,
``Flow.lose``), so the same floats to the last bit (tests/test_carried.py holds every figure against
``carry``'s). Where the cubic curve rises above the Reno-friendly line (round trips of milliseconds and
more, ``congestion.CURVE``) a connection is left to ``carry`` itself.
"""
from __future__ import annotations

import math

import numpy as np

from . import carried_kernel
from .congestion import CUBIC_C, WINDOWS, carry

# whether the busy connections run compiled where numba is installed (tests run both ways)
COMPILED = True

NAN = math.nan


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
        left, loop = np.flatnonzero(status == carried_kernel.CARRY).tolist(), False
    else:
        F0, F1 = [NAN] * m, [NAN] * m          # where each loss's first and reveal-th SACK comes back
        left, loop = [r * k + c for r in busy for c in range(k)], True
    if left:
        _in_python(left, loop, kind, cubic, beta, alpha, windows, window, delay_of, packets.tolist(), taus_l,
                   rtts_l, half_cube, P.tolist(), W.tolist(), K.tolist(), sends.tolist(), bounds.tolist(), position,
                   reveal, F0, F1)
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


def _in_python(groups, loop, kind, cubic, beta, alpha, windows, window, delay_of, packets, taus, rtts, half_cube,
               P, W, K, sends, bounds, position, reveal, F0, F1) -> None:
    """Connections ``groups`` (``send * connections + connection``) carried in Python: through
    ``carried_kernel.connection`` (``loop``: without numba), else or where it hands them back through
    ``carry``; their states, last windows and delays written in place, where their SACKs come back in
    ``F0``, ``F1``."""
    k = windows.shape[1]
    longest = 1 + max(sends[g + 1] - sends[g] for g in groups)
    ret_t, ret_w, ret_k, out = [0.0] * longest, [0] * longest, [0] * longest, [0.0] * 5
    for g in groups:
        r, c = divmod(g, k)
        tau, rtt, size_c = taus[r], rtts[r], packets[r][c]
        outcome = carried_kernel.CARRY
        if loop:
            half, cube = half_cube[rtt]
            pipe = rtt / tau
            w_max, cut, epoch = windows[r, c].tolist()
            outcome = carried_kernel.connection(cubic, beta, alpha, w_max, cut, epoch, size_c, tau, rtt, pipe,
                                                pipe ** 2, half, cube, P, W, K, sends[g], sends[g + 1], F0, F1,
                                                ret_t, ret_w, ret_k, out)
        if outcome == carried_kernel.DONE:
            delay, *state, last = out
        else:                           # the cubic curve may govern: carry's own loop
            lo, hi = bounds[g], bounds[g + 1]
            delay, state, last, sacks, marks = carry(kind, windows[r, c], size_c, position[lo:hi], tau, rtt, reveal)
            F0[lo:hi], F1[lo:hi] = sacks.tolist(), marks.tolist()
        windows[r, c], window[r, c], delay_of[g] = state, last, delay


def _compiled(kernel, busy, k, cubic, beta, alpha, windows, packets, taus, rtts, half_cube, P, W, K, sends, m):
    """Every busy connection through the compiled ``kernel`` (``carried_kernel.connections()``): each one's
    outcome and figures, and where SACKs come back (``F0``, ``F1``, as lists)."""
    n = len(taus)
    # per send, in Python as ``_in_python`` computes them (``pipe ** 2`` is C's pow): the same floats
    pipes, p2s, halfs, cubes = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
    for r in busy:
        pipe = rtts[r] / taus[r]
        pipes[r], p2s[r] = pipe, pipe ** 2
        halfs[r], cubes[r] = half_cube[rtts[r]]
    n_groups = len(sends) - 1
    F0, F1 = np.full(m, NAN), np.full(m, NAN)
    outs = np.empty((n_groups, 5))
    status = np.full(n_groups, -1, dtype=np.int64)   # -1: not busy
    kernel(np.array(busy, dtype=np.int64), k, cubic, beta, alpha, np.ascontiguousarray(windows, dtype=np.float64),
           packets.astype(np.float64), np.array(taus), np.array(rtts), np.array(pipes), np.array(p2s), np.array(halfs),
           np.array(cubes), P, W.astype(np.int64, copy=False), K.astype(np.int64, copy=False),
           sends.astype(np.int64, copy=False), F0, F1, outs, status)
    return status, outs, F0.tolist(), F1.tolist()
