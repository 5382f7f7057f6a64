"""Retransmission: how real transports detect and repair a lost packet, and what it costs.

A loss is revealed by a later packet on the same connection (a NAK, a SACK, the receiver's bitmap:
one round trip), or by three duplicate ACKs for TCP; only a loss with nothing behind it on its
connection (a *tail* loss) waits for a timer. ``Nic`` presets say which repair a transport does
(selective repeat or go-back-N), what a tail loss waits for, and after how many retries it gives
up; each preset's source is in docs/time_model.md. Also: expected transmissions under independent
loss, the window a go-back-N sender wastes, and the InfiniBand ACK timeout.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import torch

from .links import Link

TCP_RTO_MIN_S = 0.2       # Linux TCP_RTO_MIN (HZ / 5)
IB_TIMEOUT_DEFAULT = 20   # NCCL_IB_TIMEOUT default in current NCCL releases (18 and 14 earlier)
IB_RETRY_COUNT = 7        # NCCL_IB_RETRY_CNT default: retries before the queue pair errors


@dataclass(frozen=True)
class Nic:
    """How a transport detects and repairs loss.

    ``mode``: selective repeat or go-back-N. ``dupacks``: how many later packets on a connection
    reveal a gap (1: a NAK or SACK on the next packet; TCP: 3 duplicate ACKs). ``timer``: what a
    loss nothing reveals waits for, a function of the round trip and of how many timeouts in a row
    the same packet has waited (``timer_s``). ``retries``: retransmissions of one packet before the
    transport gives up and the collective fails (None: never). ``rto_s`` fixes every timer (an
    explicit override)."""
    name: str
    mode: str = "selective"
    dupacks: int = 1
    timer: str = "rtt"            # rtt | fixed | rtt_multiple | backoff | probe_then_rto
    timer_value: float = 0.0      # fixed: seconds; rtt_multiple: the multiple; backoff: first timer (s)
    retries: Optional[int] = None
    rto_s: Optional[float] = None

    def timer_s(self, rtt: torch.Tensor, timeouts: torch.Tensor) -> torch.Tensor:
        """The wait of a tail loss: ``rtt`` per connection, ``timeouts`` it already waited in a row. Never
        less than a round trip: a timer firing sooner would resend packets that were not lost."""
        return torch.maximum(self._timer(rtt, timeouts), rtt)

    def _timer(self, rtt: torch.Tensor, timeouts: torch.Tensor) -> torch.Tensor:
        if self.rto_s is not None:
            return torch.full_like(rtt, self.rto_s)
        if self.timer == "rtt":
            return rtt
        if self.timer == "fixed":
            return torch.full_like(rtt, self.timer_value)
        if self.timer == "rtt_multiple":
            return rtt * self.timer_value
        if self.timer == "backoff":  # doubling over four ranges, then the queue pair's ACK timeout
            return torch.where(timeouts < 4, self.timer_value * 2.0 ** timeouts.clamp(max=3).to(rtt.dtype),
                               torch.full_like(rtt, ib_timeout_s()))
        # probe_then_rto: a tail-loss probe after two round trips, then the retransmission timeout
        return torch.where(timeouts == 0, 2 * rtt, torch.full_like(rtt, TCP_RTO_MIN_S))

    def override(self, retransmit: Optional[str] = None, rto_s: Optional[float] = None) -> "Nic":
        """This preset with the repair mode or every timer set explicitly."""
        changes = {}
        if retransmit is not None:
            changes["mode"] = retransmit
        if rto_s is not None:
            changes["rto_s"] = float(rto_s)
        return replace(self, **changes) if changes else self


NIC_PRESETS = {
    # A loss costs one resend and one round trip, wherever it falls: the lower bound.
    "ideal": Nic("ideal", "selective", 1, "rtt"),
    # IRN (Mittal et al., SIGCOMM 2018): selective repeat, a NACK on the first out-of-order packet,
    # RTO_low = 100 us when few packets are in flight (a tail loss), RoCE's retry counter.
    "irn": Nic("irn", "selective", 1, "fixed", 100e-6, IB_RETRY_COUNT),
    # AWS SRD (Shalev et al., IEEE Micro 2020): selective repeat, timers from measured round trips;
    # modelled as RFC 6298's first timeout from one sample, SRTT + 4 RTTVAR = 3 RTT.
    "srd": Nic("srd", "selective", 1, "rtt_multiple", 3.0),
    # ConnectX RC (RoCE): go-back-N on a NAK; adaptive retransmission starting near 4 us and doubling
    # over four ranges, then the ACK timeout (4.096 us x 2^NCCL_IB_TIMEOUT); NCCL_IB_RETRY_CNT = 7.
    "roce-gbn": Nic("roce-gbn", "go_back_n", 1, "backoff", 4e-6, IB_RETRY_COUNT),
    # TCP (gloo over sockets): fast retransmit after 3 duplicate ACKs, a tail-loss probe after 2 RTT
    # (RFC 8985), then RTO >= 200 ms (Linux TCP_RTO_MIN); tcp_retries2 = 15.
    "tcp": Nic("tcp", "selective", 3, "probe_then_rto", 0.0, 15),
}
DEFAULT_NIC = "irn"


def selective_repeat_transmissions(p: float) -> float:
    """E[transmissions per delivered packet] = 1 / (1 - p): geometric under i.i.d. loss p."""
    _check_loss(p)
    return 1.0 / (1.0 - p)


def go_back_n_transmissions(p: float, window: int) -> float:
    """E = (1 + p W) / (1 - p): each loss also wastes the W transmissions in flight behind it.

    Failures before success are geometric with mean p / (1 - p), each costing 1 + W:
    E = 1 + (1 + W) p / (1 - p) = (1 + p W) / (1 - p).
    """
    _check_loss(p)
    if window < 0:
        raise ValueError(f"window={window} must be >= 0 packets")
    return (1.0 + p * window) / (1.0 - p)


def window_packets(link: Link, packet_payload: int = 1450) -> int:
    """W = ceil(2 alpha B / wire(pp, 1)): full packets sent during one round trip."""
    return math.ceil(2 * link.latency_s * link.bandwidth_Bps / link.wire_bytes(packet_payload, 1))


def ib_timeout_s(t: int = IB_TIMEOUT_DEFAULT) -> float:
    """IB local ACK timeout = 4.096 us * 2^t (NCCL_IB_TIMEOUT = t)."""
    if int(t) != t or not 0 <= t <= 31:
        raise ValueError(f"t={t!r} must be an integer in [0, 31]")
    return 4.096e-6 * 2**int(t)


def _check_loss(p: float) -> None:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"p={p!r} must be a loss probability in [0, 1)")


def parse_nic(name) -> Nic:
    """A NIC preset by name (``ideal``, ``irn``, ``srd``, ``roce-gbn``, ``tcp``)."""
    if isinstance(name, Nic):
        return name
    if name not in NIC_PRESETS:
        raise ValueError(f"nic={name!r} must be one of {', '.join(NIC_PRESETS)}")
    return NIC_PRESETS[name]


_STREAK_CAP = 4   # every preset's timer is constant from the fourth timeout in a row on


def expected_repair_s(nic: Nic, packets: int, p: float, tau: float, rtt: float, window: int = 0,
                      final: bool = True) -> float:
    """E[seconds] that repairing ``packets`` packets on one connection adds under i.i.d. loss ``p``:
    resends times ``tau`` (wire time of a packet) plus the waits before each repair round (one
    round trip, or the preset's timer for a tail loss when the step is the connection's ``final``
    one; one channel). Exact, by first-step analysis of the Markov chain the transport runs
    (``lossysim.net.transport``), ignoring the retry limit (a packet fails with probability
    p^(retries + 1))."""
    _check_loss(p)
    timers = [float(nic.timer_s(torch.tensor([rtt]), torch.tensor([s]))) if final else rtt
              for s in range(_STREAK_CAP + 1)]
    dupacks = nic.dupacks if final else 0
    if nic.mode == "selective":
        return _selective_expectation(packets, p, tau, rtt, dupacks, timers)
    return _go_back_n_expectation(packets, p, tau, rtt, window, dupacks, timers) - packets * tau


def _selective_expectation(n, p, tau, rtt, dupacks, timers) -> float:
    """F(m, s): expected extra seconds once a round sends m packets with s timeouts in a row behind it.
    Of the m, the last min(dupacks, m) are tails; the lost ones (t tails, u others) go again after a
    round trip, or after timers[s] when a tail was lost."""
    from scipy.stats import binom
    cap = _STREAK_CAP
    F = np.zeros((n + 1, cap + 1))
    for m in range(1, n + 1):
        k = min(dupacks, m)
        u = np.arange(m - k + 1)
        u_pmf = binom.pmf(u, m - k, p)
        t_pmf = binom.pmf(np.arange(k + 1), k, p)
        # the all-lost outcome returns to m: with a tail in it to (m, s + 1), else to (m, 0)
        order = range(cap, -1, -1) if k else [0, *range(1, cap + 1)]
        for s in order:
            rest, self_loop = 0.0, 0.0
            for t in range(k + 1):
                q, m2 = t_pmf[t] * u_pmf, t + u
                wait, s2 = (timers[s], min(s + 1, cap)) if t else (rtt, 0)
                q = np.where(m2 > 0, q, 0.0)
                here = (m2 == m) & (s2 == s)
                self_loop += q[here].sum()
                rest += (q * (wait + m2 * tau)).sum() + (q * np.where(here, 0.0, F[m2, s2])).sum()
            F[m, s] = rest / (1.0 - self_loop)
    return float(F[n, 0])


def _go_back_n_expectation(n, p, tau, rtt, window, dupacks, timers) -> float:
    """G(r, s): expected seconds of sending r remaining packets (transmissions included) with s
    timeouts in a row behind. A round stops at the first loss f: f + 1 packets and up to
    ``window`` wasted ones go out; the lost packet waits for the NAK (a round trip less the
    window's wire time) or, with fewer than ``dupacks`` packets behind it, a timer."""
    cap = _STREAK_CAP
    G = np.zeros((n + 1, cap + 1))
    for r in range(1, n + 1):
        f = np.arange(r)
        after = r - f - 1
        wasted = np.minimum(window, after)
        tail = after < dupacks
        q = p * (1 - p) ** f
        order = range(cap, -1, -1) if tail[0] else [0, *range(1, cap + 1)]
        for s in order:
            wait = np.where(tail, timers[s], np.maximum(rtt - wasted * tau, 0.0))
            s2 = np.where(tail, min(s + 1, cap), 0)
            here = (f == 0) & (s2 == s)
            rest = (1 - p) ** r * r * tau + (q * ((f + 1 + wasted) * tau + wait)).sum()
            rest += (q * np.where(here, 0.0, G[r - f, s2])).sum()
            G[r, s] = rest / (1.0 - q[here].sum())
    return float(G[n, 0])
