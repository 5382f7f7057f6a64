"""RACK's round 0 (``tcp._Rack.first``) for every connection of a step in one call, compiled with numba
where it is installed (the ``fast`` extra) and as plain Python where it is not: when each of the
message's losses is found and where its resend goes out, each connection's wait and latest delivered
position, and its suspects (the losses nothing delivered behind reveals).

A large job's TCP step has hundreds of thousands of connections with a loss or two each; numpy's dozen
calls per connection cost tens of microseconds where this loop costs one. Written element by element
so numba compiles it as it stands: the same integers and the same IEEE operations in the same order as
the numpy passes it replaced, so the same floats to the bit (tests/test_rack_kernel.py runs it both
ways against the rows it printed before).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from ...util import numba_compiled

AFTER_TIMER = 1e12   # a position after a timer: behind everything the connection sent before it
TIE = 1e-7           # resends marked lost together go out in sequence order
PROBE, RTO = 0, 1    # a suspect's timer


class Suspects(NamedTuple):
    """A round's losses that nothing delivered behind reveals, one entry per connection, in order: its
    send and connection, the latest position its connection sent (a delivered transmission sent after it
    reveals them), its timer (``kind``; ``flag``: one packet out for the probe, armed by the last ACK for
    the RTO) and its losses ``packet[start[i]:start[i + 1]]``."""
    row: np.ndarray
    conn: np.ndarray
    at: np.ndarray
    kind: np.ndarray
    flag: np.ndarray
    start: np.ndarray
    packet: np.ndarray

    @classmethod
    def first(cls, count: int, *arrays) -> "Suspects":
        """The first ``count`` entries of a kernel's arrays (``Suspects``' fields, in order)."""
        row, conn, at, kind, flag, start, packet = arrays
        return cls(row[:count], conn[:count], at[:count], kind[:count], flag[:count], start[:count + 1],
                   packet[:start[count]])


def first(row, packet, conn, final, firsts, ends, window, rtt, reorder, dupacks, sacks, marks, latest):
    """Round 0 of every connection with losses (``row``, ``packet``, ``conn``: the losses, sorted by send
    then packet, so each connection's a run; ``sacks`` and ``marks`` where each loss's first and
    ``dupacks``-th SACK behind it come back, empty without a congestion window: a window of packets on;
    ``reorder`` each send's reordering timer): ``latest`` in place, and ``(waits, timer, nxt, count,
    *suspects)``: per send and connection the round's wait and whether it was a timer's, per loss where
    its resend goes out, and the first ``count`` of ``Suspects``' arrays (``at``: the connection's end).

    A send that is not its link's last in the collective has later traffic on every connection: its
    losses wait a round trip and go out a window after they were lost. On a link's last send a loss with
    ``dupacks`` delivered behind it, or one delivered behind it in recovery, is found by that SACK (a
    round trip); with fewer outside recovery after the reordering timer. A recovery episode lasts from
    its first resend until its last resend's ACK comes back."""
    m = len(row)
    waits, timer, nxt = np.zeros(latest.shape), np.zeros(latest.shape, dtype=np.bool_), np.zeros(m)
    s_row, s_conn, s_at, s_kind = np.zeros(m, dtype=np.int64), np.zeros(m, dtype=np.int64), np.zeros(m), \
        np.zeros(m, dtype=np.int64)
    s_flag, s_start, s_packet = np.zeros(m, dtype=np.bool_), np.zeros(m + 1, dtype=np.int64), \
        np.zeros(m, dtype=np.int64)
    suspects = 0
    lo = 0
    while lo < m:
        r, c = row[lo], conn[lo]
        hi = lo + 1
        while hi < m and row[hi] == r and conn[hi] == c:
            hi += 1
        end = ends[r, c]
        count = hi - lo
        trailing = 0                   # the run's last losses with nothing delivered behind them
        for j in range(lo, hi):
            if (end - packet[j]) - (count - 1 - (j - lo)) == 0:
                trailing += 1
        latest[r, c] = end - trailing
        waits[r, c] = rtt[r]
        w = window[r, c]
        if not final[r]:
            for j in range(lo, hi):
                nxt[j] = packet[j] + w
            lo = hi
            continue
        episode0, episode1 = -math.inf, -math.inf
        reordered = False
        after_timer = float(end) + AFTER_TIMER
        first_c = firsts[r, c]
        size = end - first_c + 1
        a1 = a2 = lo     # the walks for the first and dupacks-th delivered packet behind (``congestion.behind``)
        for j in range(lo, hi):
            behind = (end - packet[j]) - (count - 1 - (j - lo))
            if behind == 0:
                continue
            i = packet[j]
            if len(sacks):
                sack, mark = sacks[j], marks[j]
            else:   # the n-th delivered after loss j: past the losses with no more than target delivered before
                before = (i - first_c) - (j - lo)
                while a1 < hi and (packet[a1] - first_c) - (a1 - lo) <= before:
                    a1 += 1
                while a2 < hi and (packet[a2] - first_c) - (a2 - lo) <= before + dupacks - 1:
                    a2 += 1
                spot1, spot2 = before + (a1 - lo), before + dupacks - 1 + (a2 - lo)
                sack = (spot1 if spot1 < size else size) + first_c + w
                mark = (spot2 if spot2 < size else size) + first_c + w
            sack = sack - 0.5
            if episode0 <= sack < episode1:
                resend = sack
            elif behind >= dupacks:
                resend = mark - 0.5
                if resend >= episode1:
                    episode0 = resend
            else:
                reordered = True
                nxt[j] = after_timer + TIE * i
                continue
            nxt[j] = resend + TIE * i
            e = resend + w
            if e > episode1:
                episode1 = e
        if reordered:
            x = reorder[r]
            if x > waits[r, c]:
                waits[r, c] = x
            timer[r, c] = True
        if trailing > 0:   # nothing delivered behind: revealed by a resend after it, or a timer
            last_ack = (end - trailing) + w   # the last packet delivered comes back
            s_row[suspects], s_conn[suspects], s_at[suspects] = r, c, float(end)
            for j in range(hi - trailing, hi):
                s_packet[s_start[suspects] + j - (hi - trailing)] = packet[j]
            s_start[suspects + 1] = s_start[suspects] + trailing
            if episode0 <= last_ack < episode1:   # in recovery: no probe, the RTO from the last ACK
                s_kind[suspects], s_flag[suspects] = RTO, True
            else:
                one = trailing == 1
                for j in range(lo, hi - trailing):
                    if nxt[j] > last_ack:
                        one = False
                s_kind[suspects], s_flag[suspects] = PROBE, one
            for j in range(hi - trailing, hi):
                nxt[j] = (end + w) + TIE * packet[j]
            suspects += 1
        lo = hi
    return waits, timer, nxt, suspects, s_row, s_conn, s_at, s_kind, s_flag, s_start, s_packet


