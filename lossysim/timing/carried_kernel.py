"""One connection's window carried through its step's sends (``connection``), those sends put in order
first (``events``: its losses and the delivered packets behind them), both run compiled with numba
where it is installed (the ``fast`` extra: ``connections()``, every busy connection of a step in one call)
and as plain Python where it is not: one loop, the same float operations in the same order either way
(numba sets no fast-math flags, so nothing is fused or reordered; the powers and per-round-trip constants
are computed by the caller in Python), so the same floats to the last bit as ``congestion.carry``
(tests/test_carried.py runs both paths against it). A connection whose window may follow the cubic curve
(the Reno-friendly shortcut does not answer) is handed back (``CARRY``): ``carried.step`` gives it to
``carry`` itself.
"""
from __future__ import annotations

import math

import numpy as np

from ..util import numba_compiled
from .congestion import CUBIC_C, LINE, PIPE

DONE, CARRY = 0, 1                # a connection's outcome: carried here, or left to ``carry``


def connection(cubic, beta, alpha, w_max, cut, epoch, packets, tau, rtt, pipe, p2, half, cube, P, W, K, lo, hi,
               F0, F1, ret_t, ret_w, ret_k, out):
    """``carry``'s loop for one connection in state ``(w_max, cut, epoch)`` sending ``packets``, its sends
    ``P[lo:hi]`` (positions, as floats), ``W`` (what: 0 a loss, 1 and 2 the delivered packets behind it
    whose SACKs find it first and at the reveal), ``K`` (the loss, a global index into ``F0``/``F1``,
    filled with where its SACKs come back; left NaN: after the stream). ``pipe`` is ``rtt / tau``, ``p2``
    ``pipe ** 2``, ``half`` and ``cube`` the Reno-friendly shortcut's bounds; ``ret_*`` room for the SACKs
    on their way back. Its outcome; ``out`` (DONE): delay, w_max, cut, epoch, the last window.

    ``min(a, b)`` is written ``b if b < a else a`` and ``max(a, b)`` ``b if b > a else a``: what the builtins
    return, NaN included. Before a send the loop asks whether the next SACK comes back first, which
    ``carry`` answers by planning the send (``now + seconds``); where the SACK is back by ``now`` plus half
    the send's time at the pipe (``d * tau / 2``, d >= 1 packets), no plan is needed: the window is never
    above the pipe, so ``seconds >= d * tau`` but for rounding (at most ``pipe^2 * 2e-15`` of it in the
    square root's cancellation, well under half below 1e5 packets a round trip; beyond, the bound is 0),
    and a float sum never falls as one of its terms grows: the same answer."""
    if cut != cut:
        mode = PIPE
    elif not cubic:
        mode = LINE
    else:                            # ``Flow._reno_governs``'s shortcut, else carry's own check
        over = w_max - cut
        if not ((pipe - cut) * rtt / alpha < half and (0.0 if 0.0 > over else over) / CUBIC_C < cube):
            return CARRY
        mode = LINE
    hw = pipe if pipe < cut else cut         # the window held through recovery's round trip: min(cut, pipe)
    a2, pp, onebeta = 2 * alpha, pipe * pipe, 1 + beta
    bound = tau / 2 if pipe < 1e5 else 0.0
    line = mode == LINE
    h = 0
    nret = 0
    nxt = math.inf                           # the next SACK's time
    now, at = 0.0, 0.0
    starter = -1
    cut_at, has_cut_at = 0.0, False
    j = lo
    while True:
        if j < hi:
            position, what, k = P[j], W[j], K[j]
        else:
            position, what, k = float(packets), -1, -1
        seconds, planned = 0.0, epoch
        while True:
            d = position - at
            if not (nxt <= now + d * bound and d >= 1.0):
                if d <= 0:
                    seconds, planned = 0.0, epoch
                else:
                    sec0, e = 0.0, epoch
                    if epoch < 0:
                        held = -epoch * hw / rtt
                        if d < held:
                            held = d
                        sec0, d, e = held * rtt / hw, d - held, 0.0
                    if d <= 0:
                        planned = epoch + sec0
                        seconds, planned = sec0, (0.0 if 0.0 < planned else planned)
                    else:
                        if line:
                            w = cut + alpha * e / rtt
                            if w >= pipe:
                                more = d * tau
                            else:
                                ww = w * w
                                to_pipe = (pp - ww) / a2
                                if d >= to_pipe:
                                    more = (pipe - w) * rtt / alpha + (d - to_pipe) * tau
                                else:
                                    more = (math.sqrt(ww + a2 * d) - w) * rtt / alpha
                        else:
                            more = d * tau
                        if epoch < 0:
                            seconds, planned = sec0 + more, more
                        else:
                            seconds, planned = more, epoch + more
                if not nxt <= now + seconds:
                    break
            back, which, i = ret_t[h], ret_w[h], ret_k[h]
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
            now = back
            if which == 0:
                F0[i] = at
            else:
                F1[i] = at
            h += 1
            nxt = ret_t[h] if h < nret else math.inf
            if i == starter and which == 1 and not has_cut_at:
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
                if cubic:
                    over = w_max - cut
                    if not ((pipe - cut) * rtt / alpha < half and (0.0 if 0.0 > over else over) / CUBIC_C < cube):
                        return CARRY
                mode, line = LINE, True
                hw = pipe if pipe < cut else cut
                cut_at, has_cut_at, starter = at, True, -1
        now, at, epoch = now + seconds, position, planned
        if what == 0:
            if starter < 0 and (not has_cut_at or position >= cut_at):
                starter, has_cut_at = k, False
        elif what > 0:
            ret_t[nret], ret_w[nret], ret_k[nret] = now + rtt, what - 1, k
            if h == nret:
                nxt = now + rtt
            nret += 1
        if j >= hi:
            break
        j += 1
    end = now
    if epoch < 0:
        last = hw
    elif mode == PIPE:
        last = pipe
    else:
        v = cut + alpha * epoch / rtt
        last = pipe if pipe < v else v
    for q in range(h, nret):
        back, which, i = ret_t[q], ret_w[q], ret_k[q]
        found = packets + (back - end) / rtt * last
        if which == 0:
            F0[i] = found
        else:
            F1[i] = found
        if i == starter and which == 1 and not has_cut_at:
            w = last   # the window then: ``last``'s expression, nothing it reads changed since
            w_max = w * onebeta / 2 if cubic and w_max == w_max and w < w_max else w
            x = beta * w
            cut, epoch = (2.0 if 2.0 > x else x), -rtt
            cut_at, has_cut_at, starter = found, True, -1
    out[0], out[1], out[2], out[3], out[4] = end - packets * tau, w_max, cut, (0.0 if 0.0 > epoch else epoch), last
    return DONE


