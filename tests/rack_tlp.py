"""An event-level Linux TCP sender, written for the tests and sharing no code with lossysim's rounds: one
connection sends ``n`` packets, each transmission's fate given, and every ACK, timer and transmission
happens at its own time. What it models (RFC 8985, Linux's tcp_recovery.c, tcp_output.c, tcp_timer.c):

- the ACK clock: every delivered transmission is SACKed one round trip after it went out; the sender
  sends one packet every ``tau`` seconds at most (its share of the link), lost packets first, and with a
  congestion window never more than the window unacknowledged;
- RACK: on each ACK, every packet sent before the most recently sent delivered one is lost once a round
  trip plus the reordering window has passed since it went out (retransmissions alike); the window is a
  quarter of the minimum RTT in Open with fewer than three packets SACKed, else 0; a packet not yet due
  arms the reordering timer (jiffies + 2 ms);
- recovery: entered at the first loss marked in Open, left once everything sent before it is
  acknowledged, unless a packet marked lost is still unacknowledged (Linux's lost_out, resent or not):
  then it is entered again at once, a new episode. In recovery the window goes down to its cut by
  proportional rate reduction (RFC 6937, tcp_cwnd_reduction) and does not grow;
- the tail-loss probe, armed in Open only by an ACK that advances or by new data: 2 SRTT + 2 ms, or
  + 200 ms with one packet unacknowledged, never after the RTO; it resends the last packet. It shares
  one timer with RACK's reordering timer (Linux's icsk_pending): arming one disarms the other, and an
  ACK that arms the reordering timer arms no probe;
- the RTO: SRTT + 200 ms (Linux's floor on RTTVAR), re-armed by an advancing ACK and by resending the
  first unacknowledged packet, doubling each time it fires; when it fires every packet not SACKed is lost.

Timers count whole jiffies (HZ = 1000). The window (``cubic``: its Reno-friendly growth, alpha 0.529 a
round trip and a cut to 0.7; ``reno``: one a round trip, a cut to a half) grows only while it limits
what is in flight, and restarts from one packet in slow start after an RTO. ``send`` returns the time at
which the receiver holds every packet.
"""
from __future__ import annotations

import math
from collections import deque

HZ = 1000
WINDOWS = {"cubic": (717 / 1024, 3 * (1 - 717 / 1024) / (1 + 717 / 1024)), "reno": (0.5, 1.0)}


def jiffies(seconds: float) -> float:
    return math.ceil(round(seconds * 1e6) / (1e6 / HZ)) / HZ


