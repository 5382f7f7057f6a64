"""Transports: whether a lost packet is repaired, and what the repair costs in time.

- ``drop``: a lost packet is gone; a collective takes its loss-free time.
- ``retransmit``: every lost packet is sent again until it arrives, as the NIC preset repairs it
  (``lossysim.timing.retransmission.Nic``); each resend is the link's next packet and goes through
  the link's loss chain, so it can be lost again. Tensors arrive exact; time grows. A packet still
  lost after the preset's retries fails the collective (the job restarts: the runner charges it).
  - selective repeat: round 0 sends the message; each later round resends what the previous one
    lost, once the loss is known: one round trip when a later packet on the same connection
    reveals the gap, the preset's timer when nothing behind it does (a *tail* loss).
    With RACK (TCP), a tail loss with an arrived packet behind it waits RACK's reordering timer;
    with a congestion window (TCP CUBIC), each send also pays for the window its round-0 losses cut.
  - go-back-N (RoCE NICs): the receiver drops everything after a gap; the sender keeps sending
    until the NAK arrives (the ``window`` packets in flight during a round trip are wasted), then
    resends from the lost packet; a tail loss waits for the timer.
- ``deadline``: selective repeat while the repairs fit the step's budget (``deadline`` times its
  share of the collective's loss-free time), then give up: what is still missing is lost, and the
  step ends at its budget (the bounded-time idea of OptiReduce). Its receiver keeps packets that
  arrive after a gap, as a bounded-time collective must: go-back-N would throw them away.

NCCL streams a collective's steps over persistent connections (one per peer per channel), so a
loss is a tail loss only at the very end of a connection's traffic in the collective: in the
last step a link sends (``final``), its last packets per channel (``tails``). A repair delays its
step by ``(transmissions - packets) * tau + waits``; a step's extra time is its slowest send's
(the loss-free time of the whole collective comes from ``lossysim.timing``). ``shadow`` is the
same repair under the ``ideal`` preset (every wait one round trip): the lower bound the report
shows beside the configured preset.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from ..timing import congestion
from ..timing.retransmission import Nic

TRANSPORTS = ("drop", "retransmit", "deadline")
MODES = ("selective", "go_back_n")

# draw(lengths, known=True) -> (lost [n, max(lengths)], commit(used)): the next transmissions on
# each link; commit says how many were really sent (counters, and the chains when not known).
Draw = Callable[..., tuple]
# draw(to_send, width) -> lost: the next ``width`` transmissions on each link as the sorted flat positions
# ``row * width + column`` of the lost ones (numpy; the fates past ``to_send[row]`` included); then
# count(row, column, to_send) is given those that went out, to be counted.
PositionsDraw = Callable[[np.ndarray, int], np.ndarray]
Count = Callable[[np.ndarray, np.ndarray, np.ndarray], None]


@dataclass(frozen=True)
class Transport:
    kind: str = "drop"           # drop | retransmit | deadline
    mode: str = "selective"      # selective | go_back_n (retransmit and deadline)
    deadline: float = 1.5        # deadline: a collective's budget as a multiple of its loss-free time

    def __post_init__(self):
        if self.kind not in TRANSPORTS:
            raise ValueError(f"transport={self.kind!r} must be one of {', '.join(TRANSPORTS)}")
        if self.mode not in MODES:
            raise ValueError(f"retransmit={self.mode!r} must be one of {', '.join(MODES)}")
        if not self.deadline >= 1.0:
            raise ValueError(f"deadline={self.deadline} must be >= 1 (a multiple of the loss-free time)")
        if self.kind == "deadline" and self.mode == "go_back_n":
            raise ValueError("go-back-N (retransmit=go_back_n, nic=roce-gbn) with transport=deadline is not supported: "
                             "at the deadline a go-back-N receiver holds only the packets before the first gap; use a "
                             "selective repeat nic")

    @property
    def repairs(self) -> bool:
        """Whether lost packets are sent again."""
        return self.kind != "drop"

    @property
    def exact(self) -> bool:
        """Whether tensors always arrive exact (only time is lost)."""
        return self.kind == "retransmit"


@dataclass
class Sends:
    """One step's sends as the transport sees them (per send unless said otherwise)."""
    packets: torch.Tensor        # packets of the message
    tau: torch.Tensor            # wire seconds of one packet on the link
    rtt: torch.Tensor            # round trip, seconds: what a NAK costs
    window: torch.Tensor         # packets in flight during a round trip (go-back-N's waste)
    final: torch.Tensor          # the link's last step in the collective: its tail losses wait for timers
    tails: torch.Tensor          # [sends, max packets] positions whose loss nothing behind reveals (round 0)
    tail_resends: torch.Tensor   # in later rounds, how many last resends are tails (final sends)
    connections: int = 1         # TCP: connections a send is spread over, each a contiguous share of it
    _host: Optional["HostSends"] = field(default=None, repr=False, compare=False)

    def host(self) -> "HostSends":
        """What selective repeat reads, as numpy arrays (copied once: a step lives as long as its network)."""
        if self._host is None:
            final = self.final.cpu().numpy()
            packets = self.packets.cpu().numpy().astype(np.int64)
            self._host = HostSends(packets, int(packets.max()) if len(packets) else 0, self.tau.cpu().numpy(),
                                   self.rtt.cpu().numpy(), final, self.tails.cpu().numpy() if final.any() else None,
                                   bool(final.any()), self.tail_resends.cpu().numpy().astype(np.int64),
                                   self.connections)
        return self._host


