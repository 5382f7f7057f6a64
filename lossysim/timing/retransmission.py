"""Retransmission: how real transports detect and repair a lost packet, and what it costs.

A loss is revealed by a later packet on the same connection (a NAK, a SACK, the receiver's bitmap:
one round trip), or for TCP by RACK (a packet sent after it delivered, with three SACKed behind it or
in recovery at once, else after RACK's reordering timer); only a loss with nothing delivered behind it
on its connection (a *tail* loss) waits for a timer. ``Nic`` presets say which repair a transport does
(selective repeat or go-back-N), what a tail loss waits for, after how many retries it gives up, and
for TCP what a loss does to the congestion window (``timing.congestion``); each preset's source is in
docs/time_model.md. Also: expected transmissions under independent loss, the window a go-back-N
sender wastes, the InfiniBand ACK timeout and Linux TCP's timers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import torch

from .links import Link

# Linux TCP, include/net/tcp.h. Timers run in jiffies: HZ = 1000 (CONFIG_HZ_1000; 250 on some
# distributions makes each rounding 4 ms).
HZ = 1000
TCP_RTO_MIN_S = 0.2       # TCP_RTO_MIN (HZ / 5), also the probe's delayed-ACK allowance
TCP_TIMEOUT_MIN_S = 0.002  # TCP_TIMEOUT_MIN_US: the least a probe or reordering timer adds
TCP_RTO_MAX_S = 120.0     # TCP_RTO_MAX: where the RTO's doubling stops
TCP_RETRIES2 = 15         # net.ipv4.tcp_retries2
IB_TIMEOUT_DEFAULT = 20   # NCCL_IB_TIMEOUT default in current NCCL releases (18 and 14 earlier)
IB_RETRY_COUNT = 7        # NCCL_IB_RETRY_CNT default: retries before the queue pair errors
ROCE_FIRST_TIMEOUT_S = 2e-3  # ConnectX adaptive retransmission's first timeout, as measured (presets below)


def ib_timeout_s(t: int = IB_TIMEOUT_DEFAULT) -> float:
    """IB local ACK timeout = 4.096 us * 2^t (NCCL_IB_TIMEOUT = t)."""
    if int(t) != t or not 0 <= t <= 31:
        raise ValueError(f"t={t!r} must be an integer in [0, 31]")
    return 4.096e-6 * 2**int(t)


@dataclass(frozen=True)
class Nic:
    """How a transport detects and repairs loss.

    ``mode``: selective repeat or go-back-N. ``dupacks``: how many later packets on a connection
    reveal a gap at once (1: a NAK or SACK on the next packet; TCP: ``tp->reordering`` = 3 SACKed
    packets). ``timer``: what a loss nothing reveals waits for, a function of the round trip and of
    how many timeouts in a row the same packet has waited (``timer_s``); ``linux`` is Linux TCP's
    RACK-TLP and RTO (``rack``: the probe, the RTO and RACK's reordering timer below). ``retries``:
    retransmissions of one packet before the transport gives up and the collective fails (None: never).
    ``rto_s`` fixes every timer (an explicit override). ``window``: what a loss does to the sender's
    congestion window (``cubic``, ``reno``; empty: nothing, as BBR or an RDMA NIC), charged by
    ``timing.congestion``."""
    name: str
    mode: str = "selective"
    dupacks: int = 1
    timer: str = "rtt"            # rtt | fixed | rtt_multiple | backoff | linux
    timer_value: float = 0.0      # fixed: seconds; rtt_multiple: the multiple; backoff: first timer (s)
    retries: Optional[int] = None
    rto_s: Optional[float] = None
    window: str = ""              # cubic | reno | "" (a loss leaves the window alone)

    def timer_s(self, rtt: torch.Tensor, timeouts: torch.Tensor,
                outstanding: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The wait of a tail loss: ``rtt`` per connection, ``timeouts`` it already waited in a row,
        ``outstanding`` its packets still unacknowledged (None: several). Never less than a round trip:
        a timer firing sooner would resend packets that were not lost."""
        return torch.maximum(self._timer(rtt, timeouts, outstanding), rtt)

    @property
    def rack(self) -> bool:
        """Whether losses are found as Linux TCP finds them (RACK-TLP: ``reorder_s``, ``probe_s``,
        ``rto_s_after``; ``net.transport``'s RACK rule) rather than by a tail timer."""
        return self.timer == "linux"

    def reorder_s(self, rtt):
        """The wait of a loss that one or two later SACKed packets reveal outside recovery (RACK's
        reordering window min_rtt / 4, armed as jiffies + TCP_TIMEOUT_MIN, after the SACK's round trip);
        numpy or torch."""
        if self.rto_s is not None:
            return _largest(rtt, self.rto_s)
        return rtt + _jiffies(rtt / 4 + TCP_TIMEOUT_MIN_S)

    def probe_s(self, rtt: np.ndarray, one_out: np.ndarray) -> np.ndarray:
        """The wait of a lost tail outside recovery, from its send: the tail-loss probe armed by the last
        ACK (``linux_tcp_timer_s`` at no timeout yet); ``one_out``: one packet unacknowledged."""
        if self.rto_s is not None:
            return _largest(rtt, self.rto_s)
        return np.maximum(rtt + np.minimum(np.where(one_out, _jiffies(2 * rtt + TCP_RTO_MIN_S),
                                                    _jiffies(2 * rtt + TCP_TIMEOUT_MIN_S)), _rto(rtt)), rtt)

    def rto_s_after(self, rtt: np.ndarray, backoffs: np.ndarray, ack: bool = False) -> np.ndarray:
        """The RTO's wait, from the last transmission: ``backoffs`` RTOs already fired in a row double it
        (tcp_retransmit_timer), up to TCP_RTO_MAX; ``ack``: armed by the last ACK, a round trip after the
        send (tcp_rearm_rto), as a lost tail's is in recovery, where no probe is armed."""
        if self.rto_s is not None:
            return _largest(rtt, self.rto_s)
        wait = np.minimum(_rto(rtt) * 2.0 ** np.minimum(backoffs, 30), TCP_RTO_MAX_S)
        return np.maximum(wait + (rtt if ack else 0.0), rtt)

    def _timer(self, rtt: torch.Tensor, timeouts: torch.Tensor, outstanding) -> torch.Tensor:
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
        one = torch.zeros_like(timeouts, dtype=torch.bool) if outstanding is None else outstanding == 1
        return linux_tcp_timer_s(rtt, timeouts, one)

    def override(self, retransmit: Optional[str] = None, rto_s: Optional[float] = None,
                 congestion: Optional[str] = None) -> "Nic":
        """This preset with the repair mode, every timer or a TCP window's congestion control (``cubic``,
        ``reno``, ``bbr``: never cut) set explicitly."""
        changes = {}
        if retransmit is not None:
            changes["mode"] = retransmit
        if rto_s is not None:
            changes["rto_s"] = float(rto_s)
        if congestion is not None:
            changes["window"] = "" if congestion == "bbr" else congestion
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
    # ConnectX RC (RoCE): go-back-N on a NAK; adaptive retransmission doubling over four ranges, then the
    # ACK timeout (4.096 us x 2^NCCL_IB_TIMEOUT); NCCL_IB_RETRY_CNT = 7. The first timeout is what was
    # measured: a ConnectX-5 retransmitted after 2, 4, 8, 16 ms whatever the verbs timeout
    # (linux-rdma/perftest#251); RoCEv2 on a 30 ms path every 10 ms, NCCL_IB_TIMEOUT changing nothing
    # (NVIDIA/nccl#1555). NVIDIA's adaptive-retransmission profiles name 4 us only as their smallest time
    # base; the default profile's values are not published (docs/time_model.md: the sensitivity).
    "roce-gbn": Nic("roce-gbn", "go_back_n", 1, "backoff", ROCE_FIRST_TIMEOUT_S, IB_RETRY_COUNT),
    # ConnectX RC with adaptive retransmission off: a tail loss waits the ACK timeout itself,
    # 4.096 us x 2^NCCL_IB_TIMEOUT (4.29 s at NCCL's default 20), as NCCL's docs give it.
    "roce-gbn-timeout": Nic("roce-gbn-timeout", "go_back_n", 1, "fixed", ib_timeout_s(), IB_RETRY_COUNT),
    # Linux TCP (gloo, NCCL's socket transport) with SACK and RACK-TLP, the kernel's defaults: a loss
    # with 3 SACKed packets behind it, or any delivered behind it in recovery, is resent after a round
    # trip, with 1 or 2 outside recovery after RACK's reordering timer, with none after the tail-loss
    # probe (outside recovery) or the RTO from SRTT + 200 ms, doubling; tcp_retries2 = 15. CUBIC
    # (Linux's default) cuts the window at each loss episode; the window outlives the message.
    "tcp": Nic("tcp", "selective", 3, "linux", 0.0, TCP_RETRIES2, window="cubic"),
    # The same with BBR (tcp_bbr.c), whose rate follows the bottleneck it measures, not random loss.
    "tcp-bbr": Nic("tcp-bbr", "selective", 3, "linux", 0.0, TCP_RETRIES2),
}
DEFAULT_NIC = "irn"


