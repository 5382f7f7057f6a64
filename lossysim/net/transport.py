"""Transports: whether a lost packet is repaired, and what the repair costs in time.

- ``drop``: a lost packet is gone; a collective takes its loss-free time.
- ``retransmit``: every lost packet is sent again until it arrives, as the NIC preset repairs it
  (``lossysim.timing.retransmission.Nic``); each resend is the link's next packet and goes through
  the link's loss chain, so it can be lost again. Tensors arrive exact; time grows. A packet still
  lost after the preset's retries fails the collective (the job restarts: the runner charges it).
  - selective repeat: round 0 sends the message; each later round resends what the previous one
    lost, once the loss is known: one round trip when a later packet on the same connection
    reveals the gap, the preset's timer when nothing behind it does (a *tail* loss).
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

from dataclasses import dataclass
from typing import Callable

import torch

from ..timing.retransmission import Nic

TRANSPORTS = ("drop", "retransmit", "deadline")
MODES = ("selective", "go_back_n")

# draw(lengths, known=True) -> (lost [n, max(lengths)], commit(used)): the next transmissions on
# each link; commit says how many were really sent (counters, and the chains when not known).
Draw = Callable[..., tuple]


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


@dataclass
class StepResult:
    missing: torch.Tensor        # [sends, max packets] packets never delivered
    transmissions: torch.Tensor  # [sends] packets put on the wire, resends included
    extra: torch.Tensor          # [] the step's time beyond loss-free: its slowest send's repairs
    shadow: torch.Tensor         # [] the same under the ideal preset (every wait one round trip)
    timeouts: torch.Tensor       # [sends] waits on a timer
    failed: torch.Tensor         # [sends] gave up after the preset's retries (retransmit only)


def run_step(transport: Transport, nic: Nic, sends: Sends, draw: Draw, budget: float) -> StepResult:
    """Carry one step's sends (each on its own link) through the transport; ``budget``: the seconds the
    step's repairs may take (``deadline`` only)."""
    if nic.mode == "selective":
        return _selective(nic, sends, draw, budget, give_up=transport.kind == "deadline")
    return _go_back_n(nic, sends, draw)


def _selective(nic: Nic, s: Sends, draw: Draw, budget: float, give_up: bool) -> StepResult:
    packets = s.packets
    width = int(packets.max()) if packets.numel() else 0
    slot = torch.arange(width, device=packets.device)
    pending = slot < packets.unsqueeze(1)              # packets not yet delivered
    to_send = packets.clone()
    sent = torch.zeros_like(packets)
    waits = torch.zeros_like(s.tau)
    shadow = torch.zeros_like(s.tau)
    timeouts = torch.zeros_like(packets)
    streak = torch.zeros_like(packets)                 # timeouts in a row (timers back off)
    failed = torch.zeros_like(packets, dtype=torch.bool)
    stopped = torch.zeros_like(failed)
    rounds = 0
    while True:
        lost, commit = draw(to_send)
        commit(to_send)
        # The k-th pending packet goes out as this round's k-th transmission.
        order = (pending.cumsum(1) - 1).clamp(min=0, max=max(lost.shape[1] - 1, 0))
        again = pending & (lost.gather(1, order) if lost.shape[1] else torch.zeros_like(pending))
        if rounds == 0:
            tail = (again & s.tails[:, :width]).any(1)
        else:  # the round's last resends have nothing behind them in the link's last step
            tail = s.final & (again & (order >= (to_send - s.tail_resends).unsqueeze(1))).any(1)
        sent = sent + to_send
        rounds += 1
        pending = again
        to_send = pending.sum(1)
        if nic.retries is not None and not give_up:
            failed = failed | ((to_send > 0) & (rounds > nic.retries))
            to_send = torch.where(failed, 0, to_send)
        wait = torch.where(tail, nic.timer_s(s.rtt, streak), s.rtt)
        streak = torch.where(tail, streak + 1, 0)
        if give_up:  # the next round must end within the budget, or the receiver stops waiting
            late = (to_send > 0) & ((sent - packets) * s.tau + waits + wait + to_send * s.tau > budget)
            stopped = stopped | late
            to_send = torch.where(late, 0, to_send)
        if not bool((to_send > 0).any()):
            break
        active = to_send > 0
        waits = waits + torch.where(active, wait, 0)
        shadow = shadow + torch.where(active, s.rtt, 0)
        timeouts = timeouts + (active & tail)
    resent = (sent - packets) * s.tau
    extra = torch.where(stopped, torch.full_like(waits, budget), resent + waits)
    return StepResult(pending & ~failed.unsqueeze(1), sent, _slowest(extra), _slowest(resent + shadow),
                      timeouts, failed)


def _go_back_n(nic: Nic, s: Sends, draw: Draw) -> StepResult:
    packets = s.packets
    width = int(packets.max()) if packets.numel() else 0
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
    missing = torch.zeros(len(packets), width, dtype=torch.bool, device=packets.device)
    return StepResult(missing, sent, _slowest((sent - packets) * s.tau + waits), _slowest(losses * s.tau + shadow),
                      timeouts, failed)


def _slowest(seconds: torch.Tensor) -> torch.Tensor:
    return seconds.max() if seconds.numel() else seconds.sum()