@dataclass
class HostSends:
    """``Sends`` as selective repeat reads them: numpy, on the host."""
    packets: np.ndarray
    width: int                  # the most packets of a send
    tau: np.ndarray
    rtt: np.ndarray
    final: np.ndarray
    tails: Optional[np.ndarray]  # [sends, width] bool: round 0's tail positions (None: no final send)
    any_final: bool             # some send is its link's last in the collective
    tail_resends: np.ndarray
    connections: int = 1


@dataclass
class Result:
    """One step through the transport (per send unless said otherwise)."""
    missing_row: np.ndarray     # sends and packet indices never delivered (sorted; failed sends left out)
    missing_packet: np.ndarray
    transmissions: np.ndarray   # packets put on the wire, resends included
    extra: float                # the step's time beyond loss-free: its slowest send's repairs
    shadow: float               # the same under the ideal preset (every wait one round trip)
    timeouts: np.ndarray        # waits on a timer
    failed: np.ndarray          # gave up after the preset's retries (retransmit only)
    windows: Optional[np.ndarray] = None  # TCP: [sends, connections, 3] congestion states after the step


def run_step(transport: Transport, nic: Nic, sends: Sends, draw: Draw, budget: float,
             windows: Optional[np.ndarray] = None) -> Result:
    """Carry one step's sends (each on its own link) through the transport, their fates drawn as masks;
    ``budget``: the seconds the step's repairs may take (``deadline`` only); ``windows``: TCP's congestion
    states of the sends' connections before the step (None: never cut)."""
    if nic.mode == "selective":
        return selective(nic, sends.host(), *_as_positions(draw, sends.packets.device), budget,
                         give_up=transport.kind == "deadline", windows=windows)
    return _go_back_n(nic, sends, draw)


def _as_positions(draw: Draw, device: torch.device) -> tuple[PositionsDraw, Count]:
    """A mask draw as selective repeat takes it: each round's mask is counted whole on its device, and only
    the positions of its losses come to the host (one ``nonzero``, a host sync, per round: the rounds go on
    while something is pending, which the host must know anyway)."""
    drawn = []   # the round's (lengths, commit)

    def positions(to_send: np.ndarray, width: int) -> np.ndarray:
        lengths = torch.tensor(to_send, device=device)   # a copy: the counters keep it until they flush
        lost, commit = draw(lengths)
        drawn[:] = lengths, commit
        return lost.flatten().nonzero().squeeze(1).cpu().numpy()

    def count(row: np.ndarray, column: np.ndarray, to_send: np.ndarray) -> None:
        lengths, commit = drawn
        commit(lengths)
    return positions, count


