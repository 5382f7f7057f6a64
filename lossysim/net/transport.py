"""Transports: what a lost packet costs in time, and whether it is repaired.

- ``drop``: a lost packet is gone; a send takes its loss-free time.
- ``retransmit``: every lost packet is sent again until it arrives; each resend is the
  link's next packet and goes through the link's loss chain, so it can be lost again.
  Tensors arrive exact; time grows.
  - ``selective`` (selective repeat): round 0 sends the message; each later round resends
    the packets the previous round lost, after a NACK (one round trip, 2 alpha), or after
    the retransmission timeout when the round's last packet was lost (nothing after it
    reveals the gap).
  - ``go_back_n`` (RoCE NICs' default): the receiver drops everything after a gap; the
    sender keeps sending until the NACK arrives (the ``window`` packets in flight during a
    round trip are wasted) and then resends from the lost packet. A lost last packet waits
    for the timeout.
- ``deadline``: selective repeat while the step is within its budget (``deadline`` times
  its loss-free time), then give up: what is still missing is lost, and the step ends at
  its budget (the bounded-time idea of OptiReduce). Its receiver keeps packets that arrive
  after a gap, as a bounded-time collective must: go-back-N would throw them away.

A send's time is ``alpha + transmissions * tau + waits`` where tau is the wire time of
one packet on that link (port sharing included) and waits are the round trips and
timeouts above; a step ends with its slowest send (see docs/time_model.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

TRANSPORTS = ("drop", "retransmit", "deadline")
MODES = ("selective", "go_back_n")

# draw(lengths, known=True) -> (lost [n, max(lengths)], commit(used)): the next transmissions on
# each link; commit says how many were really sent (counters, and the chains when not known).
Draw = Callable[..., tuple]


@dataclass(frozen=True)
class Transport:
    kind: str = "drop"           # drop | retransmit | deadline
    mode: str = "selective"      # selective | go_back_n (retransmit and deadline)
    deadline: float = 1.5        # deadline: a step's budget as a multiple of its loss-free time

    def __post_init__(self):
        if self.kind not in TRANSPORTS:
            raise ValueError(f"transport={self.kind!r} must be one of {', '.join(TRANSPORTS)}")
        if self.mode not in MODES:
            raise ValueError(f"retransmit={self.mode!r} must be one of {', '.join(MODES)}")
        if not self.deadline >= 1.0:
            raise ValueError(f"deadline={self.deadline} must be >= 1 (a multiple of the loss-free time)")
        if self.kind == "deadline" and self.mode == "go_back_n":
            raise ValueError("retransmit=go_back_n with transport=deadline is not supported: at the deadline a "
                             "go-back-N receiver holds only the packets before the first gap; use selective")

    @property
    def repairs(self) -> bool:
        """Whether lost packets are sent again."""
        return self.kind != "drop"

    @property
    def exact(self) -> bool:
        """Whether tensors always arrive exact (only time is lost)."""
        return self.kind == "retransmit"


@dataclass
class StepResult:
    missing: torch.Tensor        # [sends, max packets] packets never delivered
    transmissions: torch.Tensor  # [sends] packets put on the wire, resends included
    time: torch.Tensor           # [] the step's duration: its slowest send


def run_step(transport: Transport, packets: torch.Tensor, draw: Draw, alpha: torch.Tensor,
             tau: torch.Tensor, rto: torch.Tensor, window: torch.Tensor, budget: float) -> StepResult:
    """Carry one step's sends (``packets`` each, on distinct links) through the transport.

    ``alpha``, ``tau``, ``rto``, ``window`` are per send; ``budget`` is the step's deadline in
    seconds (ignored unless the transport is ``deadline``).
    """
    if transport.mode == "selective":
        return _selective(packets, draw, alpha, tau, rto, budget, give_up=transport.kind == "deadline")
    return _go_back_n(packets, draw, alpha, tau, rto, window)


def _selective(packets, draw, alpha, tau, rto, budget, give_up):
    width = int(packets.max()) if packets.numel() else 0
    slot = torch.arange(width, device=packets.device)
    pending = slot < packets.unsqueeze(1)             # packets not yet delivered
    to_send = packets.clone()
    time = alpha.clone()
    sent = torch.zeros_like(packets)
    stopped = torch.zeros_like(packets, dtype=torch.bool)
    while True:
        lost, commit = draw(to_send)
        commit(to_send)
        # The k-th pending packet goes out as this round's k-th transmission.
        order = (pending.cumsum(1) - 1).clamp(min=0, max=max(lost.shape[1] - 1, 0))
        pending = pending & (lost.gather(1, order) if lost.shape[1] else torch.zeros_like(pending))
        time = time + to_send * tau
        sent = sent + to_send
        last = (to_send - 1).clamp(min=0).unsqueeze(1)
        tail = (to_send > 0) & (lost.gather(1, last).squeeze(1) if lost.shape[1] else False)
        to_send = pending.sum(1)
        wait = torch.where(tail, rto, 2 * alpha)
        if give_up:  # the next round must end within the budget, or the receiver stops waiting
            late = (to_send > 0) & (time + wait + to_send * tau > budget)
            stopped = stopped | late
            to_send = torch.where(late, 0, to_send)
        if not bool((to_send > 0).any()):
            break
        time = time + torch.where(to_send > 0, wait, 0)
    time = torch.where(stopped, torch.full_like(time, budget), time)
    return StepResult(pending, sent, time.max() if time.numel() else time.sum())


def _go_back_n(packets, draw, alpha, tau, rto, window):
    width = int(packets.max()) if packets.numel() else 0
    delivered = torch.zeros_like(packets)             # the in-order prefix the receiver holds
    time = alpha.clone()
    sent = torch.zeros_like(packets)
    while True:
        remaining = packets - delivered
        if not bool((remaining > 0).any()):
            break
        lost, commit = draw(remaining, known=False)  # how many go out depends on where the first loss is
        lost = lost & (torch.arange(lost.shape[1], device=lost.device) < remaining.unsqueeze(1))
        hit = lost.any(1)
        first = torch.where(hit, lost.int().argmax(1), remaining)
        after = (remaining - first - 1).clamp(min=0)  # packets behind the lost one
        wasted = torch.where(hit, torch.minimum(window, after), 0)
        used = torch.where(hit, first + 1 + wasted, remaining)
        commit(used)
        sent = sent + used
        time = time + used * tau
        wait = torch.where(hit, torch.where(after == 0, rto, (2 * alpha - wasted * tau).clamp(min=0)), 0)
        delivered = delivered + first
        time = time + wait
    missing = torch.zeros(len(packets), width, dtype=torch.bool, device=packets.device)
    return StepResult(missing, sent, time.max() if time.numel() else time.sum())
