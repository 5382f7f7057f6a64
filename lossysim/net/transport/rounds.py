"""Selective repeat's bookkeeping between one round's draw and the next, compiled where numba is
installed (the ``fast`` extra): which of a round's losses went out (``went``), what stays pending and
which sends' last resends are tails (``advance``), the round's waits (``wait``) and at the end the
slowest send's repairs (``repairs``).

Written element by element so numba compiles them as they stand; ``transport.selective`` runs them when
no deadline is involved (every preset under ``retransmit``, TCP's with ``tcp._Rack`` beside them) and
numpy's passes otherwise. A wide network's step runs a few rounds of a hundred sends each, hundreds of thousands in
the 405B step, and numpy's thirty-odd calls a round cost tens of microseconds where this costs a few.
The same integers and the same IEEE additions in the same order: the same ``Result`` to the bit
(tests/test_repairs.py runs both, and these functions uncompiled).
"""
from __future__ import annotations

import numpy as np

from ...util import numba_compiled

def went(lost, width, to_send):
    """``(row, column)`` of the round's losses (flat ``row * width + column``, sorted) that went out:
    ``column < to_send[row]``."""
    row = np.empty(len(lost), dtype=np.int64)
    column = np.empty(len(lost), dtype=np.int64)
    m = 0
    for k in range(len(lost)):
        r = lost[k] // width
        c = lost[k] - r * width
        if c < to_send[r]:
            row[m], column[m] = r, c
            m += 1
    return row[:m], column[:m]


def advance(first, lost, lost_row, lost_column, width, row, packet, pending, to_send, tails, any_final, final,
            tail_resends, sent, failed, check_failures):
    """After a round's draw: ``(row, packet, pending, to_send, tail, any_tail, again)``, the (send, packet)
    pairs still pending (``again``: which of the last round's were lost again), per send how many
    (``pending``) and how many go out next round (``to_send``: none from a failed send), and which sends'
    last pending packets nothing behind reveals. ``first``: round 0,
    whose lost packets that went out are pending; later, the k-th pending packet of a send went out as its
    k-th transmission (the last column past the round's width) and is pending again if that was lost.
    Adds the round's transmissions to ``sent``; with ``check_failures`` (the retries spent) a send still
    pending fails (``failed``, in place)."""
    n = len(pending)
    tail = np.zeros(n, dtype=np.bool_)
    any_tail = False
    keep = np.zeros(len(row), dtype=np.bool_)
    if first:
        row, packet = lost_row, lost_column
        if tails.shape[0] > 0:
            for j in range(len(row)):
                if tails[row[j], packet[j]]:
                    tail[row[j]] = True
                    any_tail = True
    elif len(lost) > 0 and len(row) > 0:
        before = np.empty(n, dtype=np.int64)   # pending packets of the sends before each
        total = 0
        for s in range(n):
            before[s] = total
            total += pending[s]
        order = np.empty(len(row), dtype=np.int64)
        at = 0
        for j in range(len(row)):   # the keys only grow: one walk along the sorted losses
            order[j] = min(j - before[row[j]], width - 1)
            key = row[j] * width + order[j]
            while at < len(lost) and lost[at] < key:
                at += 1
            keep[j] = at < len(lost) and lost[at] == key
        row, packet, order = row[keep], packet[keep], order[keep]
        if any_final:
            for j in range(len(row)):
                r = row[j]
                if order[j] >= to_send[r] - tail_resends[r] and final[r]:
                    tail[r] = True
                    any_tail = True
    else:
        row, packet = row[:0], packet[:0]
    for s in range(n):
        sent[s] += to_send[s]
    pending = np.zeros(n, dtype=np.int64)
    for j in range(len(row)):
        pending[row[j]] += 1
    to_send = pending.copy()
    if check_failures:
        for s in range(n):
            if to_send[s] > 0:
                failed[s] = True
            if failed[s]:
                to_send[s] = 0
    return row, packet, pending, to_send, tail, any_tail, keep


def wait(to_send, wait_s, rtt, timer, waits, shadow, timeouts):
    """The next round's wait before it goes out, added (in place) to the waits of the sends that resend:
    ``wait_s`` under the preset, ``rtt`` under the ideal one, ``timer`` where it is a timer's. Returns the
    round's width (the most packets a send resends), 0 when none does."""
    width = 0
    for s in range(len(to_send)):
        width = max(width, to_send[s])
    if width == 0:
        return 0
    for s in range(len(to_send)):
        if to_send[s] > 0:
            waits[s] += wait_s[s]
            shadow[s] += rtt[s]
            timeouts[s] += timer[s]
    return width


def repairs(sent, packets, tau, waits, shadow):
    """``(extra, ideal)``: the slowest send's repairs, resends' wire time plus its waits (``waits``
    under the preset, ``shadow`` under the ideal one); 0 without sends."""
    extra = ideal = 0.0
    for s in range(len(sent)):
        resent = (sent[s] - packets[s]) * tau[s]
        extra = max(extra, resent + waits[s])
        ideal = max(ideal, resent + shadow[s])
    return extra, ideal


_compiled: dict = {}


def kernels():
    """``(went, advance, wait, repairs)`` compiled, or None where numba is not installed."""
    return numba_compiled(_compiled, "all", went, advance, wait, repairs)