def selective(nic: Nic, a: HostSends, draw: PositionsDraw, count: Count, budget: float, give_up: bool,
              windows: Optional[np.ndarray] = None) -> Result:
    """Selective repeat (and the deadline's give-up) for one step, whatever keeps the packets' fates:
    ``draw`` hands each round's losses back as positions, ``count`` takes those that went out;
    ``windows``: TCP's congestion states of the sends' connections before the step (None: never cut).

    The pending packets are ``(row, packet)`` pairs, row-major; most rounds after the first resend a few
    packets and lose none, so the work that only losses, tails or failures need is skipped without them."""
    packets, n = a.packets, len(a.packets)
    sent = np.zeros(n, dtype=np.int64)
    waits, shadow = np.zeros(n), np.zeros(n)
    timeouts, streak = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    failed, stopped = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    streaking = False                                                   # some streak is not 0
    checks_failures = nic.retries is not None and not give_up
    to_send = pending = packets                                          # pending: per row
    given_up = []     # (rows, packets) still pending when their send stopped at the deadline
    width, rounds, row = a.width, 0, None
    rack = _Rack(nic, a, windows) if nic.rack else None
    while True:
        lost = draw(to_send, width)                                         # flat row * width + column
        lost_row, lost_column = np.divmod(lost, width)
        went = lost_column < to_send[lost_row]
        count(lost_row[went], lost_column[went], to_send)
        tail = timer = None
        if row is None:  # round 0 sends every packet in order: the lost ones that went out are pending
            row, packet = lost_row[went], lost_column[went]
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
                rack.resent(row, packet, again, rounds)
                waits, timeouts = waits + rack.late, timeouts + rack.late_timers
            row, packet, order = row[again], packet[again], order[again]
            if rack is None and len(row) and a.any_final:  # the round's last resends have nothing behind them
                tail = np.zeros(n, dtype=bool)
                tail[row[order >= (to_send - a.tail_resends)[row]]] = True
                tail &= a.final
        else:  # nothing lost this round: nothing pending
            if rack is not None:   # (every pending packet arrived: the last round's suspects were revealed)
                rack.resent(row, packet, np.zeros(len(row), dtype=bool), rounds)
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
            rtt = torch.from_numpy(a.rtt)
            wait = np.where(tail, nic.timer_s(rtt, torch.from_numpy(streak), torch.from_numpy(pending)).numpy(), a.rtt)
            streak, streaking, timer = np.where(tail, streak + 1, 0), True, tail
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
    resent = (sent - packets) * a.tau
    extra = np.where(stopped, budget, resent + waits)
    keep = ~failed[row]
    row, packet = row[keep], packet[keep]
    if given_up:
        row, packet = (np.concatenate([row, *(r for r, _ in given_up)]),
                       np.concatenate([packet, *(p for _, p in given_up)]))
        order = np.lexsort((packet, row))
        row, packet = row[order], packet[order]
    return Result(row, packet, sent, _slowest(extra), _slowest(resent + shadow), timeouts, failed,
                  None if rack is None else rack.windows)


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
        self.ends = np.array([self._start(c + 1) - 1 for c in range(k)]).T.reshape(n, k)
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
        delays = self._windows(row, packet) if self.nic.window else np.zeros(len(self.a.packets))
        waits, timer = np.zeros_like(self.spent), np.zeros(self.spent.shape, dtype=bool)
        self.suspects, self.next = [], np.zeros(len(row))
        if len(row):
            conn = self.connection(row, packet)
            for r in np.unique(row).tolist():
                mine = np.flatnonzero(row == r)
                self._first_row(r, packet[mine], conn[mine], mine, waits, timer)
        self._charge(waits, timer)
        return delays

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
            first, end = int(self._start(np.int64(c))[r]), int(self.ends[r, c])
            sacks, marks = (congestion.behind(mine - first, end - first + 1, n) + first + window for n in (1, dupacks))
        episode, reordered = (-math.inf, -math.inf), False
        for k, i in enumerate(mine.tolist()):
            if behind[k] == 0:
                continue
            sack = sacks[k] - 0.5
            if episode[0] <= sack < episode[1]:
                resend = sack
            elif behind[k] >= dupacks:
                resend = marks[k] - 0.5
                if resend >= episode[1]:
                    episode = (resend, episode[1])
            else:
                reordered = True
                self.next[at[k]] = self.ends[r, c] + self.AFTER_TIMER + self.TIE * i
                continue
            self.next[at[k]] = resend + self.TIE * i
            episode = (episode[0], max(episode[1], resend + window))
        return reordered, episode

    def resent(self, row: np.ndarray, packet: np.ndarray, lost: np.ndarray, rounds: int) -> None:
        """A later round's resends (row-major, ``lost``: which were lost again): the last round's suspects
        settled against them (``late``), then this round's waits and suspects."""
        before = self.spent.max(1)
        conn = self.connection(row, packet) if len(row) else row
        position, delivered = self.next.copy(), ~lost
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
        final = self.a.final[row] & lost
        for r, c in sorted(set(zip(row[final].tolist(), conn[final].tolist()))):
            mine = (row == r) & (conn == c) & lost & (position >= self.latest[r, c])
            if timed[r, c]:   # lost before the timer fired and found by nothing: the timer resends them too
                covered = mine & (position < self.fired[r, c])
                follow[covered] = self.fired[r, c] + packet[covered]
                mine &= ~covered
            if mine.any():
                self.suspects.append((r, c, float(position[mine].max()), ("rto", False), packet[mine]))
        self.next = follow[lost]
        self._charge(waits, np.zeros(self.spent.shape, dtype=bool))

    def _acked(self, row: np.ndarray, conn: np.ndarray, position: np.ndarray, delivered: np.ndarray) -> None:
        """An ACK with an RTT sample resets the RTO's backoff (one for a transmission after the last timer)."""
        fresh = delivered & (position >= self.fired[row, conn])
        self.backoff[row[fresh], conn[fresh]] = 0

    def keep(self, kept: np.ndarray) -> None:
        """Some pending packets left (their send stopped at the deadline): ``kept`` marks those that stay."""
        self.next = self.next[kept]

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

    def _windows(self, row: np.ndarray, packet: np.ndarray) -> np.ndarray:
        """Per send, the seconds beyond its loss-free time that its slowest connection's window costs, from
        its state before the step and round 0's losses (``congestion.carry``); the states after, each
        connection's window at the end and the windows its losses went out with (where resends go)."""
        a, k = self.a, self.a.connections
        delays = np.zeros(len(a.packets))
        bounds = np.searchsorted(row, np.arange(len(a.packets) + 1))
        conn = self.connection(row, packet) if len(row) else row
        for r in range(len(a.packets)):
            lost, mine = packet[bounds[r]:bounds[r + 1]], conn[bounds[r]:bounds[r + 1]]
            if not len(lost) and np.isnan(self.windows[r, :, 1]).all():
                continue   # never cut, nothing lost: at the pipe
            for c in range(k):
                first = int(self._start(np.int64(c))[r])
                count = int(self.ends[r, c]) - first + 1
                ours = lost[mine == c] - first
                delay, state, window, *found = congestion.carry(self.nic.window, self.windows[r, c], count, ours,
                                                                float(self.tau[r]), float(a.rtt[r]), self.nic.dupacks)
                self.windows[r, c], self.window[r, c] = state, window
                if len(ours):
                    self.found_at[(r, c)] = [x + first for x in found]
                delays[r] = max(delays[r], delay)
        return delays