def events(position, lo, hi, size, reveal, A1, A2, P, W, K):
    """The sends that matter on one connection of ``size`` packets, losing those at ``position[lo:hi]``
    (sorted, in the connection's packets), in sending order (place, then what, then loss): each loss (0)
    and the delivered packets behind it whose SACKs find it first (1) and at the ``reveal``-th (2), those
    within the stream: their places in ``P`` (as floats), what they are in ``W``, their loss (a global
    index, ``lo`` on) in ``K``; ``A1``, ``A2`` room for the places behind. How many there are.

    The n-th delivered packet after loss i is the (d_i + n)-th delivered overall (d_i = position - i
    delivered before it), at that count plus the losses among them (``congestion.behind``); each of the
    three sequences is sorted, so sending order is their merge."""
    m = hi - lo
    for s in range(2):
        buf = A1 if s == 0 else A2
        behind = 1 if s == 0 else reveal
        count = 0
        for i in range(m):
            target = position[lo + i] - i + behind - 1
            while count < m and position[lo + count] - count <= target:
                count += 1
            buf[i] = target + count
    n, j0, j1, j2 = 0, 0, 0, 0
    while True:
        best, place, i = -1, 0, 0
        if j0 < m:
            best, place, i = 0, position[lo + j0], j0
        if j1 < m and A1[j1] < size and (best < 0 or A1[j1] < place):
            best, place, i = 1, A1[j1], j1
        if j2 < m and A2[j2] < size and (best < 0 or A2[j2] < place):
            best, place, i = 2, A2[j2], j2
        if best < 0:
            return n
        P[n], W[n], K[n] = float(place), best, lo + i
        n += 1
        if best == 0:
            j0 += 1
        elif best == 1:
            j1 += 1
        else:
            j2 += 1