def rc_give_up_s(timeout: int = IB_TIMEOUT_DEFAULT, retries: int = IB_RETRY_COUNT) -> float:
    """How long an RC queue pair that nothing acknowledges lasts before it errors: its first send and
    each of ``retries`` retries wait an ACK timeout, 4.096 us x 2^``timeout`` (NCCL_IB_TIMEOUT): 34.4 s at
    20 and 7 retries, 8.6 s at 18."""
    return (int(retries) + 1) * ib_timeout_s(timeout)


def outage_waits(nic: Nic, timeout: int = IB_TIMEOUT_DEFAULT, rtt_s: float = 0.0) -> Optional[tuple[float, ...]]:
    """The timers a connection waits in a row while nothing it sends arrives (a cable down), the last
    one ending with the transport giving up: an RDMA preset's queue pair waits the ACK timeout
    (``timeout``) before each of its ``retries`` retries and once more after the last (adaptive
    retransmission's first millisecond ranges are left out: they are capped by the same timeout and
    only matter for outages of a few ms); TCP waits its RTO from ``rtt_s``, doubling up to
    TCP_RTO_MAX, ``tcp_retries2`` + 1 times (924.6 s at a short round trip). None: a preset that never
    gives up (``ideal``, ``srd``), modelled as resending the moment a path is back."""
    if nic.retries is None:
        return None
    if nic.rack:
        first = nic.rto_s if nic.rto_s is not None else float(_rto(np.float64(rtt_s)))
        return tuple(min(first * 2.0 ** i, TCP_RTO_MAX_S) for i in range(nic.retries + 1))
    return (ib_timeout_s(timeout),) * (nic.retries + 1)


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


