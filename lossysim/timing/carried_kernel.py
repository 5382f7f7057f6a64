"""``carried._connection`` compiled (numba, the ``fast`` extra): every busy connection of a step in one call.

The same float operations in the same order as ``carried._connection`` (IEEE-754 in both: numba sets no
fast-math flags, so nothing is fused or reordered; the powers and per-round-trip constants are computed
by the caller in Python and passed in), so the same floats to the last bit; tests/test_carried.py holds
the compiled path and the Python one to ``congestion.carry``. Where ``_connection`` would call the flow's
own mode check (the Reno-friendly shortcut does not answer: the cubic curve may govern) a connection is
handed back (``PYTHON``): ``carried.step`` runs ``_connection`` on it, which leaves the curve to ``carry``.

``connections()`` is None where numba is not installed: ``carried.step`` then runs its Python loop.
"""
from __future__ import annotations

import numpy as np

from .congestion import CUBIC_C, LINE, PIPE

DONE, PYTHON = 0, 1               # a connection's outcome: carried here, or left to ``_connection``


def _shortcut(w_max, cut, rtt, alpha, pipe, half, cube):
    """``carried._mode``'s shortcut: LINE where it answers, -1 where the flow's own check must."""
    over = w_max - cut
    if (pipe - cut) * rtt / alpha < half and (0.0 if 0.0 > over else over) / CUBIC_C < cube:
        return LINE
    return -1


def _one(cubic, beta, alpha, w_max, cut, epoch, packets, tau, rtt, pipe, p2, half, cube, P, W, K, lo, hi, F,
         ret_t, ret_w, ret_k, out):
    """``carried._connection`` for one connection; ``out``: (delay, w_max, cut, epoch, last). Its outcome."""
    if cut != cut:
        mode = PIPE
    elif not cubic:
        mode = LINE
    else:
        mode = _shortcut(w_max, cut, rtt, alpha, pipe, half, cube)
        if mode < 0:
            return PYTHON
    hw = pipe if pipe < cut else cut
    a2, pp, onebeta = 2 * alpha, pipe * pipe, 1 + beta
    bound = tau / 2 if pipe < 1e5 else 0.0
    line = mode == LINE
    h = 0
    nret = 0
    nxt = np.inf
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
                                    more = (np.sqrt(ww + a2 * d) - w) * rtt / alpha
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
            F[which, i] = at
            h += 1
            nxt = ret_t[h] if h < nret else np.inf
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
                if cubic and _shortcut(w_max, cut, rtt, alpha, pipe, half, cube) < 0:
                    return PYTHON
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
        F[which, i] = packets + (back - end) / rtt * last
        if i == starter and which == 1 and not has_cut_at:
            w = last   # ``_connection``'s w: the same expression as ``last``, nothing it reads changed since
            w_max = w * onebeta / 2 if cubic and w_max == w_max and w < w_max else w
            x = beta * w
            cut, epoch = (2.0 if 2.0 > x else x), -rtt
            cut_at, has_cut_at, starter = F[which, i], True, -1
    out[0], out[1], out[2], out[3], out[4] = end - packets * tau, w_max, cut, (0.0 if 0.0 > epoch else epoch), last
    return DONE


def _all(busy, k, cubic, beta, alpha, states, packets, taus, rtts, pipes, p2s, halfs, cubes, P, W, K, sends, F,
         outs, status):
    """Every connection ``c`` of every send ``r`` in ``busy``: its outcome in ``status[r * k + c]``, its
    figures in ``outs[r * k + c]`` (DONE), SACK positions in ``F`` (``F[0]``: ``_connection``'s F0)."""
    longest = 1
    for g in range(len(sends) - 1):
        longest = max(longest, sends[g + 1] - sends[g] + 1)
    ret_t = np.empty(longest)
    ret_w = np.empty(longest, dtype=np.int64)
    ret_k = np.empty(longest, dtype=np.int64)
    for r in busy:
        for c in range(k):
            g = r * k + c
            status[g] = _one(cubic, beta, alpha, states[r, c, 0], states[r, c, 1], states[r, c, 2], packets[r, c],
                             taus[r], rtts[r], pipes[r], p2s[r], halfs[r], cubes[r], P, W, K, sends[g], sends[g + 1],
                             F, ret_t, ret_w, ret_k, outs[g])


_compiled: dict = {}


def connections():
    """``_all`` compiled, or None where numba is not installed. numba is imported (and the kernel loaded
    from its cache, or compiled once) on first use: an estimate without TCP never pays for it."""
    global _shortcut, _one
    if "all" not in _compiled:
        try:
            import numba
        except ImportError:           # the Python loop stands in
            _compiled["all"] = None
        else:
            _shortcut = numba.njit(cache=True)(_shortcut)
            _one = numba.njit(cache=True)(_one)
            _compiled["all"] = numba.njit(cache=True)(_all)
    return _compiled["all"]