def _member(keys: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """Whether each of ``keys`` is in the sorted array ``sorted_set``."""
    at = np.minimum(np.searchsorted(sorted_set, keys), len(sorted_set) - 1)
    return sorted_set[at] == keys


def _go_back_n(nic: Nic, s: Sends, draw: Draw) -> Result:
    packets = s.packets
    delivered = torch.zeros_like(packets)              # the in-order prefix the receiver holds
    sent = torch.zeros_like(packets)
    waits = torch.zeros_like(s.tau)
    shadow = torch.zeros_like(s.tau)                   # ideal: resend the lost packet, one round trip
    losses = torch.zeros_like(packets)
    timeouts = torch.zeros_like(packets)
    streak = torch.zeros_like(packets)                 # timeouts in a row
    lost_in_a_row = torch.zeros_like(packets)          # transmissions of the same packet lost in a row
    last_lost = torch.full_like(packets, -1)
    failed = torch.zeros_like(packets, dtype=torch.bool)
    while True:
        remaining = torch.where(failed, 0, packets - delivered)
        if not bool((remaining > 0).any()):
            break
        lost, commit = draw(remaining, known=False)   # how many go out depends on where the first loss is
        lost = lost & (torch.arange(lost.shape[1], device=lost.device) < remaining.unsqueeze(1))
        hit = lost.any(1)
        first = torch.where(hit, lost.int().argmax(1), remaining)
        after = (remaining - first - 1).clamp(min=0)  # packets behind the lost one
        wasted = torch.where(hit, torch.minimum(s.window, after), 0)
        used = torch.where(hit, first + 1 + wasted, remaining)
        commit(used)
        sent = sent + used
        lost_packet = delivered + first
        lost_in_a_row = torch.where(hit & (lost_packet == last_lost), lost_in_a_row + 1, hit.long())
        last_lost = torch.where(hit, lost_packet, last_lost)
        if nic.retries is not None:
            failed = failed | (lost_in_a_row > nic.retries)
        tail = hit & s.final & (after < nic.dupacks)
        nak = (s.rtt - wasted * s.tau).clamp(min=0)   # the NAK comes back while the window goes out
        wait = torch.where(hit, torch.where(tail, nic.timer_s(s.rtt, streak), nak), 0)
        streak = torch.where(tail, streak + 1, torch.where(hit, 0, streak))
        waits = waits + torch.where(failed, 0, wait)
        shadow = shadow + torch.where(hit, s.rtt, 0)
        losses = losses + hit
        timeouts = timeouts + (tail & ~failed)
        delivered = delivered + first
    nothing = np.zeros(0, dtype=np.int64)   # a go-back-N receiver ends with every packet, or fails
    return Result(nothing, nothing, sent.cpu().numpy(), _slowest((sent - packets) * s.tau + waits),
                  _slowest(losses * s.tau + shadow), timeouts.cpu().numpy(), failed.cpu().numpy())


def _slowest(seconds) -> float:
    """The largest of a step's per-send seconds (numpy or torch; small: Python's max over tolist() is the
    cheapest reduction)."""
    return max(seconds.tolist()) if len(seconds) else 0.0