def linux_tcp_timer_s(srtt: torch.Tensor, timeouts: torch.Tensor, one_outstanding: torch.Tensor) -> torch.Tensor:
    """What a tail loss waits on Linux TCP, from its last transmission, ``timeouts`` in a row behind it.

    The RTO is SRTT + RTTVAR with RTTVAR floored at 200 ms (tcp_rtt_estimator in tcp_input.c floors
    mdev_max_us at tcp_rto_min_us; __tcp_set_rto in tcp.h), in whole jiffies. The first wait is the
    tail-loss probe, armed by the last ACK a round trip after the send (tcp_set_xmit_timer):
    tcp_schedule_loss_probe (tcp_output.c) sets 2 SRTT + TCP_TIMEOUT_MIN_US, or + tcp_rto_min_us when
    one packet is out (the receiver may delay that one ACK), and no later than the RTO. A probe lost
    too waits the RTO (tcp_rearm_rto), and each later one twice the last (tcp_retransmit_timer),
    up to TCP_RTO_MAX."""
    rto = _rto(srtt)
    probe = torch.where(one_outstanding, _jiffies(2 * srtt + TCP_RTO_MIN_S), _jiffies(2 * srtt + TCP_TIMEOUT_MIN_S))
    backoff = (rto * 2.0 ** (timeouts - 1).clamp(min=0, max=30).to(srtt.dtype)).clamp(max=TCP_RTO_MAX_S)
    return torch.where(timeouts == 0, srtt + torch.minimum(probe, rto), backoff)