def revealed(row, packet, conn, position, lost, connections, s_row, s_conn, s_at, s_start, s_packet, fired,
             backoff):
    """A later round's resends (the pending ``row``, ``packet``, ``conn``, row-major, going out at
    ``position``; ``lost`` again or delivered) against the last round's suspects: ``(suspected, s_lo,
    s_hi, fires)``, which resends are a suspect's, each suspect's connection's resends (``s_lo`` to
    ``s_hi``), and whether nothing sent after it was delivered (its round waited the timer). An ACK with
    an RTT sample (a delivered resend, not a suspect's, sent after the connection's last timer fired)
    resets the RTO's backoff, in place."""
    m = len(row)
    suspected = np.zeros(m, dtype=np.bool_)
    s_lo, s_hi = np.zeros(len(s_row), dtype=np.int64), np.zeros(len(s_row), dtype=np.int64)
    fires = np.zeros(len(s_row), dtype=np.bool_)
    for s in range(len(s_row)):
        key = s_row[s] * connections + s_conn[s]
        lo, hi = 0, m
        while lo < hi:                       # the first resend of the suspect's connection
            mid = (lo + hi) // 2
            if row[mid] * connections + conn[mid] < key:
                lo = mid + 1
            else:
                hi = mid
        hi = lo
        while hi < m and row[hi] * connections + conn[hi] == key:
            hi += 1
        s_lo[s], s_hi[s] = lo, hi
        q, q_end = s_start[s], s_start[s + 1]
        for j in range(lo, hi):             # both sorted: one walk
            while q < q_end and s_packet[q] < packet[j]:
                q += 1
            if q < q_end and s_packet[q] == packet[j]:
                suspected[j] = True
    for j in range(m):
        if not lost[j] and not suspected[j] and position[j] >= fired[row[j], conn[j]]:
            backoff[row[j], conn[j]] = 0
    for s in range(len(s_row)):
        fires[s] = True
        for j in range(s_lo[s], s_hi[s]):
            if not lost[j] and not suspected[j] and position[j] > s_at[s]:
                fires[s] = False
                break
    return suspected, s_lo, s_hi, fires


