"""Retransmission: what repairing a lost packet costs, in transmissions and in timers.

Expected transmissions of selective repeat and go-back-N under independent loss, the window a
go-back-N sender wastes (the bandwidth-delay product in packets) and the timeouts real
transports wait for a loss nothing reveals (docs/time_model.md gives the sources).
"""
from __future__ import annotations

import math

from .links import Link

# A selective-repeat transport's timer for a tail loss: an assumption (configurable with rto_s), far
# below go-back-N's IB timeout, as a NIC built for selective repeat would set it.
SELECTIVE_RTO_S = 1e-3
TCP_RTO_MIN_S = 0.2       # Linux TCP_RTO_MIN (HZ / 5)
IB_TIMEOUT_DEFAULT = 20   # NCCL_IB_TIMEOUT default in current NCCL releases (18 and 14 earlier)


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


def default_rto(mode: str) -> float:
    """The timeout a tail loss waits when none is configured: the IB local ACK timeout at NCCL's
    default for go-back-N, ``SELECTIVE_RTO_S`` for selective repeat (see docs/time_model.md)."""
    return ib_timeout_s() if mode == "go_back_n" else SELECTIVE_RTO_S
