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

from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from ..timing.retransmission import Nic, congestion_delay_s

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
    _host: Optional["HostSends"] = field(default=None, repr=False, compare=False)

    def host(self) -> "HostSends":
        """What selective repeat reads, as numpy arrays (copied once: a step lives as long as its network)."""
        if self._host is None:
            final = self.final.cpu().numpy()
            packets = self.packets.cpu().numpy().astype(np.int64)
            self._host = HostSends(packets, int(packets.max()) if len(packets) else 0, self.tau.cpu().numpy(),
                                   self.rtt.cpu().numpy(), final, self.tails.cpu().numpy() if final.any() else None,
                                   bool(final.any()), self.tail_resends.cpu().numpy().astype(np.int64))
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


def run_step(transport: Transport, nic: Nic, sends: Sends, draw: Draw, budget: float) -> Result:
    """Carry one step's sends (each on its own link) through the transport, their fates drawn as masks;
    ``budget``: the seconds the step's repairs may take (``deadline`` only)."""
    if nic.mode == "selective":
        return selective(nic, sends.host(), *_as_positions(draw, sends.packets.device), budget,
                         give_up=transport.kind == "deadline")
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


def selective(nic: Nic, a: HostSends, draw: PositionsDraw, count: Count, budget: float, give_up: bool) -> Result:
    """Selective repeat (and the deadline's give-up) for one step, whatever keeps the packets' fates:
    ``draw`` hands each round's losses back as positions, ``count`` takes those that went out.

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
    while True:
        lost = draw(to_send, width)                                         # flat row * width + column
        lost_row, lost_column = np.divmod(lost, width)
        went = lost_column < to_send[lost_row]
        count(lost_row[went], lost_column[went], to_send)
        tail = reordered = None
        if row is None:  # round 0 sends every packet in order: the lost ones that went out are pending
            row, packet = lost_row[went], lost_column[went]
            if nic.window and len(row):
                waits = waits + _window_delays(nic, a, row, packet)
            if a.tails is not None and len(row):
                at_tail = a.tails[row, packet]
                tail = np.zeros(n, dtype=bool)
                if nic.rack:  # a lost tail with an arrived packet behind it waits RACK's timer, not the probe
                    hidden = at_tail & ~_arrived_behind(a, row, packet, lost, width, nic.dupacks)
                    tail[row[hidden]] = True
                    reordered = np.zeros(n, dtype=bool)
                    reordered[row[at_tail & ~hidden]] = True
                    reordered &= ~tail
                    tail |= reordered
                else:
                    tail[row[at_tail]] = True
        elif len(lost) and len(row):
            # The k-th pending packet of a row goes out as its k-th transmission of the round (a row with
            # more pending than the round's width, one that failed and sends nothing, reads the last column).
            order = np.minimum(np.arange(len(row)) - (np.cumsum(pending) - pending)[row], width - 1)
            again = _member(row * width + order, lost)
            row, packet, order = row[again], packet[again], order[again]
            if len(row) and a.any_final:  # the round's last resends have nothing behind them in the last step
                tail = np.zeros(n, dtype=bool)
                tail[row[order >= (to_send - a.tail_resends)[row]]] = True
                tail &= a.final
        else:  # nothing lost this round: nothing pending
            row, packet = row[:0], packet[:0]
        sent = sent + to_send
        rounds += 1
        to_send = pending = np.bincount(row, minlength=n)
        if checks_failures and rounds > nic.retries:
            failed = failed | (to_send > 0)
            to_send = np.where(failed, 0, to_send)
        # (small arrays: Python's any and max over tolist() cost a tenth of numpy's reductions)
        if tail is not None and any(tail.tolist()):
            rtt = torch.from_numpy(a.rtt)
            wait = nic.timer_s(rtt, torch.from_numpy(streak), torch.from_numpy(pending)).numpy()
            if reordered is not None:
                wait = np.where(reordered, nic.reorder_s(rtt).numpy(), wait)
            wait = np.where(tail, wait, a.rtt)
            streak, streaking = np.where(tail, streak + 1, 0), True
        else:
            wait, tail = a.rtt, None
            if streaking:
                streak, streaking = np.zeros(n, dtype=np.int64), False
        if give_up and len(row):  # the next round must end within the budget, or the receiver stops waiting
            late = (to_send > 0) & ((sent - packets) * a.tau + waits + wait + to_send * a.tau > budget)
            if any(late.tolist()):   # a stopped send's pending packets stay missing: set them aside
                out = late[row]
                given_up.append((row[out], packet[out]))
                row, packet = row[~out], packet[~out]
                stopped, pending = stopped | late, np.where(late, 0, pending)
                to_send = np.where(late, 0, to_send)
        active = to_send > 0
        if not any(active.tolist()):
            break
        waits = waits + np.where(active, wait, 0.0)
        shadow = shadow + np.where(active, a.rtt, 0.0)
        if tail is not None:
            timeouts = timeouts + (active & tail)
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
    return Result(row, packet, sent, _slowest(extra), _slowest(resent + shadow), timeouts, failed)


def _arrived_behind(a: HostSends, row: np.ndarray, packet: np.ndarray, lost: np.ndarray, width: int,
                    dupacks: int) -> np.ndarray:
    """Whether a packet behind each lost (row, packet), among the next ``dupacks - 1`` tail positions
    of its channel, arrived in round 0 (its SACK reveals the loss)."""
    arrived = np.zeros(len(row), dtype=bool)
    inside = np.ones(len(row), dtype=bool)
    for j in range(1, dupacks):
        behind = packet + j
        inside &= (behind < a.packets[row]) & a.tails[row, np.minimum(behind, width - 1)]
        arrived |= inside & ~_member(row * width + behind, lost)
    return arrived


def _window_delays(nic: Nic, a: HostSends, row: np.ndarray, packet: np.ndarray) -> np.ndarray:
    """Per send, the seconds its congestion window's cuts at round 0's losses cost (``congestion_delay_s``);
    ``row`` sorted, so each send's lost packets are one slice, in sending order."""
    delays = np.zeros(len(a.packets))
    bounds = np.searchsorted(row, np.arange(len(a.packets) + 1))
    for r in np.unique(row).tolist():
        delays[r] = congestion_delay_s(nic, int(a.packets[r]), packet[bounds[r]:bounds[r + 1]],
                                       float(a.tau[r]), float(a.rtt[r]))
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
