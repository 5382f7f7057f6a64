"""The loops behind the loss models' masks that numpy cannot write without index arrays: compiled with
numba where the ``fast`` extra is installed, and absent otherwise (their callers keep numpy's path,
which gives the same masks)."""
from __future__ import annotations

import numpy as np

from ..util import numba_compiled

_compiled: dict = {}


def compiled(name: str):
    """The loop ``name`` of this module compiled (once), or None where numba is not installed."""
    # numpy's error model: a float divided by zero is inf or nan (IEEE), as in numpy's path
    return numba_compiled(_compiled, name, globals()[name], error_model="numpy")


def walk_ranges(lost, ends, shift, pos, value):
    """``lost[shift[j] + p] = value`` for each of the sorted positions ``p``, ``j`` its range (the first
    whose end is past it: ``searchsorted(ends, p, side="right")``)."""
    j = 0
    for i in range(len(pos)):
        p = pos[i]
        while ends[j] <= p:
            j += 1
        lost[shift[j] + p] = value


def repeat_into(out, values, counts):
    """``out[:total] = numpy.repeat(values, counts)``, ``total`` returned (-1, nothing past ``out``
    written, if the counts do not fit in all but the last 8). A run of up to 8 is written as 8 stores,
    the next run writing over the spare ones: no branch on a short run's length."""
    p, limit = 0, len(out) - 8
    for j in range(len(counts)):
        n = counts[j]
        if n < 0 or p + n > limit:
            return -1
        if n <= 8:
            for i in range(8):
                out[p + i] = values[j]
        else:
            out[p:p + n] = values[j]
        p += n
    return p


def four_state_slots(x, phase_ends, burst, neg_gap, neg_burst, neg_rate_2, cap, length, code, ends, offset, first):
    """One block of ``FourState``'s slots as segments, written from column ``first`` of ``length`` and
    ``code``, and every column's end (``offset`` plus the lengths so far) into ``ends``.

    Chain c's phases alternate from ``burst[c]``, phase k ending before slot ``phase_ends[c, k]``; slot s
    holds a primary sojourn of 1 + floor(E / lam) packets, -E = ``x[c, s, 0]`` and lam its period's rate
    (min with ``cap``, nan included, as ``four_state._cap``), then a secondary: 1 + floor(E' ``neg_rate_2``)
    in a burst, 1 (a single 4) in a gap, none (0) where the period ends; codes lost | in_bad << 1. The
    same IEEE operations as numpy. Returns each chain's
    period after the block (slot ``slots``'s, the next block's first).
    """
    chains, slots = x.shape[0], x.shape[1]
    after = np.empty(chains, np.bool_)
    for c in range(chains):
        total = offset[c]
        for j in range(first):
            total += length[c, j]
            ends[c, j] = total
        here, start, k = burst[c], 0, 0
        while start < slots:
            stop = phase_ends[c, k]
            if stop > start:
                j = first + 2 * start
                if here:
                    for s in range(start, min(stop, slots)):
                        v, w = x[c, s, 0] / neg_burst, x[c, s, 1] * neg_rate_2
                        length[c, j], code[c, j] = np.int64(v if v <= cap else cap) + 1, 3
                        length[c, j + 1], code[c, j + 1] = np.int64(w if w <= cap else cap) + 1, 2
                        total += length[c, j]
                        ends[c, j] = total
                        total += length[c, j + 1]
                        ends[c, j + 1] = total
                        j += 2
                else:
                    for s in range(start, min(stop, slots)):
                        v = x[c, s, 0] / neg_gap
                        length[c, j], code[c, j] = np.int64(v if v <= cap else cap) + 1, 0
                        length[c, j + 1], code[c, j + 1] = 1, 1
                        total += length[c, j]
                        ends[c, j] = total
                        total += 1
                        ends[c, j + 1] = total
                        j += 2
                if stop <= slots:    # the period ends in slot stop - 1: no secondary there
                    total -= length[c, j - 1]
                    ends[c, j - 1], length[c, j - 1] = total, 0
                start = stop
            here, k = not here, k + 1
        after[c] = here if start == slots else not here   # the last one written, unless it ended there
    return after