def settle(row, packet, conn, position, lost, final, rtt, window, s_row, s_conn, s_at, s_kind, s_lo, s_hi, fires,
           s_wait, suspected, spent, provisional, backoff, fired, latest, last_timed):
    """After ``revealed`` and the timers of the suspects that fire (``s_wait``): a fired suspect's round
    waited its timer (what it adds to the round trip its connection's wait counted, ``provisional``), the
    timer fires after everything its connection sent and what it resends goes out then, in order. Each
    send's ``late`` (what its slowest connection's waits grew by) and ``late_timers`` (connections that
    waited a timer not counted before, ``last_timed``); then this round: ``latest`` delivered positions,
    backoffs reset by ACKs, ``waits`` (a round trip per connection with a loss), where each loss's next
    resend goes out (``follow``, its connection ``follow_conn``: a window on, found by one SACK behind it
    in recovery; or with its connection's timer, if lost before it fired) and the new suspects (``n_*``:
    losses of a link's last send with nothing delivered after them, one per connection; RTOs not armed
    by an ACK): ``(late, late_timers, waits, follow, follow_conn, count, *suspects)``, the first ``count``
    of ``Suspects``' arrays."""
    n, k = spent.shape
    m = len(row)
    timed, waits = np.zeros((n, k), dtype=np.bool_), np.zeros((n, k))
    late, late_timers = np.zeros(n), np.zeros(n, dtype=np.int64)
    follow, follow_conn = np.zeros(m), np.zeros(m, dtype=np.int64)
    n_row, n_conn, n_at = np.zeros(m, dtype=np.int64), np.zeros(m, dtype=np.int64), np.zeros(m)
    n_kind, n_flag = np.full(m, RTO, dtype=np.int64), np.zeros(m, dtype=np.bool_)   # RTOs armed by a transmission
    n_start, n_packet = np.zeros(m + 1, dtype=np.int64), np.zeros(m, dtype=np.int64)
    for r in range(n):
        top = spent[r, 0]
        for c in range(1, k):
            if spent[r, c] > top:
                top = spent[r, c]
        late[r] = top
    for s in range(len(s_row)):
        if not fires[s]:
            continue
        r, c = s_row[s], s_conn[s]
        grown = s_wait[s] - provisional[r, c]
        spent[r, c] += grown if not 0.0 > grown else 0.0
        if s_kind[s] == RTO:
            backoff[r, c] += 1
        timed[r, c] = True
        at = fired[r, c]
        if latest[r, c] > at:
            at = latest[r, c]
        if s_at[s] > at:
            at = s_at[s]
        fired[r, c] = at + AFTER_TIMER
        for j in range(s_lo[s], s_hi[s]):
            if suspected[j]:
                position[j] = fired[r, c] + packet[j]
    for r in range(n):
        top = spent[r, 0]
        count = 0
        for c in range(k):
            if spent[r, c] > top:
                top = spent[r, c]
            if timed[r, c] and not last_timed[r, c]:
                count += 1
        late[r] = top - late[r]
        late_timers[r] = count
    for j in range(m):
        if not lost[j] and position[j] > latest[row[j], conn[j]]:
            latest[row[j], conn[j]] = position[j]
    for j in range(m):
        if not lost[j] and suspected[j] and position[j] >= fired[row[j], conn[j]]:
            backoff[row[j], conn[j]] = 0
    out = suspects = 0
    for j in range(m):
        if not lost[j]:
            continue
        r, c = row[j], conn[j]
        waits[r, c] = rtt[r]
        resend = position[j] + 0.5 + window[r, c] + TIE * packet[j]
        if final[r] and position[j] >= latest[r, c]:
            if timed[r, c] and position[j] < fired[r, c]:
                resend = fired[r, c] + packet[j]
            else:
                if suspects == 0 or n_row[suspects - 1] != r or n_conn[suspects - 1] != c:
                    n_row[suspects], n_conn[suspects], n_at[suspects] = r, c, position[j]
                    n_start[suspects + 1] = n_start[suspects]
                    suspects += 1
                elif position[j] > n_at[suspects - 1]:
                    n_at[suspects - 1] = position[j]
                n_packet[n_start[suspects]] = packet[j]
                n_start[suspects] += 1
        follow[out], follow_conn[out] = resend, c
        out += 1
    return (late, late_timers, waits, follow[:out], follow_conn[:out], suspects, n_row, n_conn, n_at, n_kind, n_flag,
            n_start, n_packet)


def charge(spent, waits, timer):
    """A round's ``waits`` per connection added to ``spent`` (in place): ``(wait, counted)``, per send what
    its slowest connection's waits grew by and how many of its connections waited a timer."""
    n, k = spent.shape
    wait, counted = np.zeros(n), np.zeros(n, dtype=np.int64)
    for r in range(n):
        before = spent[r, 0]
        for c in range(1, k):
            if spent[r, c] > before:
                before = spent[r, c]
        for c in range(k):
            spent[r, c] += waits[r, c]
            if timer[r, c]:
                counted[r] += 1
        after = spent[r, 0]
        for c in range(1, k):
            if spent[r, c] > after:
                after = spent[r, c]
        wait[r] = after - before
    return wait, counted


# whether they run compiled where numba is installed (tests run both ways)
COMPILED = True
_compiled: dict = {}


def kernels():
    """``(first, revealed, settle, charge)`` compiled, or as Python where numba is not installed (or
    ``COMPILED`` is off)."""
    if not COMPILED:
        return first, revealed, settle, charge
    return numba_compiled(_compiled, "all", first, revealed, settle, charge) or (first, revealed, settle, charge)
