"""TCP's repairs within selective repeat (``_Rack``): RACK's reordering timer, the tail-loss probe, the
RTO and its backoff, per connection, and what each connection's congestion window costs."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ...timing import carried, congestion
from ...timing.retransmission import Nic
from .sends import HostSends


class _Rack:
    """What a TCP send's losses wait for, round by round, as Linux finds them (RFC 8985, tcp_recovery.c,
    tcp_output.c, tcp_timer.c), and what its connections' congestion windows cost.

    A send is carried by ``connections`` connections, each a contiguous share of its packets at that
    share of the link (NCCL's channels times its sockets), each with its own timers: a send's waits are
    its slowest connection's (``spent``: each connection's waits so far; a round adds to the send what it
    adds to the largest). On a connection a lost transmission, first or resent, is found a round trip
    later once a transmission sent after it is delivered (RACK): with three delivered behind it or in
    recovery at once, with one or two outside recovery after RACK's reordering timer
    (``Nic.reorder_s``). Only when nothing sent after it is delivered does it wait a timer: the tail-loss
    probe outside recovery (``Nic.probe_s``), the RTO in recovery, doubling with each RTO in a row on
    that connection (``Nic.rto_s_after``).

    Where each transmission goes out, in its connection's packets (the ACK clock: a packet's SACK comes
    back a round trip after it went out, as the stream's packet then goes out; ``congestion.carry`` says
    where the window has the stream by then, and without a window it is a window of packets on): an
    original at its place in the stream; a resend when its loss is found, just ahead of the packet that
    ACK releases; after a timer, behind everything sent before. So a resend of an early loss goes out amid
    the stream, one of a loss in the last window after the stream's end, and a second resend of an early
    loss may go out before the first resend of a late one. A recovery episode lasts from its first resend
    until its last resend's ACK comes back. A loss that nothing delivered so far was sent after (a
    connection's last packets, the last resends) may be revealed by the next round's resends of other
    losses, so it is settled a round later: the next round's fates are drawn, and if nothing sent after
    it was delivered its round waited the timer (``late``). A step that is not the link's last in the
    collective has later traffic on every connection: its losses wait a round trip. A round's wait counts
    as a timeout per connection that waited a timer."""

    AFTER_TIMER = 1e12   # a position after a timer: behind everything the connection sent before it
    TIE = 1e-7           # resends marked lost together go out in sequence order

    def __init__(self, nic: Nic, a: HostSends, windows: Optional[np.ndarray]):
        self.nic, self.a = nic, a
        n, k = len(a.packets), a.connections
        self.base, self.extra = np.divmod(a.packets, k)     # connection c carries base + (c < extra) packets
        starts = self._start(np.arange(k + 1)[:, None]).T                    # [send, connection + 1]
        self.firsts, self.ends = starts[:, :-1], starts[:, 1:] - 1         # each connection's first and last packet
        self.tau = a.tau * k                                # a connection's packets, at its share of the link
        self.window = np.repeat((a.rtt / self.tau)[:, None], k, axis=1)   # packets a round trip, per connection
        self.found_at: dict = {}                            # (send, connection): where its losses' SACKs came back
        self.latest = self.ends.astype(np.float64)          # the latest position a delivered transmission had
        self.spent = np.zeros((n, k))                       # each connection's waits so far
        self.provisional = np.zeros((n, k))                 # what each connection's last round waited, as known then
        self.timed = np.zeros((n, k), dtype=bool)
        self.backoff = np.zeros((n, k), dtype=np.int64)     # RTOs fired in a row
        self.fired = np.zeros((n, k))                       # where each connection's last timer fired
        self.windows = windows if windows is not None or not nic.window else congestion.fresh(n, k)
        self.wait, self.timer = a.rtt, None
        self.late, self.late_timers = np.zeros(n), np.zeros(n, dtype=np.int64)
        self.suspects: list = []    # the last round's unrevealed losses: (send, connection, position, timer, packets)
        self.next = np.zeros(0)     # per pending (send, packet), in their order: where its next resend goes out
        self.conn = np.zeros(0, dtype=np.int64)   # and the connection that carries it

    def _start(self, c) -> np.ndarray:
        """The first packet of connection ``c`` of every send."""
        return c * self.base + np.minimum(c, self.extra)

    def connection(self, row: np.ndarray, packet: np.ndarray) -> np.ndarray:
        """The connection that carries each (row, packet)."""
        base, extra = self.base[row], self.extra[row]
        front = extra * (base + 1)
        return np.where(packet < front, packet // (base + 1), extra + (packet - front) // np.maximum(base, 1))

    def first(self, row: np.ndarray, packet: np.ndarray) -> np.ndarray:
        """Round 0's losses (row-major): the round's waits, and per send the seconds its connections' windows
        add (0 without a window)."""
        conn = self.connection(row, packet) if len(row) else row
        delays = self._windows(row, packet, conn) if self.nic.window else np.zeros(len(self.a.packets))
        waits, timer = np.zeros_like(self.spent), np.zeros(self.spent.shape, dtype=bool)
        self.suspects, self.next, self.conn = [], np.zeros(len(row)), conn
        if len(row):
            final = self.a.final[row]
            if not final.all():
                self._first_not_final(row[~final], packet[~final], conn[~final], np.flatnonzero(~final), waits)
            bounds = np.searchsorted(row, np.arange(len(self.a.packets) + 1)).tolist()
            for r in np.unique(row[final]).tolist():        # row is sorted: each send's losses a slice
                lo, hi = bounds[r], bounds[r + 1]
                self._first_row(r, packet[lo:hi], conn[lo:hi], np.arange(lo, hi), waits, timer)
        self._charge(waits, timer)
        return delays

    def _first_not_final(self, row: np.ndarray, lost: np.ndarray, conn: np.ndarray, index: np.ndarray,
                         waits: np.ndarray) -> None:
        """``_first_row`` for the sends that are not their link's last in the collective, all at once: each
        connection with losses waits a round trip, its latest delivered position is its end less its trailing
        losses, and its resends go out a window after their losses."""
        group = row * self.a.connections + conn                     # sorted: each connection's losses a run
        starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
        counts = np.diff(np.r_[starts, len(group)])
        which = np.repeat(np.arange(len(starts)), counts)
        place = np.arange(len(group)) - starts[which]
        end = self.ends[row, conn]
        trailing = (end - lost) - (counts[which] - 1 - place) == 0   # nothing delivered after it
        r, c = row[starts], conn[starts]
        self.latest[r, c] = end[starts] - np.add.reduceat(trailing.astype(np.int64), starts)
        waits[r, c] = self.a.rtt[r]
        self.next[index] = lost + self.window[row, conn]

    def _first_row(self, r: int, lost: np.ndarray, conn: np.ndarray, index: np.ndarray, waits: np.ndarray,
                   timer: np.ndarray) -> None:
        """One send's round-0 waits per connection (a round trip, or RACK's reordering timer), where its
        resends go out, its suspects."""
        rtt = self.a.rtt[r:r + 1]
        for c in np.unique(conn).tolist():
            ours = conn == c
            mine, at = lost[ours], index[ours]              # sorted
            end = int(self.ends[r, c])
            behind = (end - mine) - (len(mine) - 1 - np.arange(len(mine)))   # delivered after each
            trailing = behind == 0
            self.latest[r, c] = end - int(trailing.sum())
            waits[r, c] = rtt[0]
            if not self.a.final[r]:
                self.next[at] = mine + self.window[r, c]
                continue
            reordered, episode = self._found(r, c, mine, behind, at)
            if reordered:
                waits[r, c], timer[r, c] = max(waits[r, c], float(self.nic.reorder_s(rtt)[0])), True
            if trailing.any():   # nothing delivered behind: revealed by a resend after it, or a timer
                last_ack = end - int(trailing.sum()) + self.window[r, c]   # the last packet delivered comes back
                if episode[0] <= last_ack < episode[1]:      # in recovery: no probe, the RTO from the last ACK
                    fallback = ("rto", True)
                else:
                    one = bool(trailing.sum() == 1 and not (self.next[at[~trailing]] > last_ack).any())
                    fallback = ("probe", one)
                self.next[at[trailing]] = end + self.window[r, c] + self.TIE * mine[trailing]
                self.suspects.append((r, c, float(end), fallback, mine[trailing]))

    def _found(self, r: int, c: int, mine: np.ndarray, behind: np.ndarray, at: np.ndarray
               ) -> tuple[bool, tuple[float, float]]:
        """When each loss of one connection is found, in sending order, and so where its resend goes out
        (``next``): in recovery at the SACK of its first delivered packet behind (RACK's window is 0
        there), outside it at the ``dupacks``-th's (tp->reordering), or with fewer behind after the
        reordering timer. A SACK comes back a round trip after its packet went out, as the stream's packet
        then goes out (``congestion.carry`` follows the window; without one, a window of packets later),
        and the resend goes out ahead of it. A recovery episode lasts from its first resend until its last
        resend's ACK comes back (Linux enters it again at once while a packet marked lost is
        unacknowledged). Whether some loss waited the reordering timer, and the last episode (start,
        end)."""
        dupacks, window = self.nic.dupacks, self.window[r, c]
        if (r, c) in self.found_at:
            sacks, marks = self.found_at[(r, c)]
        else:
            first, end = int(self.firsts[r, c]), int(self.ends[r, c])
            sacks, marks = (congestion.behind(mine - first, end - first + 1, n) + first + window for n in (1, dupacks))
        episode, reordered = (-math.inf, -math.inf), False
        window, after_timer = float(window), float(self.ends[r, c]) + self.AFTER_TIMER
        found, resends = [], []      # (plain floats: a loop over every loss of the connection)
        for k, (i, b, sack, mark) in enumerate(zip(mine.tolist(), behind.tolist(), sacks.tolist(), marks.tolist())):
            if b == 0:
                continue
            sack = sack - 0.5
            if episode[0] <= sack < episode[1]:
                resend = sack
            elif b >= dupacks:
                resend = mark - 0.5
                if resend >= episode[1]:
                    episode = (resend, episode[1])
            else:
                reordered = True
                found.append(k)
                resends.append(after_timer + self.TIE * i)
                continue
            found.append(k)
            resends.append(resend + self.TIE * i)
            episode = (episode[0], max(episode[1], resend + window))
        self.next[at[found]] = resends
        return reordered, episode

    def resent(self, row: np.ndarray, packet: np.ndarray, lost: np.ndarray, rounds: int) -> None:
        """A later round's resends (row-major, ``lost``: which were lost again): the last round's suspects
        settled against them (``late``), then this round's waits and suspects."""
        before = self.spent.max(1)
        conn, position, delivered = self.conn, self.next.copy(), ~lost
        suspected = np.zeros(len(row), dtype=bool)
        for r, c, _, _, packets in self.suspects:
            suspected |= (row == r) & (conn == c) & np.isin(packet, packets)
        self._acked(row, conn, position, delivered & ~suspected)
        timed = np.zeros(self.spent.shape, dtype=bool)
        for r, c, at, fallback, packets in self.suspects:
            ours = (row == r) & (conn == c)
            if (position[ours & delivered & ~suspected] > at).any():
                continue
            wait = self._timer(r, c, fallback)   # nothing sent after it arrived: its round waited the timer
            self.spent[r, c] += max(wait - self.provisional[r, c], 0.0)
            self.backoff[r, c] += fallback[0] == "rto"
            timed[r, c] = True
            # the timer fires after everything the connection sent; what it resends goes out then, in order
            self.fired[r, c] = max(self.fired[r, c], self.latest[r, c], at) + self.AFTER_TIMER
            after = ours & suspected
            position[after] = self.fired[r, c] + packet[after]
        self.late = self.spent.max(1) - before
        self.late_timers = (timed & ~self.timed).sum(1)
        self.suspects = []
        np.maximum.at(self.latest, (row[delivered], conn[delivered]), position[delivered])
        self._acked(row, conn, position, delivered & suspected)
        waits = np.zeros_like(self.spent)
        waits[row[lost], conn[lost]] = self.a.rtt[row[lost]]
        # found by one SACK behind it (in recovery), a lost one's next resend goes out a window on
        follow = position + 0.5 + self.window[row, conn] + self.TIE * packet
        # lost in its link's last send with nothing delivered after it on its connection: a suspect, unless
        # it was lost before its connection's timer fired, which resends it too
        mine = self.a.final[row] & lost & (position >= self.latest[row, conn])
        covered = mine & timed[row, conn] & (position < self.fired[row, conn])
        follow[covered] = self.fired[row[covered], conn[covered]] + packet[covered]
        mine &= ~covered
        at = np.flatnonzero(mine)
        if len(at):   # a suspect per connection, in order (row-major: each connection's a run)
            group = row[at] * self.a.connections + conn[at]
            starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
            sends, conns = np.divmod(group[starts], self.a.connections)
            for r, c, top, packets in zip(sends.tolist(), conns.tolist(),
                                          np.maximum.reduceat(position[at], starts).tolist(),
                                          np.split(packet[at], starts[1:])):
                self.suspects.append((r, c, top, ("rto", False), packets))
        self.next, self.conn = follow[lost], conn[lost]
        self._charge(waits, np.zeros(self.spent.shape, dtype=bool))

    def _acked(self, row: np.ndarray, conn: np.ndarray, position: np.ndarray, delivered: np.ndarray) -> None:
        """An ACK with an RTT sample resets the RTO's backoff (one for a transmission after the last timer)."""
        fresh = delivered & (position >= self.fired[row, conn])
        self.backoff[row[fresh], conn[fresh]] = 0

    def keep(self, kept: np.ndarray) -> None:
        """Some pending packets left (their send stopped at the deadline): ``kept`` marks those that stay."""
        self.next, self.conn = self.next[kept], self.conn[kept]

    def _timer(self, r: int, c: int, fallback: tuple) -> float:
        """A suspect's timer: ``("probe", one packet out)`` or ``("rto", armed by the last ACK)``, the RTO
        doubled by the RTOs already fired in a row on its connection."""
        rtt = self.a.rtt[r:r + 1]
        kind, flag = fallback
        if kind == "probe":
            return float(self.nic.probe_s(rtt, np.array([flag]))[0])
        return float(self.nic.rto_s_after(rtt, self.backoff[r, c:c + 1], ack=flag)[0])

    def _charge(self, waits: np.ndarray, timer: np.ndarray) -> None:
        """This round's waits per connection, as known now (a suspect's timer comes a round later): the
        send waits what its slowest connection's waits grow by."""
        before = self.spent.max(1)
        self.spent += waits
        self.provisional, self.timed = waits, timer
        self.wait = self.spent.max(1) - before
        counted = timer.sum(1)
        self.timer = counted if any(counted.tolist()) else None

    def _windows(self, row: np.ndarray, packet: np.ndarray, conn: np.ndarray) -> np.ndarray:
        """Per send, the seconds beyond its loss-free time that its slowest connection's window costs, from
        its state before the step and round 0's losses (``congestion.carry``, for all connections at once:
        ``carried.step``); the states after, each connection's window at the end and the windows its losses
        went out with (where resends go)."""
        return carried.step(self.nic.window, self.windows, self.window, row, packet, conn, self.firsts, self.ends,
                            self.tau, self.a.rtt, self.nic.dupacks, self.found_at)
