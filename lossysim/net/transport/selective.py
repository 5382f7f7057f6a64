"""Selective repeat, and the deadline's give-up: one rule over the (send, packet) pairs still pending,
round by round, each round's losses handed in as positions by whatever keeps the packets' fates. Round 0
sends the message; each later round resends what the previous one lost, once the loss is known: one
round trip when a later packet on the same connection reveals the gap, the preset's timer when nothing
behind it does (a tail loss); with RACK (TCP) each connection's waits are ``tcp._Rack``'s."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from ...timing.retransmission import Nic
from . import rounds as compiled_rounds
from .sends import Count, HostSends, PositionsDraw, Result, slowest
from .tcp import _Rack

_NO_TAILS = np.zeros((0, 0), dtype=bool)


def selective(nic: Nic, a: HostSends, draw: PositionsDraw, count: Count, budget: float, give_up: bool,
              windows: Optional[np.ndarray] = None) -> Result:
    """Selective repeat (and the deadline's give-up) for one step, whatever keeps the packets' fates:
    ``draw`` hands each round's losses back as positions, ``count`` takes those that went out;
    ``windows``: TCP's congestion states of the sends' connections before the step (None: never cut).

    The pending packets are ``(row, packet)`` pairs, row-major; most rounds after the first resend a few
    packets and lose none, so the work that only losses, tails or failures need is skipped without them."""
    checks_failures = nic.retries is not None and not give_up
    kernels = None if give_up else compiled_rounds.kernels()
    if kernels is not None:
        return _compiled(kernels, nic, a, draw, count, checks_failures, _Rack(nic, a, windows) if nic.rack else None)
    packets, n = a.packets, len(a.packets)
    sent = np.zeros(n, dtype=np.int64)
    waits, shadow = np.zeros(n), np.zeros(n)
    timeouts, streak = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    failed, stopped = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    streaking = False                                                   # some streak is not 0
    to_send = pending = packets                                          # pending: per row
    given_up = []     # (rows, packets) still pending when their send stopped at the deadline
    width, rounds, row = a.width, 0, None
    rack = _Rack(nic, a, windows) if nic.rack else None
    while True:
        lost = draw(to_send, width)                                         # flat row * width + column
        lost_row, lost_column = np.divmod(lost, width)
        if min(to_send.tolist(), default=width) < width:   # (else every fate drawn went out: no copies)
            went = lost_column < to_send[lost_row]
            lost_row, lost_column = lost_row[went], lost_column[went]
        count(lost_row, lost_column, to_send)
        tail = timer = None
        if row is None:  # round 0 sends every packet in order: the lost ones that went out are pending
            row, packet = lost_row, lost_column
            if rack is not None:
                waits = waits + rack.first(row, packet)
            elif a.tails is not None and len(row):
                tail = np.zeros(n, dtype=bool)
                tail[row[a.tails[row, packet]]] = True
        elif len(lost) and len(row):
            # The k-th pending packet of a row goes out as its k-th transmission of the round (a row with
            # more pending than the round's width, one that failed and sends nothing, reads the last column).
            order = np.minimum(np.arange(len(row)) - (np.cumsum(pending) - pending)[row], width - 1)
            again = _member(row * width + order, lost)
            if rack is not None:
                rack.resent(row, packet, again)
                waits, timeouts = waits + rack.late, timeouts + rack.late_timers
            row, packet, order = row[again], packet[again], order[again]
            if rack is None and len(row) and a.any_final:  # the round's last resends have nothing behind them
                tail = np.zeros(n, dtype=bool)
                tail[row[order >= (to_send - a.tail_resends)[row]]] = True
                tail &= a.final
        else:  # nothing lost this round: nothing pending
            if rack is not None:   # (every pending packet arrived: the last round's suspects were revealed)
                rack.resent(row, packet, np.zeros(len(row), dtype=bool))
                waits, timeouts = waits + rack.late, timeouts + rack.late_timers
            row, packet = row[:0], packet[:0]
        sent = sent + to_send
        rounds += 1
        to_send = pending = np.bincount(row, minlength=n)
        if checks_failures and rounds > nic.retries:
            failed = failed | (to_send > 0)
            to_send = np.where(failed, 0, to_send)
        # (small arrays: Python's any and max over tolist() cost a tenth of numpy's reductions)
        if rack is not None:
            wait, timer = rack.wait, rack.timer
        elif tail is not None and any(tail.tolist()):
            wait, streak = _timers(nic, a, tail, streak, pending)
            streaking, timer = True, tail
        else:
            wait = a.rtt
            if streaking:
                streak, streaking = np.zeros(n, dtype=np.int64), False
        if give_up and len(row):  # the next round must end within the budget, or the receiver stops waiting
            late = (to_send > 0) & ((sent - packets) * a.tau + waits + wait + to_send * a.tau > budget)
            if any(late.tolist()):   # a stopped send's pending packets stay missing: set them aside
                out = late[row]
                given_up.append((row[out], packet[out]))
                row, packet = row[~out], packet[~out]
                if rack is not None:
                    rack.keep(~out)
                stopped, pending = stopped | late, np.where(late, 0, pending)
                to_send = np.where(late, 0, to_send)
        active = to_send > 0
        if not any(active.tolist()):
            break
        waits = waits + np.where(active, wait, 0.0)
        shadow = shadow + np.where(active, a.rtt, 0.0)
        if timer is not None:
            timeouts = timeouts + np.where(active, timer, 0)
        width = max(to_send.tolist())
    return _result(a, row, packet, sent, waits, shadow, timeouts, failed, stopped, given_up, budget,
                   None if rack is None else rack.windows)


def _timers(nic: Nic, a: HostSends, tail: np.ndarray, streak: np.ndarray, pending: np.ndarray):
    """``(wait, streak)``: the next round's wait of each send (the preset's tail timer where its last
    resends are ``tail``, ``streak`` of them already in a row, else a round trip) and the streaks after."""
    timer = nic.timer_s(torch.from_numpy(a.rtt), torch.from_numpy(streak), torch.from_numpy(pending)).numpy()
    return np.where(tail, timer, a.rtt), np.where(tail, streak + 1, 0)


def _compiled(kernels, nic: Nic, a: HostSends, draw: PositionsDraw, count: Count, checks_failures: bool,
              rack: Optional[_Rack]) -> Result:
    """``selective``'s rounds without a deadline, each round's bookkeeping in ``rounds``' compiled kernels
    (and RACK's in ``rack``'s): the same steps, the same Result to the bit."""
    went, advance, wait, repairs = kernels
    n = len(a.packets)
    sent, waits, shadow = np.zeros(n, dtype=np.int64), np.zeros(n), np.zeros(n)
    timeouts, streak = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    failed, no_timer = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    tails = _NO_TAILS if a.tails is None or rack is not None else a.tails   # (RACK finds its own tails)
    row = packet = np.zeros(0, dtype=np.int64)
    to_send = pending = a.packets
    width, rounds, streaking = a.width, 0, False
    while True:
        lost = draw(to_send, width)
        lost_row, lost_column = went(lost, width, to_send)
        count(lost_row, lost_column, to_send)
        rounds += 1
        was_row, was_packet = row, packet
        row, packet, pending, to_send, tail, any_tail, again = advance(
            rounds == 1, lost, lost_row, lost_column, width, row, packet, pending, to_send, tails,
            a.any_final and rack is None, a.final, a.tail_resends, sent, failed,
            checks_failures and rounds > nic.retries)
        if rack is not None:
            if rounds == 1:
                waits += rack.first(row, packet)
            else:
                rack.resent(was_row, was_packet, again)
                waits += rack.late
                timeouts += rack.late_timers
            wait_s, timer = rack.wait, no_timer if rack.timer is None else rack.timer
        elif any_tail:
            wait_s, streak = _timers(nic, a, tail, streak, pending)
            streaking, timer = True, tail
        else:
            wait_s, timer = a.rtt, no_timer
            if streaking:
                streak, streaking = np.zeros(n, dtype=np.int64), False
        width = wait(to_send, wait_s, a.rtt, timer, waits, shadow, timeouts)
        if width == 0:
            break
    if rack is not None:
        return _result(a, row, packet, sent, waits, shadow, timeouts, failed, no_timer, [], math.inf, rack.windows)
    if checks_failures:
        keep = ~failed[row]
        row, packet = row[keep], packet[keep]
    return Result(row, packet, sent, *repairs(sent, a.packets, a.tau, waits, shadow), timeouts, failed)


def _result(a: HostSends, row, packet, sent, waits, shadow, timeouts, failed, stopped, given_up, budget,
            windows) -> Result:
    """The step's Result from its rounds: the pairs still pending (a failed send's left out, a stopped
    send's kept missing) and each send's repairs, the slowest's."""
    resent = (sent - a.packets) * a.tau
    extra = np.where(stopped, budget, resent + waits)
    keep = ~failed[row]
    row, packet = row[keep], packet[keep]
    if given_up:
        row, packet = (np.concatenate([row, *(r for r, _ in given_up)]),
                       np.concatenate([packet, *(p for _, p in given_up)]))
        order = np.lexsort((packet, row))
        row, packet = row[order], packet[order]
    return Result(row, packet, sent, slowest(extra), slowest(resent + shadow), timeouts, failed, windows)


def _member(keys: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """Whether each of ``keys`` is in the sorted array ``sorted_set``."""
    at = np.minimum(np.searchsorted(sorted_set, keys), len(sorted_set) - 1)
    return sorted_set[at] == keys