def send(n: int, tau: float, rtt: float, fate, window: str = "") -> float:
    """Seconds until the receiver holds all ``n`` packets; ``fate(packet, attempt)``: whether that
    transmission is lost; ``window``: ``cubic``, ``reno`` or none (paced at ``tau``, never cut)."""
    rto = jiffies(rtt + 0.2)
    probe_one, probe = jiffies(2 * rtt + 0.2), jiffies(2 * rtt + 0.002)
    beta, alpha = WINDOWS.get(window, (1.0, 0.0))
    cwnd, ssthresh = (rtt / tau, math.inf) if window else (math.inf, math.inf)
    prior_cwnd, prr_delivered, prr_out = cwnd, 0, 0     # proportional rate reduction in recovery (RFC 6937)
    xmit = [0.0] * n                  # the latest transmission of each packet
    attempts = [0] * n
    sacked = [False] * n
    out = [False] * n                 # its latest transmission is in flight (sent, not SACKed, not marked lost)
    lost = []                         # marked lost, to be resent (lowest first)
    marked = set()                    # marked lost and not SACKed since, resent or not (Linux's lost_out)
    order = {}                        # packets in flight by their latest transmission (RACK's time-sorted queue)
    acks = deque()                    # (arrival, packet, its transmission's time): in sending order
    done_at, una, nxt, in_flight, sacked_out = 0.0, 0, 0, 0, 0
    state, high, rack_xmit, backoff = "open", 0, -1.0, 0
    free, rto_at = 0.0, math.inf
    slot, slot_at = "", math.inf      # the one other timer: RACK's reordering timer ("reo") or the probe ("tlp")

    def transmit(i: int, now: float) -> None:
        nonlocal free, in_flight, done_at, rto_at, prr_out
        if i in lost:
            lost.remove(i)
        xmit[i], out[i] = now, True
        in_flight += 1
        order.pop(i, None)
        order[i] = True
        if not fate(i, attempts[i]):
            acks.append((now + rtt, i, now))
        attempts[i] += 1
        free = now + tau
        if state == "recovery":
            prr_out += 1
        if i == una and attempts[i] > 1:
            rto_at = now + rto * 2 ** backoff

    def arm_probe(now: float) -> None:
        nonlocal slot, slot_at
        if state == "open" and una < nxt:
            slot, slot_at = "tlp", min(now + (probe_one if nxt - una == 1 else probe), rto_at)

    def detect(now: float) -> bool:
        """RACK: mark lost what was sent before the latest delivered transmission and is overdue; whether
        the reordering timer was armed for the rest."""
        nonlocal slot, slot_at, in_flight, state, high, cwnd, ssthresh
        reo = 0.0 if state != "open" or sacked_out >= 3 else rtt / 4
        due, wait = [], 0.0
        for i in order:                   # oldest first; those sent after the latest delivered one are not due
            if xmit[i] >= rack_xmit:
                break
            remaining = xmit[i] + rtt + reo - now
            if remaining <= 1e-12:
                due.append(i)
            else:
                wait = max(wait, remaining)
        if wait:
            slot, slot_at = "reo", now + jiffies(wait) + 0.002
        elif slot == "reo":
            slot, slot_at = "", math.inf
        for i in due:
            del order[i]
            out[i] = False
            in_flight -= 1
            lost.append(i)
            marked.add(i)
        lost.sort()
        if due and state == "open":
            recover()
            if slot == "tlp":
                slot, slot_at = "", math.inf
        return bool(wait)

    def recover() -> None:
        """Enter recovery: the window's cut starts (tcp_init_cwnd_reduction), reached by PRR."""
        nonlocal state, high, prior_cwnd, ssthresh, prr_delivered, prr_out
        state, high = "recovery", nxt
        prior_cwnd, prr_delivered, prr_out = cwnd, 0, 0
        ssthresh = max(beta * cwnd, 2.0) if window else math.inf

    def reduce() -> None:
        """One ACK's worth of PRR (tcp_cwnd_reduction): send in proportion to what was delivered, down to
        ssthresh."""
        nonlocal cwnd, prr_delivered
        prr_delivered += 1
        if ssthresh < in_flight:
            allowed = math.ceil(ssthresh * prr_delivered / prior_cwnd) - prr_out
        else:
            allowed = min(ssthresh - in_flight, max(prr_delivered - prr_out, 1) + 1)
        cwnd = in_flight + max(allowed, 0 if prr_out else 1)

    def ack(i: int, sent_at: float, now: float) -> None:
        nonlocal una, in_flight, sacked_out, rack_xmit, done_at, rto_at, backoff, state, cwnd
        if sacked[i]:
            return
        sacked[i] = True
        done_at = max(done_at, sent_at + rtt / 2)
        if out[i]:
            out[i] = False
            in_flight -= 1
            del order[i]
        if i in lost:
            lost.remove(i)
        marked.discard(i)
        limited = in_flight + 1 >= cwnd - 1
        rack_xmit = max(rack_xmit, sent_at)
        sacked_out += 1
        advanced = False
        while una < n and sacked[una]:
            una, sacked_out, advanced = una + 1, sacked_out - 1, True
        if advanced:
            backoff = 0
            rto_at = now + rto if una < nxt else math.inf
            if state != "open" and una >= high:
                cwnd = ssthresh if window and state == "recovery" else cwnd
                if marked:                # lost_out: a new episode at once
                    recover()
                else:
                    state = "open"
        armed = detect(now)
        if window and state == "recovery":
            reduce()
        elif window and state == "open" and limited:
            cwnd += 1.0 if cwnd < ssthresh else alpha / cwnd
        if not armed and advanced:         # the reordering timer, if armed, keeps the one slot
            arm_probe(now)

    now = 0.0
    while una < n:
        can_send = (lost or nxt < n) and in_flight < cwnd
        events = [acks[0][0] if acks else math.inf, max(free, now) if can_send else math.inf,
                  slot_at if slot == "reo" else math.inf, slot_at if slot == "tlp" else math.inf, rto_at]
        now = min(events)
        if now == math.inf:
            raise AssertionError("stalled")
        if events[0] == now:
            _, i, sent_at = acks.popleft()
            ack(i, sent_at, now)
        elif events[2] == now:
            slot, slot_at = "", math.inf
            detect(now)
        elif events[3] == now:            # the probe: the last packet not SACKed goes again
            slot, slot_at = "", math.inf
            last = max(i for i in range(nxt) if not sacked[i])
            if out[last]:
                out[last] = False
                in_flight -= 1
                del order[last]
            transmit(last, max(now, free))
            rto_at = now + rto
        elif events[4] == now:            # the RTO: everything not SACKed is lost
            state, high, slot, slot_at = "loss", nxt, "", math.inf
            order.clear()
            for i in range(una, nxt):
                if out[i]:
                    out[i] = False
                    in_flight -= 1
                if not sacked[i] and i not in lost:
                    lost.append(i)
                    marked.add(i)
            lost.sort()
            ssthresh, cwnd = max(beta * cwnd, 2.0) if window else math.inf, 1.0 if window else math.inf
            backoff += 1
            rto_at = now + rto * 2 ** backoff
        else:
            if lost:
                transmit(lost[0], now)
            else:
                nxt += 1
                transmit(nxt - 1, now)
                arm_probe(now)
    return done_at
