"""TCP's repairs within selective repeat (``_Rack``): RACK's reordering timer, the tail-loss probe, the
RTO and its backoff, per connection, and what each connection's congestion window costs."""
from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from ...timing import carried, congestion
from ...timing.retransmission import Nic
from . import rack_kernel
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

    def __init__(self, nic: Nic, a: HostSends, windows: Optional[np.ndarray]):
        self.nic, self.a = nic, a
        n, k = len(a.packets), a.connections
        layout = a.cache.get(nic) or a.cache.setdefault(nic, _Layout.of(nic, a))
        self.base, self.extra, self.firsts, self.ends, self.tau, self.reorder = layout[:6]
        self.powers = layout.powers
        self.window = layout.window.copy()     # packets a round trip per connection (the step's last, in place)
        self.latest = layout.latest.copy()     # the latest position a delivered transmission had
        self.spent = np.zeros((n, k))                       # each connection's waits so far
        self.provisional = np.zeros((n, k))                 # what each connection's last round waited, as known then
        self.timed = np.zeros((n, k), dtype=bool)
        self.backoff = np.zeros((n, k), dtype=np.int64)     # RTOs fired in a row
        self.fired = np.zeros((n, k))                       # where each connection's last timer fired
        self.windows = windows if windows is not None or not nic.window else congestion.fresh(n, k)
        self.wait, self.timer = a.rtt, None
        self.late, self.late_timers = 0.0, 0   # (each later round sets them: ``resent``)
        self.suspects = _NO_SUSPECTS   # the last round's losses nothing delivered behind reveals
        self.next = _NONE_F         # per pending (send, packet), in their order: where its next resend goes out
        self.conn = _NONE           # and the connection that carries it

    def connection(self, row: np.ndarray, packet: np.ndarray) -> np.ndarray:
        """The connection that carries each (row, packet)."""
        base, extra = self.base[row], self.extra[row]
        front = extra * (base + 1)
        return np.where(packet < front, packet // (base + 1), extra + (packet - front) // np.maximum(base, 1))

    def first(self, row: np.ndarray, packet: np.ndarray) -> np.ndarray:
        """Round 0's losses (row-major): the round's waits, and per send the seconds its connections' windows
        add (0 without a window). Each connection's losses (``rack_kernel.first``): on a link's last send
        found in recovery at the SACK of the first delivered packet behind (RACK's window is 0 there),
        outside it at the ``dupacks``-th's (tp->reordering), or with fewer behind after the reordering
        timer; a SACK comes back a round trip after its packet went out, as the stream's packet then goes
        out (``congestion.carry`` follows the window; without one, a window of packets later), and the
        resend goes out ahead of it. Linux enters recovery again at once while a packet marked lost is
        unacknowledged."""
        conn = self.connection(row, packet) if len(row) else row
        if self.nic.window:
            delays, sacks, marks = self._windows(row, packet, conn)
        else:
            delays, sacks = np.zeros(len(self.a.packets)), np.zeros(0)
            marks = sacks
        first = rack_kernel.kernels()[0]
        waits, timer, self.next, *suspects = first(row, packet, conn, self.a.final, self.firsts, self.ends,
                                                   self.window, self.a.rtt, self.reorder,
                                                   self.nic.dupacks, sacks, marks, self.latest)
        self.conn, self.suspects = conn, rack_kernel.Suspects.first(*suspects)
        self._charge(waits, timer)
        return delays

    def resent(self, row: np.ndarray, packet: np.ndarray, lost: np.ndarray) -> None:
        """A later round's resends (row-major, ``lost``: which were lost again): the last round's suspects
        settled against them (``late``: if nothing sent after one was delivered its round waited the timer),
        then this round's waits and suspects (``rack_kernel.revealed`` and ``settle``)."""
        _, revealed, settle, _ = rack_kernel.kernels()
        was, position = self.suspects, self.next.copy()
        suspected, lo, hi, fires = revealed(row, packet, self.conn, position, lost, self.a.connections, was.row,
                                            was.conn, was.at, was.start, was.packet, self.fired, self.backoff)
        wait = np.zeros(len(was.row))
        for i in np.flatnonzero(fires).tolist():   # nothing sent after it arrived: its round waited the timer
            wait[i] = self._timer(int(was.row[i]), int(was.conn[i]), int(was.kind[i]), bool(was.flag[i]))
        self.late, self.late_timers, waits, self.next, self.conn, *suspects = settle(
            row, packet, self.conn, position, lost, self.a.final, self.a.rtt, self.window, was.row, was.conn, was.at,
            was.kind, lo, hi, fires, wait, suspected, self.spent, self.provisional, self.backoff, self.fired,
            self.latest, self.timed)
        self.suspects = rack_kernel.Suspects.first(*suspects)
        self._charge(waits, np.zeros(self.spent.shape, dtype=bool))

    def keep(self, kept: np.ndarray) -> None:
        """Some pending packets left (their send stopped at the deadline): ``kept`` marks those that stay."""
        self.next, self.conn = self.next[kept], self.conn[kept]

    def _timer(self, r: int, c: int, kind: int, flag: bool) -> float:
        """A suspect's timer: the probe (``flag``: one packet out) or the RTO (``flag``: armed by the last
        ACK), doubled by the RTOs already fired in a row on its connection."""
        rtt = self.a.rtt[r:r + 1]
        if kind == rack_kernel.PROBE:
            return float(self.nic.probe_s(rtt, np.array([flag]))[0])
        return float(self.nic.rto_s_after(rtt, self.backoff[r, c:c + 1], ack=flag)[0])

    def _charge(self, waits: np.ndarray, timer: np.ndarray) -> None:
        """This round's waits per connection, as known now (a suspect's timer comes a round later): the
        send waits what its slowest connection's waits grow by."""
        self.wait, counted = rack_kernel.kernels()[3](self.spent, waits, timer)
        self.provisional, self.timed = waits, timer
        self.timer = counted if any(counted.tolist()) else None

    def _windows(self, row: np.ndarray, packet: np.ndarray, conn: np.ndarray) -> np.ndarray:
        """Per send, the seconds beyond its loss-free time that its slowest connection's window costs, from
        its state before the step and round 0's losses (``congestion.carry``, for all connections at once:
        ``carried.step``), and per loss where its first and ``dupacks``-th SACK come back; the states
        after and each connection's window at the end, in place."""
        return carried.step(self.nic.window, self.windows, self.window, row, packet, conn, self.firsts, self.ends,
                            self.tau, self.a.rtt, self.nic.dupacks, self.powers)


class _Layout(NamedTuple):
    """What ``_Rack`` reads of a step's sends under a preset, worked out once (``HostSends.cache``): each
    send's connections (connection c carries ``base + (c < extra)`` packets, ``firsts`` to ``ends``), a
    connection's packet time and round trip in packets, the reordering timer; the positions ``latest``
    starts from."""
    base: np.ndarray
    extra: np.ndarray
    firsts: np.ndarray
    ends: np.ndarray
    tau: np.ndarray
    reorder: np.ndarray
    window: np.ndarray
    latest: np.ndarray
    powers: Optional[carried.Powers]   # what the window's carry reads (None without a window)

    @classmethod
    def of(cls, nic: Nic, a: HostSends) -> "_Layout":
        k = a.connections
        base, extra = np.divmod(a.packets, k)
        c = np.arange(k + 1)[:, None]
        starts = (c * base + np.minimum(c, extra)).T                   # [send, connection + 1]
        firsts, ends = starts[:, :-1], starts[:, 1:] - 1
        tau = a.tau * k                                 # a connection's packets, at its share of the link
        window = np.repeat((a.rtt / tau)[:, None], k, axis=1)
        return cls(base, extra, firsts, ends, tau, nic.reorder_s(a.rtt), window, ends.astype(np.float64),
                   carried.Powers.of(nic.window, tau, a.rtt) if nic.window else None)


_NONE, _NONE_F = np.zeros(0, dtype=np.int64), np.zeros(0)
_NO_SUSPECTS = rack_kernel.Suspects.first(0, _NONE, _NONE, _NONE_F, _NONE, np.zeros(0, dtype=bool),
                                          np.zeros(1, dtype=np.int64), _NONE)