def _all(k, cubic, beta, alpha, states, window, row, lost, conn, firsts, ends, taus, rtts, p2s, halfs, cubes,
         reveal):
    """``carried.step`` for every connection ``c`` of every busy send ``r`` (a loss, or a connection once
    cut) through ``connection`` on its ``events``, the losses ``lost`` (sorted by send, then packet;
    ``row`` and ``conn`` say whose): ``(busy, status, delay_of, position, bounds, F0, F1, delays, sacks,
    marks)``, whether any send is busy, per connection ``g = r * k + c`` its outcome and delay, each loss's
    position in its connection and where its SACKs come back (NaN: after the stream), connection g's losses
    ``bounds[g]:bounds[g + 1]``, and ``carried.step``'s figures as it computes them (valid where no
    connection is left to ``carry``: CARRY). A connection carried here (DONE) has its state after in
    ``states[r, c]`` and its last window in ``window[r, c]``; ``p2s``, ``halfs`` and ``cubes`` are each
    send's powers as Python computes them."""
    n, m = len(taus), len(row)
    busy = np.zeros(n, dtype=np.bool_)
    for j in range(m):
        busy[row[j]] = True
    for r in range(n):
        for c in range(k):
            if states[r, c, 1] == states[r, c, 1]:   # cut once: not NaN
                busy[r] = True
    any_busy = False
    for r in range(n):
        any_busy = any_busy or busy[r]
    bounds = np.zeros(n * k + 1, dtype=np.int64)
    position = np.empty(m, dtype=np.int64)
    j = 0
    for g in range(n * k + 1):
        while j < m and row[j] * k + conn[j] < g:
            j += 1
        bounds[g] = j
    for j in range(m):
        position[j] = lost[j] - firsts[row[j], conn[j]]
    F0, F1 = np.full(m, np.nan), np.full(m, np.nan)
    status = np.full(n * k, -1, dtype=np.int64)    # -1: not busy
    delay_of = np.zeros(n * k)
    delays, sacks, marks = np.zeros(n), np.empty(m), np.empty(m)
    if not any_busy:
        return any_busy, status, delay_of, position, bounds, F0, F1, delays, sacks, marks
    longest = 1
    for g in range(n * k):
        longest = max(longest, bounds[g + 1] - bounds[g])
    A1, A2 = np.empty(longest, dtype=np.int64), np.empty(longest, dtype=np.int64)
    P, W, K = np.empty(3 * longest), np.empty(3 * longest, dtype=np.int64), np.empty(3 * longest, dtype=np.int64)
    ret_t = np.empty(3 * longest + 1)
    ret_w = np.empty(3 * longest + 1, dtype=np.int64)
    ret_k = np.empty(3 * longest + 1, dtype=np.int64)
    out = np.empty(5)
    for r in range(n):
        if not busy[r]:
            continue
        pipe = rtts[r] / taus[r]
        for c in range(k):
            g = r * k + c
            size = ends[r, c] - firsts[r, c] + 1
            e = _compiled_events(position, bounds[g], bounds[g + 1], size, reveal, A1, A2, P, W, K)
            status[g] = _compiled_connection(cubic, beta, alpha, states[r, c, 0], states[r, c, 1], states[r, c, 2],
                                             float(size), taus[r], rtts[r], pipe, p2s[r], halfs[r], cubes[r],
                                             P, W, K, 0, e, F0, F1, ret_t, ret_w, ret_k, out)
            if status[g] == DONE:
                delay_of[g], states[r, c, 0], states[r, c, 1], states[r, c, 2], window[r, c] = \
                    out[0], out[1], out[2], out[3], out[4]
    for r in range(n):    # its slowest connection's delay, 0 at least (a NaN passed over)
        top = np.nan
        for c in range(k):
            d = delay_of[r * k + c]
            if d == d and (top != top or d > top):
                top = d
        delays[r] = top if top > 0.0 else 0.0
    for j in range(m):    # a SACK after the stream: where it is before its pace, in the send's packets
        r, c = row[j], conn[j]
        first = float(firsts[r, c])
        beyond = float(ends[r, c] - firsts[r, c] + 1) + window[r, c] + first
        sacks[j] = beyond if F0[j] != F0[j] else F0[j] + first
        marks[j] = beyond if F1[j] != F1[j] else F1[j] + first
    return any_busy, status, delay_of, position, bounds, F0, F1, delays, sacks, marks


_compiled: dict = {}
_compiled_connection = _compiled_events = None    # compiled, which the compiled ``_all`` calls


def connections():
    """``_all`` compiled, or None where numba is not installed. numba is imported (and the kernel loaded
    from its cache, or compiled once) on first use: an estimate without TCP never pays for it."""
    global _compiled_connection, _compiled_events
    if "all" not in _compiled:
        parts = numba_compiled(_compiled, "parts", connection, events)   # None: the Python loop stands in
        if parts is not None:   # before ``_all`` compiles, which reads them as globals
            _compiled_connection, _compiled_events = parts
        _compiled["all"] = parts and numba_compiled(_compiled, "_all", _all)
    return _compiled["all"]