def _jiffies(seconds):
    """usecs_to_jiffies: whole microseconds (as the kernel keeps its RTTs), rounded up to jiffies (numpy or
    torch)."""
    ceil = torch.ceil if isinstance(seconds, torch.Tensor) else np.ceil
    us = ceil(seconds * 1e6 - 1e-6)
    return ceil(us / (1e6 / HZ)) / HZ


def _rto(srtt):
    """The RTO: SRTT + RTTVAR with RTTVAR floored at tcp_rto_min, in jiffies (``linux_tcp_timer_s``)."""
    return _jiffies(srtt + TCP_RTO_MIN_S)


def _largest(rtt, seconds: float):
    """An explicit timer, never under a round trip (numpy or torch)."""
    if isinstance(rtt, torch.Tensor):
        return torch.maximum(torch.full_like(rtt, seconds), rtt)
    return np.maximum(seconds, rtt)


def _check_loss(p: float) -> None:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"p={p!r} must be a loss probability in [0, 1)")


def parse_nic(name) -> Nic:
    """A NIC preset by name (``ideal``, ``irn``, ``srd``, ``roce-gbn``, ``roce-gbn-timeout``, ``tcp``, ``tcp-bbr``)."""
    if isinstance(name, Nic):
        return name
    if name not in NIC_PRESETS:
        raise ValueError(f"nic={name!r} must be one of {', '.join(NIC_PRESETS)}")
    return NIC_PRESETS[name]


_STREAK_CAP = 12  # every preset's timer is constant from the twelfth timeout in a row on (TCP's RTO at 120 s)


def expected_repair_s(nic: Nic, packets: int, p: float, tau: float, rtt: float, window: int = 0,
                      final: bool = True) -> float:
    """E[seconds] that repairing ``packets`` packets on one connection adds under i.i.d. loss ``p``:
    resends times ``tau`` (wire time of a packet) plus the waits before each repair round (one
    round trip, or the preset's timer for a tail loss when the step is the connection's ``final``
    one; one channel). Exact, by first-step analysis of the Markov chain the transport runs
    (``lossysim.net.transport``), ignoring the retry limit (a packet fails with probability
    p^(retries + 1)). TCP's selective repeat (``rack``) has none: what a loss waits for depends on where
    it falls among its connection's other losses and on the window; tests/test_tcp.py holds it against
    an event-level RACK-TLP instead."""
    _check_loss(p)
    if nic.rack and nic.mode == "selective":
        raise ValueError(f"nic={nic.name}: TCP's repairs (RACK-TLP) have no closed form here")
    streaks = torch.arange(_STREAK_CAP + 1)
    rtts = torch.full((_STREAK_CAP + 1,), rtt, dtype=torch.float64)
    # timers[o, s]: the tail timer after s timeouts in a row, o = whether one packet is outstanding
    timers = torch.stack([nic.timer_s(rtts, streaks, torch.full_like(streaks, o)) for o in (2, 1)]).numpy()
    if not final:
        timers = np.full_like(timers, rtt)
    dupacks = nic.dupacks if final else 0
    if nic.mode == "selective":
        return _selective_expectation(packets, p, tau, rtt, dupacks, timers)
    return _go_back_n_expectation(packets, p, tau, rtt, window, dupacks, timers[0]) - packets * tau


def _selective_expectation(n, p, tau, rtt, dupacks, timers) -> float:
    """F(m, s): expected extra seconds once a round sends m packets with s timeouts in a row behind it.
    Of the m, the last min(dupacks, m) are tails; the lost ones (t tails, u others) go again after a
    round trip, or after timers[m' == 1, s] when a tail was lost (m' packets go again)."""
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
                wait, s2 = (timers[(m2 == 1).astype(int), s], min(s + 1, cap)) if t else (rtt, 0)
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
