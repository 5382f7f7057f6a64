"""Go-back-N (RoCE NICs), over masks: the receiver drops everything after a gap; the sender keeps sending
until the NAK arrives (the ``window`` packets in flight during a round trip are wasted), then resends from
the lost packet; a tail loss waits for the timer. Its receiver ends with every packet, or fails."""
from __future__ import annotations

import numpy as np
import torch

from ...timing.retransmission import Nic
from .sends import Draw, Result, Sends, slowest


def go_back_n(nic: Nic, s: Sends, draw: Draw) -> Result:
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
    return Result(nothing, nothing, sent.cpu().numpy(), slowest((sent - packets) * s.tau + waits),
                  slowest(losses * s.tau + shadow), timeouts.cpu().numpy(), failed.cpu().numpy())
